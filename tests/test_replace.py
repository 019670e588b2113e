"""Swapping an FFN block for its closed-form affine map, and back."""

from __future__ import annotations

import pytest
import torch

from compressor.fitting.solve import low_rank, solve_affine
from compressor.core.modeling import AffineFFN, LowRankAffineFFN
from compressor.engine.measure import collect
from compressor.fitting.replace import build_module, ffn_path, swap
from tiny import COMPRESSIBLE, PROFILE_ONLY, ffn_reference_modules, random_windows, tiny_model

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SEQ = 16
BLOCK = 1
EXPECTED_PATH = {
    "gpt2": "transformer.h.1.mlp",
    "gpt_neox": "gpt_neox.layers.1.mlp",
}


def _logits(model, windows):
    with torch.no_grad():
        return model(input_ids=windows, use_cache=False).logits


def _capture_ffn_input(model, model_type, windows):
    mod_in, _ = ffn_reference_modules(model, model_type, BLOCK)
    xs = []

    def hook(module, args, kwargs):
        xs.append((args[0] if args else next(iter(kwargs.values()))).detach().clone())
        return None

    h = mod_in.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        _logits(model, windows)
    finally:
        h.remove()
    return torch.cat(xs)


def _fit_block(model, fit_windows, held_windows):
    stats = collect(model, fit_windows, held_windows, blocks=[BLOCK], precision="float64")
    return stats[BLOCK], solve_affine(stats[BLOCK].fit)


_AFFINE_OUTPUT_CASES = list(COMPRESSIBLE)


@pytest.mark.parametrize("model_type", _AFFINE_OUTPUT_CASES)
def test_replacement_computes_affine_map_on_captured_inputs(model_type):
    model = tiny_model(model_type)
    fw, hw = random_windows(24, SEQ, seed=0), random_windows(4, SEQ, seed=1)
    st, fit = _fit_block(model, fw, hw)
    assert fit.W.shape == (st.fit.d_in, st.fit.d_out)
    x = _capture_ffn_input(model, model_type, hw)  # [B, T, d_in], float32
    original = model.get_submodule(ffn_path(model, BLOCK))
    replacement = build_module(fit, original)
    with torch.no_grad():
        got = replacement(x)
    ref = (x.double() @ fit.W + fit.b).float()
    assert got.shape == ref.shape == (4, SEQ, fit.d_out)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), float((got - ref).abs().max())


@pytest.mark.parametrize("model_type", COMPRESSIBLE)
def test_swap_affine_block_and_undo(model_type):
    model = tiny_model(model_type)
    fw, hw = random_windows(24, SEQ, seed=0), random_windows(4, SEQ, seed=1)
    _, fit = _fit_block(model, fw, hw)

    x = _capture_ffn_input(model, model_type, hw)  # [B, T, d_in], float32
    before = _logits(model, hw)

    path = ffn_path(model, BLOCK)
    assert path == EXPECTED_PATH.get(model_type, "model.layers.1.mlp")
    original = model.get_submodule(path)
    replacement = build_module(fit, original)
    assert isinstance(replacement, AffineFFN)
    assert replacement.proj.weight.dtype == torch.float32

    s = swap(model, BLOCK, replacement)
    assert s.path == path and s.original is original
    assert model.get_submodule(path) is replacement
    assert sum(m is original for m in model.modules()) == 0

    # the model now calls the replacement in block 1, with the block's usual input
    seen = []
    h = replacement.register_forward_hook(lambda m, a, o: seen.append((a[0].detach(), o.detach())) and None)
    try:
        after = _logits(model, hw)
    finally:
        h.remove()
    assert len(seen) == 1
    assert torch.equal(seen[0][0], x)  # block 0 is untouched, so block 1 sees the same input
    with torch.no_grad():
        assert torch.equal(seen[0][1], replacement(x))
    assert not torch.allclose(after, before, rtol=1e-4, atol=1e-6), "swapping did not change the logits"

    s.undo()
    assert model.get_submodule(path) is original
    restored = _logits(model, hw)
    assert torch.equal(restored, before)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_swap_low_rank_block(model_type):
    model = tiny_model(model_type)
    fw, hw = random_windows(24, SEQ, seed=0), random_windows(4, SEQ, seed=1)
    st, fit = _fit_block(model, fw, hw)
    lr = low_rank(fit, st.fit, 5)
    x = _capture_ffn_input(model, model_type, hw)
    before = _logits(model, hw)
    original = model.get_submodule(ffn_path(model, BLOCK))
    replacement = build_module(lr, original)
    assert isinstance(replacement, LowRankAffineFFN)
    assert replacement.down.weight.shape == (5, fit.d_in)
    s = swap(model, BLOCK, replacement)
    with torch.no_grad():
        got = replacement(x)
    ref = (x.double() @ lr.W + lr.b).float()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), float((got - ref).abs().max())
    assert not torch.allclose(_logits(model, hw), before, rtol=1e-4, atol=1e-6)
    s.undo()
    assert torch.equal(_logits(model, hw), before)


def _float64_qwen2_and_fit():
    model = tiny_model("qwen2")
    fw, hw = random_windows(8, SEQ, seed=0), random_windows(2, SEQ, seed=1)
    _, fit = _fit_block(model, fw, hw)
    return model.to(torch.float64), fit


def test_build_module_follows_dtype_of_replaced_module():
    model, fit = _float64_qwen2_and_fit()
    mod = build_module(fit, model.get_submodule(ffn_path(model, BLOCK)))
    assert mod.proj.weight.dtype == torch.float64 and mod.proj.bias.dtype == torch.float64
    assert torch.allclose(mod.proj.weight, fit.W.T, rtol=1e-6, atol=0)
    assert torch.allclose(mod.proj.bias, fit.b, rtol=1e-6, atol=0)


def test_build_module_keeps_float64_fit_exact_for_float64_model():
    model, fit = _float64_qwen2_and_fit()
    mod = build_module(fit, model.get_submodule(ffn_path(model, BLOCK)))
    assert torch.equal(mod.proj.weight, fit.W.T)
    assert torch.equal(mod.proj.bias, fit.b)


@pytest.mark.parametrize("model_type", PROFILE_ONLY)
def test_ffn_path_refuses_profile_only_models(model_type):
    model = tiny_model(model_type)
    with pytest.raises(ValueError, match="profile-only"):
        ffn_path(model, BLOCK)
    with pytest.raises(ValueError, match="profile-only"):
        swap(model, BLOCK, torch.nn.Identity())


@pytest.mark.parametrize("index", [3, -1])
def test_ffn_path_out_of_range(index):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="out of range"):
        ffn_path(model, index)
