"""A compressed-tensors size plan of an onloaded model (``model.offload: disk``): the same plan and the same
checkpoint, written tensor by tensor and checked tensor by tensor, with the model never whole in memory."""

from __future__ import annotations

import json

import pytest
import torch

from test_size_stream import _folder, _recipe

import compressor

pytestmark = [pytest.mark.usefixtures("torch_single_thread")]


def _quantization(folder):
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def test_an_onloaded_compressed_tensors_size_writes_the_in_memory_runs_checkpoint(tmp_path, monkeypatch):
    """W4A16's size planned with the layers onloaded: the same schemes, the same safetensors bytes and the same
    quantization config as the model held in memory (the streamed one packed a few rows at a time); the GPTQ codes
    wait in the work folder, mapped back; the reload check compares every tensor; plain transformers loads it."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from compressor.output.ctensors import stream
    from compressor.output.ctensors.target import CompressedTensorsTarget
    from compressor.pipeline.size import rounding

    src = _folder(tmp_path)
    held = compressor.run(_recipe(tmp_path, src, "held", "none", size="W4A16"))
    spilled = []
    spill = CompressedTensorsTarget.spill

    def spy(self, raw, path, at_least):
        back = spill(self, raw, path, at_least)
        spilled.append(path.with_name(path.name + ".pt").is_file() and back is not raw and all(
            torch.equal(back[m].ints, r.ints) and torch.equal(back[m].scales, r.scales) for m, r in raw.items()))
        return back

    monkeypatch.setattr(rounding, "SPILL_BYTES", 0)
    monkeypatch.setattr(CompressedTensorsTarget, "spill", spy)
    monkeypatch.setattr(stream, "CHUNK_ROWS", 7)  # packed and checked 7 rows at a time: the same bytes
    streamed = compressor.run(_recipe(tmp_path, src, "streamed", "disk", size="W4A16"))
    assert held.exit_code == 0 and streamed.exit_code == 0, streamed.report.get("message")
    a, b = held.report["size_plan"], streamed.report["size_plan"]
    assert {r["tensor"]: r["type"] for r in a["tensors"]} == {r["tensor"]: r["type"] for r in b["tensors"]}
    assert len({r["type"] for r in b["tensors"]}) > 1  # a mix, not one scheme: the plan is compared
    assert spilled and all(spilled)
    assert (held.output / "model.safetensors").read_bytes() == (streamed.output / "model.safetensors").read_bytes()
    assert _quantization(held.output) == _quantization(streamed.output)
    check = streamed.report["verification"]["compressed-tensors"]
    assert check["passed"] and check["tensors_compared"] == 3 * 9 + 3 and "decoded codes" in check["compared_with"]
    assert check["tensor_bytes"] == held.report["verification"]["compressed-tensors"]["tensor_bytes"]
    assert not list(tmp_path.glob(".*.size-*"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(streamed.output))
    assert type(reloaded).__module__.startswith("transformers.")


def test_the_streamed_writer_shards_as_save_pretrained_does(tmp_path, monkeypatch):
    """Shards smaller than the model: numbered files and the JSON index naming every tensor's shard, which plain
    transformers reads; the reload check still passes."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from compressor.output.ctensors import stream

    monkeypatch.setattr(stream, "SHARD_BYTES", 20_000)
    src = _folder(tmp_path)
    run = compressor.run(_recipe(tmp_path, src, "out", "disk", size="W4A16"))
    assert run.exit_code == 0, run.report.get("message")
    shards = sorted(run.output.glob("model-*-of-*.safetensors"))
    index = json.loads((run.output / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert not list(run.output.glob(".shard-*"))
    assert any(k.endswith("weight_packed") for k in index["weight_map"])
    AutoModelForCausalLM.from_pretrained(str(run.output))


def test_the_reload_check_names_a_tensor_that_differs(tmp_path):
    """A quantized layer that does not decode to its codes (a scale changed in the reload) and a norm that
    differs are caught: the check names the tensor."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from compressor.core.onload import is_offloaded
    from compressor.inputs.load import load_model
    from compressor.output.ctensors.schemes import SchemePlan, layer_schemes
    from compressor.output.ctensors.stream import check_reload, write_streamed

    model = load_model(str(_folder(tmp_path)), offload="disk")[0]
    assert is_offloaded(model)
    plan = SchemePlan()
    schemes = layer_schemes(model, {"ct_scheme": "W4A16_G32"})
    (tmp_path / "w").mkdir()
    write_streamed(model, plan, schemes, torch.float32, tmp_path / "w")
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "w"), dtype=torch.float32)
    assert check_reload(model, reloaded, plan, schemes, torch.float32)["passed"]
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "w"), dtype=torch.float32)
    with torch.no_grad():
        reloaded.model.layers[1].mlp.down_proj.weight_scale.mul_(1.5)
    assert "model.layers.1.mlp.down_proj" in check_reload(model, reloaded, plan, schemes, torch.float32)["failed_at"]
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "w"), dtype=torch.float32)
    with torch.no_grad():
        reloaded.model.norm.weight.add_(1e-3)
    assert check_reload(model, reloaded, plan, schemes, torch.float32)["failed_at"].startswith(
        "model.norm.weight")
