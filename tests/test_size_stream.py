"""A size plan with the decoder layers onloaded (``model.offload: disk``): the same statistics and the same file.

The streamed path reads each layer's weights from the checkpoint when it runs: the loss gradients are measured
one layer at a time with recomputation (:mod:`compressor.engine.layerwise`), the weights priced and rounded are
read tensor by tensor, and the F16 and the planned file are written tensor by tensor. Each piece is compared with
the in-memory run: F to the bit, and the written file byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tiny import byte_level_tokenizer

import compressor
from compressor.engine.layerwise import output_fisher_sequential
from compressor.engine.tensorstats import output_fisher

pytestmark = [pytest.mark.usefixtures("torch_single_thread")]

TEXT = ("The quick brown fox jumps over the lazy dog. Numbers 123 4567 and words, words; more words! "
        "A second sentence with other letters: xylophone, quartz, jazz. ") * 12


def _tiny(model_type: str, **extra):
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=320, max_position_embeddings=256) | extra
    cfg, cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[model_type]
    if model_type == "gemma3_text":
        common |= dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
                                                                   "full_attention"])
    torch.manual_seed(0)
    model = cls(cfg(**common)).float().eval()
    with torch.no_grad():  # logits far from uniform, so that a wrong gradient shows
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma3_text"])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_layer_by_layer_loss_gradients_are_the_whole_models(model_type, autocast):
    """F at every linear's output and at the embedding, from recomputed layers, equals the whole-model pass's
    (same batches, same order of sums), also under the bfloat16 autocast the size statistics use."""
    from contextlib import nullcontext

    model = _tiny(model_type)
    windows = torch.randint(0, 320, (5, 24), generator=torch.Generator().manual_seed(1))
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else nullcontext
    with ctx():
        whole = output_fisher(model, windows, batch_size=2)
    with ctx():
        layered = output_fisher_sequential(model, windows, batch_size=2)
    assert whole.grad_sq.keys() == layered.grad_sq.keys() and len(whole.grad_sq) > 3 * 4
    for name, g in whole.grad_sq.items():
        assert torch.equal(layered.grad_sq[name], g), name
    assert torch.equal(whole.token_counts, layered.token_counts) and whole.tokens == layered.tokens
    assert all(p.grad is None for p in model.parameters())


def _folder(tmp_path: Path, model_type: str = "llama") -> Path:
    tok = byte_level_tokenizer(TEXT)
    src = tmp_path / "src"
    model = _tiny(model_type)
    model.save_pretrained(src)  # safetensors: the onloaded run reads them in place
    tok.save_pretrained(src)
    rng = np.random.default_rng(0)
    words = TEXT.split()
    for name, seed in (("cal.txt", 0), ("eval.txt", 1)):
        rng = np.random.default_rng(seed)
        (tmp_path / name).write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(600)) + "\n")
    return src


def _recipe(tmp_path: Path, src: Path, out: str, offload: str, size: str = "Q4_0"):
    return compressor.recipe_from_dict({
        "model": {"source": str(src), "offload": offload, "dtype": "float32"},
        "calibration": {"dataset": str(tmp_path / "cal.txt"), "max_tokens": 2048, "seq_len": 32},
        "evaluation": {"dataset": str(tmp_path / "eval.txt"), "max_tokens": 1024, "seq_len": 64, "stride": 64},
        "policy": {"ppl_budget": 5.0}, "measure": {"cache": False},
        "output": {"path": str(tmp_path / out), "size": size, "dtype": "float32"},
    })


def test_an_onloaded_size_run_writes_the_in_memory_runs_file(tmp_path, monkeypatch):
    """``model.offload: disk`` plans the same file, byte for byte, as the model held in memory: the same
    prices (same statistics), the same types, the same GPTQ bytes; llama.cpp runs it. The onloaded run's
    rounded bytes go through the work folder (mapped back from disk), the held run's stay in memory; so do the
    GPTQ factors pricing made, which the rounding reads in place of the moments: each Ĥ is factored once in
    either run."""
    pytest.importorskip("llama_cpp")
    from compressor.fitting import gridround
    from compressor.pipeline.size import prices, rounding

    src = _folder(tmp_path)
    monkeypatch.setattr(prices, "ROUNDED_BYTES", 0)  # no bytes kept from pricing: the rounding reads every factor
    solves = {"held": 0, "streamed": 0}
    real = gridround.factor

    def counted(run):
        def factor(*a, **kw):
            solves[run] += 1
            return real(*a, **kw)
        return factor

    monkeypatch.setattr(gridround, "factor", counted("held"))
    held = compressor.run(_recipe(tmp_path, src, "held", "none"))
    monkeypatch.setattr(gridround, "factor", counted("streamed"))
    mapped = []
    kept = rounding.Compensator._kept
    monkeypatch.setattr(rounding, "SPILL_BYTES", 0)  # every tiny tensor's bytes spilled
    monkeypatch.setattr(rounding.Compensator, "_kept",
                        lambda self, *a: mapped.append(kept(self, *a)) or mapped[-1])
    streamed = compressor.run(_recipe(tmp_path, src, "streamed", "disk"))
    assert held.exit_code == 0 and streamed.exit_code == 0, streamed.report.get("message")
    a, b = held.report["size_plan"], streamed.report["size_plan"]
    assert {r["tensor"]: r["type"] for r in a["tensors"]} == {r["tensor"]: r["type"] for r in b["tensors"]}
    assert (held.output / "model.gguf").read_bytes() == (streamed.output / "model.gguf").read_bytes()
    assert mapped and all(isinstance(m, np.memmap) for m in mapped)
    assert solves["streamed"] == solves["held"] > 0
    assert streamed.report["verification"]["gguf"]["gate_passed"]
    assert not list(tmp_path.glob(".*.size-*"))


def test_a_size_run_that_would_not_fit_memory_onloads_by_itself(tmp_path, monkeypatch, caplog):
    """With less memory than the model held in float32 and its statistics need (``COMPRESSOR_MEMORY_LIMIT``,
    as a container's limit would set it), a GGUF size run onloads its layers before loading, says so, and
    writes the file it writes in memory."""
    import logging

    pytest.importorskip("llama_cpp")
    src = _folder(tmp_path)
    held = compressor.run(_recipe(tmp_path, src, "held", "none"))
    monkeypatch.setenv("COMPRESSOR_MEMORY_LIMIT", "1MB")
    with caplog.at_level(logging.WARNING):
        limited = compressor.run(_recipe(tmp_path, src, "limited", "none"))
    assert limited.exit_code == 0 and "model.offload: disk" in caplog.text and "available" in caplog.text
    assert "offload: disk" in (limited.output / "recipe.yaml").read_text()  # the run says how it ran
    assert (held.output / "model.gguf").read_bytes() == (limited.output / "model.gguf").read_bytes()


def test_a_size_that_cannot_stream_and_does_not_fit_is_refused_before_loading(tmp_path, monkeypatch, no_loading):
    """A format planned in memory only (both built-in ones stream: compressed-tensors made not to here): over the
    limit it is refused (exit 2) before the model loads, naming the memory needed and the alternatives; nothing
    is written."""
    from compressor.output.ctensors.target import CompressedTensorsTarget

    monkeypatch.setattr(CompressedTensorsTarget, "streams", False)
    src = _folder(tmp_path)
    monkeypatch.setenv("COMPRESSOR_MEMORY_LIMIT", "1MB")
    recipe = _recipe(tmp_path, src, "out", "none", size="W4A16")
    with pytest.raises(compressor.InputError, match=r"(?s)GB are available.*plan gguf"):
        compressor.run(recipe)
    assert not (tmp_path / "out").exists()


def test_memory_available_is_the_least_of_the_system_the_cgroup_and_the_users_limit(monkeypatch):
    from compressor.core import hostmem

    monkeypatch.setattr(hostmem, "_meminfo_available", lambda: 20 * 10**9)
    monkeypatch.setattr(hostmem, "_cgroup_room", lambda: 6 * 10**9)
    monkeypatch.delenv(hostmem.LIMIT_ENV, raising=False)
    assert hostmem.available_bytes() == 6 * 10**9
    monkeypatch.setenv(hostmem.LIMIT_ENV, "2GiB")
    assert hostmem.available_bytes() == 2 * 2**30
    with pytest.raises(ValueError, match="8GB"):
        hostmem.parse_bytes("lots")


def test_the_gguf_writer_holds_a_few_tensors_at_a_time(tmp_path, monkeypatch):
    """Every tensor's info goes in the header first; then each tensor is read from the model only when it is
    about to be written, at most :func:`~compressor.core.threads.workers` ahead of the file: a model onloaded
    from disk is never held whole by the writer (before, every tensor was held in float32 until the end)."""
    gguf = pytest.importorskip("gguf")
    from compressor.core.threads import workers
    from compressor.inputs.load import ResolvedSource
    from compressor.output.base import WriteRequest
    from compressor.output.gguf import tensors as gt
    from compressor.output.gguf.write import write_gguf

    model, tok = _tiny("llama"), byte_level_tokenizer(TEXT)
    events: list[str] = []
    real_read = gt._read
    monkeypatch.setattr(gt, "_read", lambda *a: events.append("read") or real_read(*a))
    real_write = gguf.GGUFWriter.write_tensor_data
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data",
                        lambda self, t: events.append("write") or real_write(self, t))
    request = WriteRequest(model=model, tokenizer=tok, compression={}, dtype=torch.float16,
                           source=ResolvedSource(str(tmp_path), None, True), options={"quant": "f16"})
    write_gguf(request, tmp_path / "m.gguf", {"quant": "f16"})
    ahead = max(events[: i + 1].count("read") - events[: i + 1].count("write") for i in range(len(events)))
    assert events.count("read") == events.count("write") > 20 and ahead <= workers()
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    w = np.asarray(reader.get_tensor(next(i for i, t in enumerate(reader.tensors)
                                          if t.name == "blk.1.ffn_down.weight")).data)
    assert np.array_equal(w, model.model.layers[1].mlp.down_proj.weight.detach().numpy().astype(np.float16))


def test_a_quantized_checkpoint_as_a_size_source_is_refused_before_loading(tmp_path, no_loading):
    """A compressed-tensors folder (compressor's or llm-compressor's output) holds integer codes: a size from it
    is refused (exit 2) before the model loads, naming what to give instead (it failed after loading on
    ``q_proj.weight_scale``)."""
    pytest.importorskip("compressed_tensors")
    from test_ctensors import model_of, request_for, write_and_verify

    src = tmp_path / "w4a16"
    write_and_verify(request_for(model_of("llama"), ct_scheme="W4A16"), src)
    byte_level_tokenizer(TEXT).save_pretrained(src)
    _folder(tmp_path / "texts")
    for name in ("cal.txt", "eval.txt"):
        (tmp_path / name).write_text((tmp_path / "texts" / name).read_text())
    with pytest.raises(compressor.InputError, match=r"quantized checkpoint.*float.*GGUF") as refused:
        compressor.run(_recipe(tmp_path, src, "out", "none"))
    assert "compressed-tensors" in str(refused.value) and not (tmp_path / "out").exists()
