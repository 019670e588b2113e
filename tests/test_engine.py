"""The layer-sequential engine (:class:`compressor.engine.walker.LayerWalker`).

Its statistics are checked against the whole-model pass of
:func:`compressor.engine.measure.collect` and, for the teacher targets, against
moments computed here from rows captured with forward hooks.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from compressor.engine.walker import LayerWalker
from compressor.fitting.kinds import BlockData, get_kind
from compressor.engine.measure import PARTS, collect
from compressor.recipe import HybridReplacement
from compressor.core.stats import Moments
from tiny import (
    COMPRESSIBLE,
    activation_name,
    block_reference,
    ffn_down_reference,
    ffn_reference_modules,
    random_windows,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SEQ = 16


def _assert_moments_equal(a: Moments, b: Moments, rtol: float = 1e-9, what: str = "") -> None:
    assert a.n == b.n, (what, a.n, b.n)
    if a.n == 0:
        return
    for name in ("mx", "my", "cxx", "cxy", "cyy_diag"):
        x, y = getattr(a, name), getattr(b, name)
        scale = float(y.abs().max()) or 1.0
        err = float((x - y).abs().max()) / scale
        assert err <= rtol, (what, name, err)


def _walk_all(walker: LayerWalker, **kw) -> dict:
    got = {}
    walker.walk(lambda i, st: got.__setitem__(i, st), **kw)
    return got


# --------------------------------------------------------------------------------------------------
# 7. Sequential statistics == the whole-model pass
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", COMPRESSIBLE)
def test_sequential_statistics_equal_whole_model_pass(model_type):
    model = tiny_model(model_type)
    fit_w, held_w = random_windows(12, SEQ, seed=0), random_windows(6, SEQ, seed=1)
    # a low spike factor, so that the held-out spike partition is not empty
    whole = collect(model, fit_w, held_w, precision="float64", spike_factor=1.2)
    walker = LayerWalker(model, {"fit": fit_w, "heldout": held_w})
    seq = _walk_all(walker, compute_dtype=torch.float64, spike_factor=1.2)
    assert sorted(seq) == sorted(whole) == list(range(len(walker.layers)))
    for i, st in seq.items():
        ref = whole[i]
        assert st.index == i and st.zfit is None and st.zheld is None
        _assert_moments_equal(st.xy.fit, ref.fit, 1e-10, f"block {i} fit")
        assert st.xy.spike_threshold == pytest.approx(ref.spike_threshold, rel=1e-6)
        for part in PARTS:
            _assert_moments_equal(st.xy.heldout[part], ref.heldout[part], 1e-10, f"block {i} {part}")
        assert st.xy.heldout["sink"].n == held_w.shape[0]  # position 0 of every held-out window
        assert st.xy.heldout_total().n == held_w.numel()
        assert st.resid_energy > 0
    assert any(st.xy.heldout["spike"].n for st in seq.values())


# --------------------------------------------------------------------------------------------------
# 8. Teacher targets against rows captured by hand
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def _rows(model, model_type: str, windows, index: int) -> dict[str, torch.Tensor]:
    """Block ``index``'s FFN input x, hidden units h, FFN output y and layer output (float64 rows)."""
    mlp, _ = ffn_reference_modules(model, model_type, index)
    down = ffn_down_reference(model, model_type, index)
    layer = block_reference(model, model_type, index)
    got: dict[str, list] = {"x": [], "h": [], "y": [], "out": []}

    def first(obj):
        return obj[0] if isinstance(obj, (tuple, list)) else obj

    handles = [
        mlp.register_forward_pre_hook(lambda m, a, k: got["x"].append(a[0] if a else first(list(k.values()))),
                                      with_kwargs=True),
        down.register_forward_pre_hook(lambda m, a: got["h"].append(a[0])),
        mlp.register_forward_hook(lambda m, a, o: got["y"].append(first(o))),
        layer.register_forward_hook(lambda m, a, o: got["out"].append(first(o))),
    ]
    try:
        model(input_ids=windows, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {k: torch.cat([t.reshape(-1, t.shape[-1]) for t in v]).double() for k, v in got.items()}


def _direct_moments(z: torch.Tensor, y: torch.Tensor) -> Moments:
    """Moments of rows computed in one shot (no chunking, no merge)."""
    z, y = z.double(), y.double()
    mx, my = z.mean(0), y.mean(0)
    zc, yc = z - mx, y - my
    return Moments(z.shape[1], y.shape[1], n=z.shape[0], mx=mx, my=my, cxx=zc.T @ zc, cxy=zc.T @ yc,
                   cyy_diag=(yc * yc).sum(0))


def _hybrid_on_layer0(model, walker, got: dict):
    """on_layer: replace layer 0's FFN with a hybrid at half its units; record every layer's stats."""
    kind, cfg = get_kind("hybrid"), HybridReplacement(keep=0.5, step_units=8)
    act = activation_name(model)

    def on_layer(i, st):
        got[i] = st
        if i != 0:
            return None
        ffn = model.get_submodule(f"{walker.blocks_path}.0.{walker.spec.ffn_in}")
        data = BlockData(0, ffn, walker.spec, act, st.xy.fit, st.xy.heldout_total(), st.zfit, st.zheld)
        got["replacement"] = kind.fit(data, cfg, data.d_ff // 2).build(ffn)
        return got["replacement"]

    return on_layer


@pytest.mark.parametrize("target", ["teacher_output", "teacher_residual"])
@pytest.mark.parametrize("model_type", ["llama", "gpt_neox"])
def test_teacher_target_statistics_equal_captured_rows(model_type, target):
    model = tiny_model(model_type).double()  # exact comparison: no float32 rounding in the streams
    fit_w, held_w = random_windows(8, SEQ, seed=0), random_windows(4, SEQ, seed=1)
    teacher = {s: _rows(model, model_type, w, 1) for s, w in (("fit", fit_w), ("heldout", held_w))}
    original_ffn0 = ffn_reference_modules(model, model_type, 0)[0]

    walker = LayerWalker(model, {"fit": fit_w, "heldout": held_w}, batch_size=3)
    got: dict = {}
    walker.walk(_hybrid_on_layer0(model, walker, got), hidden=True, target=target,
                compute_dtype=torch.float64, layers=[0, 1])
    # the walk installed the replacement in layer 0 and left layer 1 alone
    assert ffn_reference_modules(model, model_type, 0)[0] is got["replacement"] is not original_ffn0
    student = {s: _rows(model, model_type, w, 1) for s, w in (("fit", fit_w), ("heldout", held_w))}
    assert not torch.allclose(student["fit"]["x"], teacher["fit"]["x"])  # layer 1 now sees other inputs

    st = got[1]
    for split, walked in (("fit", st.zfit), ("heldout", st.zheld)):
        s, t = student[split], teacher[split]
        if target == "teacher_output":
            y = t["y"]
        else:  # what layer 1's FFN must add to the student's residual to land on the teacher's
            y = s["y"] + (t["out"] - s["out"])
        z = torch.cat([s["x"], s["h"]], dim=1)
        _assert_moments_equal(walked, _direct_moments(z, y), 1e-9, f"{target} {split}")
    # the x → y statistics carry the same target
    s, t = student["fit"], teacher["fit"]
    y = t["y"] if target == "teacher_output" else s["y"] + (t["out"] - s["out"])
    _assert_moments_equal(st.xy.fit, _direct_moments(s["x"], y), 1e-9, "xy fit")


def test_teacher_residual_refused_for_post_norm_ffn():
    model = tiny_model("gemma3_text")
    walker = LayerWalker(model, {"fit": random_windows(2, SEQ), "heldout": random_windows(1, SEQ, seed=1)})
    calls = []
    with pytest.raises(ValueError, match=r"teacher_residual.*gemma3_text.*(teacher_output|none)"):
        walker.walk(lambda i, st: calls.append(i), target="teacher_residual")
    assert calls == []
    with pytest.raises(ValueError, match="target must be one of"):
        walker.walk(lambda i, st: None, target="teacher")


# --------------------------------------------------------------------------------------------------
# 9. Only one layer's statistics alive at a time
# --------------------------------------------------------------------------------------------------


def test_previous_layer_statistics_are_freed():
    model = tiny_model("llama")
    walker = LayerWalker(model, {"fit": random_windows(4, SEQ), "heldout": random_windows(2, SEQ, seed=1)})
    refs: list = []
    alive_at: dict[int, list[bool]] = {}

    def on_layer(i, st):
        # no gc.collect(): the walk must free them by reference counting, at once
        alive_at[i] = [r() is not None for r in refs]
        refs.extend(weakref.ref(o) for o in (st, st.xy, st.zfit, st.zheld, st.xy.fit, st.zfit.cxx))
        return None

    walker.walk(on_layer, hidden=True)
    n = len(walker.layers)
    assert sorted(alive_at) == list(range(n))
    for i in range(1, n):
        assert not any(alive_at[i]), f"layer {i}: statistics of earlier layers still referenced: {alive_at[i]}"
    gc.collect()
    assert all(r() is None for r in refs)


# --------------------------------------------------------------------------------------------------
# 10. Ragged batches
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["none", "teacher_output"])
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt2"])
def test_ragged_batches_give_the_same_statistics(model_type, target):
    fit_w, held_w = random_windows(10, SEQ, seed=0), random_windows(5, SEQ, seed=1)
    results = []
    for batch_size in (3, 10):
        model = tiny_model(model_type).double()
        walker = LayerWalker(model, {"fit": fit_w, "heldout": held_w}, batch_size=batch_size)
        assert [tuple(b.shape) for _, b in walker.batches][:4] == (
            [(3, SEQ)] * 3 + [(1, SEQ)] if batch_size == 3 else [(10, SEQ), (5, SEQ)])
        got: dict = {}
        on_layer = _hybrid_on_layer0(model, walker, got) if target != "none" else (
            lambda i, st: got.__setitem__(i, st))
        walker.walk(on_layer, hidden=True, target=target, compute_dtype=torch.float64)
        results.append(got)
    ragged, whole = results
    for i in range(len(walker.layers)):
        a, b = ragged[i], whole[i]
        _assert_moments_equal(a.xy.fit, b.xy.fit, 1e-9, f"block {i} fit")
        for part in PARTS:
            _assert_moments_equal(a.xy.heldout[part], b.xy.heldout[part], 1e-9, f"block {i} {part}")
        _assert_moments_equal(a.zfit, b.zfit, 1e-9, f"block {i} zfit")
        _assert_moments_equal(a.zheld, b.zheld, 1e-9, f"block {i} zheld")
        assert a.resid_energy == pytest.approx(b.resid_energy, rel=1e-6)  # summed in float32


def test_loss_gradients_run_in_slices_that_fit_the_backward_budget(monkeypatch):
    """The backward of a large-vocabulary model runs a few windows at a time; the sums are the same."""
    import types

    from compressor.engine import sensitivity
    from compressor.engine.sensitivity import backward_rows, output_grad_moments

    model = tiny_model("llama")
    windows = random_windows(6, SEQ, seed=0)
    modules = {i: f"model.layers.{i}.mlp" for i in range(len(model.model.layers))}
    whole = output_grad_moments(model, windows, modules, batch_size=6)
    monkeypatch.setattr(sensitivity, "BACKWARD_BUDGET_BYTES", 1)  # one window per backward
    assert backward_rows(model, SEQ, 6) == 1
    sliced = output_grad_moments(model, windows, modules, batch_size=6)
    for i in whole:
        torch.testing.assert_close(sliced[i], whole[i], rtol=1e-5, atol=1e-12)
    monkeypatch.undo()

    def shaped(**cfg):
        return types.SimpleNamespace(config=types.SimpleNamespace(**cfg))

    qwen = shaped(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, vocab_size=151936)
    smol = shaped(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152)
    assert backward_rows(qwen, 128, 16) == 6  # 16 windows held 16.8 GB on Qwen2.5-Coder-1.5B
    assert backward_rows(smol, 128, 16) == 16  # SmolLM2: the whole batch, as before
