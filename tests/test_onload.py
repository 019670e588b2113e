"""Onloading (``model.offload``): decoder layers stay on disk and are read one at a time.

The same tiny checkpoints as the pipeline tests, loaded twice — whole in memory
and with every decoder layer offloaded to disk — must give the same profile,
the same decisions and the same saved weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import save_tiny_checkpoint

import compressor
from compressor.inputs.load import load_model
from compressor.core.onload import (
    execution_device, input_device, is_offloaded, named_tensors, offloaded_embeddings, tensor,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "stats-cache"
    monkeypatch.setenv("COMPRESSOR_CACHE_DIR", str(d))
    return d


def _recipe(src: Path, out: Path, offload: str, **sections) -> compressor.Recipe:
    data = {
        "model": {"source": str(src), "offload": offload},
        "calibration": {"dataset": "embedded", "max_tokens": 2048, "seq_len": 32},
        "evaluation": {"max_tokens": 1024, "seq_len": 64, "stride": 32},
        "policy": {"strategy": "allocate", "ppl_budget": 0.5, "max_backoff": 2, "allocation": "residual"},
        "replacement": {"kind": "prune"},
        "output": {"path": str(out), "dtype": "float32"},
        "measure": {"cache": False},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return compressor.recipe_from_dict(data)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_disk_offload_keeps_layers_off_memory_and_reads_them_back(tmp_path, model_type):
    src = save_tiny_checkpoint(tmp_path / "in", model_type)
    whole, _, _ = load_model(str(src))
    off, _, _ = load_model(str(src), offload="disk")
    assert is_offloaded(off) and not is_offloaded(whole)
    meta = [n for n, p in off.named_parameters() if p.device.type == "meta"]
    # decoder layers, and an untied embedding and head (gpt2's are one tensor: it stays)
    embeddings = {f"{m}.weight" for m in offloaded_embeddings(off)}
    assert meta and all(".h." in n or ".layers." in n or n in embeddings for n in meta)
    assert bool(embeddings) == (model_type == "llama") and embeddings <= set(meta)
    assert execution_device(off) == torch.device("cpu") and input_device(off) == torch.device("cpu")
    ref = dict(whole.named_parameters())
    got = dict(named_tensors(off, buffers=False))
    assert set(got) == set(ref)
    for name, t in got.items():
        assert torch.equal(t, ref[name]), name
    name = meta[0]
    assert torch.equal(tensor(off, name), ref[name])
    ids = torch.randint(3, 100, (2, 16))
    with torch.no_grad():
        assert torch.equal(off(input_ids=ids).logits, whole(input_ids=ids).logits)


def test_an_untied_embedding_and_head_on_disk_generate_what_memory_generates(tmp_path):
    """The embedding and head wait on disk with the layers; a forward, sampling and reading them back give what
    the model held in memory gives (model.device is then the meta device: transformers' generate copes)."""
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    whole, _, _ = load_model(str(src))
    off, _, _ = load_model(str(src), offload="disk")
    assert not whole.config.tie_word_embeddings
    assert off.get_input_embeddings().weight.device.type == "meta"
    assert off.get_output_embeddings().weight.device.type == "meta"
    ids = torch.randint(3, 100, (1, 8))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(off.generate(input_ids=ids, **kw), whole.generate(input_ids=ids, **kw))
    assert torch.equal(tensor(off, "lm_head.weight"), whole.lm_head.weight)


def test_profile_with_offload_equals_in_memory(tmp_path):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    kw = dict(max_tokens=1024, seq_len=32)
    a = compressor.profile(str(src), **kw)
    b = compressor.profile(str(src), offload="disk", **kw)
    assert [p.r2_lin for p in a.blocks] == [p.r2_lin for p in b.blocks]
    assert [p.outlier_sst_share for p in a.blocks] == [p.outlier_sst_share for p in b.blocks]


@pytest.mark.parametrize("kind", ["prune", "affine"])
def test_run_with_offload_equals_in_memory(tmp_path, kind):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    extra = {} if kind == "prune" else {"policy": {"strategy": "greedy", "threshold": -100}}
    a = compressor.run(_recipe(src, tmp_path / "a", "none", replacement={"kind": kind}, **extra))
    b = compressor.run(_recipe(src, tmp_path / "b", "disk", replacement={"kind": kind}, **extra))
    assert a.exit_code == b.exit_code == 0
    assert [d["decision"] for d in a.report["blocks"]] == [d["decision"] for d in b.report["blocks"]]
    assert [d["size"] for d in a.report["blocks"]] == [d["size"] for d in b.report["blocks"]]
    assert a.report["perplexity"]["final"]["ppl"] == b.report["perplexity"]["final"]["ppl"]
    assert b.report["reload_check"]["passed"]
    wa, wb = _weights(a.output), _weights(b.output)
    assert set(wa) == set(wb)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    # the onloaded output loads like any other
    # replacements in onloaded layers are onloaded too: nothing of the compressed FFNs stays in RAM
    kept = [d["module"] for d in b.report["blocks"] if d["decision"] == "kept"]
    assert kept
    for path in kept:
        assert all(p.device.type == "meta" for p in b.result.model.get_submodule(path).parameters()), path
    re = compressor.load_compressed(b.output)
    assert sum(p.numel() for p in re.parameters()) == b.report["params"]["after"]


def test_offload_refuses_a_dtype_it_cannot_stream(tmp_path, no_loading):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    recipe = _recipe(src, tmp_path / "o", "disk", output={"dtype": "bfloat16"})
    with pytest.raises(compressor.InputError, match="output.dtype"):
        compressor.run(recipe)
    assert not (tmp_path / "o").exists()


def test_offloaded_nan_weight_is_found(tmp_path):
    from compressor.core.finite import NonFiniteWeightsError, check_weights_finite

    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    model, _, _ = load_model(str(src))
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(src)
    off, _, _ = load_model(str(src), offload="disk")
    with pytest.raises(NonFiniteWeightsError, match=r"layers\.1\.mlp\.up_proj"):
        check_weights_finite(off)


def test_block_store_spills_statistics_and_gives_them_back(tmp_path):
    from compressor.fitting.kinds.base import BlockData
    from compressor.engine.spill import BlockStore
    from compressor.core.stats import Moments

    g = torch.Generator().manual_seed(0)

    def moments(d_in, d_out):
        m = Moments(d_in, d_out)
        m.update(torch.randn(50, d_in, generator=g, dtype=torch.float64),
                 torch.randn(50, d_out, generator=g, dtype=torch.float64), torch.float64)
        return m

    data = BlockData(3, torch.nn.Identity(), None, "silu", moments(4, 4), moments(4, 4), moments(10, 4))
    data.cache["obs"] = "kept in RAM"
    store = BlockStore(8, spill=True)
    store[3] = data
    assert 3 in store and store._data[3].zfit is None  # only the small parts stay in RAM
    back = store[3]
    for name in ("fit", "heldout", "zfit"):
        a, b = getattr(data, name), getattr(back, name)
        assert a.n == b.n and torch.equal(a.cxx, b.cxx) and torch.equal(a.cxy, b.cxy) and torch.equal(a.mx, b.mx)
    assert back.zheld is None and back.cache is data.cache
    folder = store._folder
    assert folder.is_dir()
    store.close()
    assert not folder.exists()


def test_block_store_reads_recorded_statistics_instead_of_writing_them(tmp_path):
    """Statistics a run-state record already holds are read back from it: no second copy on disk."""
    from compressor.fitting.kinds.base import BlockData
    from compressor.engine.spill import BlockStore
    from compressor.core.stats import Moments

    m = Moments(4, 4)
    m.update(torch.randn(20, 4, dtype=torch.float64), torch.randn(20, 4, dtype=torch.float64), torch.float64)
    ffn = torch.nn.Identity()
    data = BlockData(2, ffn, None, "silu", m, m, m)
    loads = []
    stored = BlockData(2, None, None, "silu", m, m, m)
    store = BlockStore(4, spill=True, folder=tmp_path / "state")
    store.keep_recorded(2, data, lambda: loads.append(1) or stored)
    assert 2 in store and store._data[2].fit is None and loads == []
    back = store[2]
    assert loads == [1] and back.ffn is ffn and back.fit is m and back.zfit is m
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").rglob("*.safetensors"))
    # a store that keeps statistics in RAM keeps them whole
    ram = BlockStore(4, spill=False)
    ram.keep_recorded(2, data, lambda: pytest.fail("read back from disk while in RAM"))
    assert ram[2] is data
