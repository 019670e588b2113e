"""``output.size`` planning a compressed-tensors checkpoint (:mod:`compressor.output.ctensors.target`).

End to end on a tiny llama whose linears take the 128-input groups: ``output.size: W4A16`` writes a folder
plain transformers loads with no flags, no larger than the uniform W4A16 checkpoint of the same model (to
the byte, the tensors' bytes being known before writing), its plan (a scheme per fused unit) in the report,
measured after reloading on every gate domain with the KL from the original, and the uniform W4A16
checkpoint measured beside it. What cannot be planned is refused before loading, naming the fix.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

pytest.importorskip("compressed_tensors")

from test_gguf import TEXT, gw, needs_llama_cpp, tiny, tokenizer  # noqa: E402,F401  (tokenizer: a fixture)

import compressor  # noqa: E402
from compressor.core.errors import RecipeError  # noqa: E402
from compressor.output.ctensors.grids import SCHEMES  # noqa: E402
from compressor.output.base import WriteRequest  # noqa: E402


def _source(tmp_path, tokenizer):
    """A tiny llama (hidden 128, FFN 256: every scheme's groups divide its rows) as an F16 GGUF, and text."""
    needs_llama_cpp()
    from compressor.inputs.load import ResolvedSource

    src = tmp_path / "src"
    src.mkdir()
    model = tiny("llama", hidden_size=128, intermediate_size=256, head_dim=32)
    ids = torch.tensor(tokenizer(TEXT).input_ids[:256])
    gw.GGUFWriter().write(WriteRequest(model=model, tokenizer=tokenizer, compression={}, dtype=torch.float32,
                                       source=ResolvedSource("/nonexistent", None, True), probe_tokens=ids,
                                       options={"quant": "f16", "file": "tiny.gguf"}), src)
    words = TEXT.split()
    for name, seed in (("cal.txt", 0), ("eval.txt", 1), ("code.txt", 2)):
        rng = np.random.default_rng(seed)
        (tmp_path / name).write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(500)) + "\n")
    return src / "tiny.gguf"


def _recipe(tmp_path, source, out: str, size: str, policy: dict | None = None, **output):
    return compressor.recipe_from_dict({
        "model": {"source": str(source)},
        "calibration": {"dataset": str(tmp_path / "cal.txt"), "max_tokens": 2048, "seq_len": 32},
        "evaluation": [{"dataset": str(tmp_path / "eval.txt"), "max_tokens": 1024, "seq_len": 64, "stride": 64},
                       {"dataset": str(tmp_path / "code.txt"), "max_tokens": 1024, "seq_len": 64, "stride": 64}],
        "policy": policy or {"ppl_budget": 5.0}, "measure": {"cache": False},
        "output": {"path": str(tmp_path / out), "size": size, "formats": ["compressed-tensors"], **output},
    })


def _tensor_bytes(folder) -> int:
    """Bytes of the tensors in a folder's safetensors files, read from their headers (the JSON index aside)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def test_a_w4a16_size_writes_a_planned_checkpoint_that_plain_transformers_loads(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    src = _source(tmp_path, tokenizer)
    res = compressor.run(_recipe(tmp_path, src, "out", "W4A16"))
    assert res.exit_code == 0, res.report.get("message")
    check, plan = res.report["verification"]["compressed-tensors"], res.report["size_plan"]
    # the bytes: known before writing, no more than the uniform W4A16 checkpoint's, equal to the files' tensors
    assert check["file_bytes"] == plan["planned_file_bytes"] == _tensor_bytes(res.output)
    assert check["file_bytes"] <= plan["budget_bytes"] == plan["preset"]["file_bytes"]
    assert check["disk_bytes"] > check["file_bytes"]
    # a scheme per unit: q/k/v and gate/up planned together
    units = {row["tensor"] for row in plan["tensors"]}
    assert any("q_proj+k_proj+v_proj" in u for u in units) and any("gate_proj+up_proj" in u for u in units)
    assert "lm_head" in units  # an untied head is planned like a layer (output.ct_head: plan, the default)
    assert set(plan["types_used"]) <= {*SCHEMES, "unquantized"}
    # measured after reloading, on both domains, with the KL and the uniform checkpoint beside it
    assert [d["name"] for d in check["domains"]] == ["eval", "code"]
    for d in check["domains"]:
        assert d["kl_mean"] > 0 and d["preset_kl_mean"] > 0 and d["preset_relative_change"] is not None
    assert check["preset"]["name"] == "W4A16"
    cfg = json.loads((res.output / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "pack-quantized" and "auto_map" not in cfg
    model = AutoModelForCausalLM.from_pretrained(res.output)
    assert type(model).__module__.startswith("transformers.")
    out = model.generate(torch.tensor([tokenizer(TEXT).input_ids[:8]]), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == 12
    assert "compressed-tensors" in (res.output / "README.md").read_text()
    from minimal_report import checked_report

    planned = checked_report(json.loads((res.output / "report.json").read_text())).planned()
    assert planned[0] == "compressed-tensors" and planned[1].preset.name == "W4A16"


def test_ct_head_keep_leaves_the_output_head_in_the_saved_dtype(tmp_path, tokenizer):
    """``output.ct_head: keep`` (a runtime that reads no quantized lm_head): the head is no unit of the plan, the
    folder ignores it, and the budget (the uniform checkpoint's bytes, its head in bf16) is the same."""
    src = _source(tmp_path, tokenizer)
    res = compressor.run(_recipe(tmp_path, src, "out", "W4A16", ct_head="keep"))
    assert res.exit_code == 0, res.report.get("message")
    plan = res.report["size_plan"]
    assert "lm_head" not in {row["tensor"] for row in plan["tensors"]}
    assert "lm_head" in json.loads((res.output / "config.json").read_text())["quantization_config"]["ignore"]
    planned = compressor.run(_recipe(tmp_path, src, "out2", "W4A16"))
    assert planned.report["size_plan"]["budget_bytes"] == plan["budget_bytes"]
    with pytest.raises(RecipeError, match="ct_head.*read only with output.size"):
        compressor.recipe_from_dict({"model": {"source": str(src)}, "output": {"ct_head": "keep"}})


def test_the_plan_and_the_uniform_anchor_are_rounded_in_one_pass_over_the_calibration(tmp_path, tokenizer,
                                                                                      monkeypatch):
    """Rounding measures each layer's Ĥ once for the file and its anchor together (Qwen2.5-1.5B: a pass of
    several minutes), and every (unit, scheme) of either is rounded once."""
    from compressor.pipeline.size import rounding
    from compressor.output.ctensors.target import CompressedTensorsTarget

    passes, rounded = [], []
    real_moments, real_round = rounding.whole_moments, CompressedTensorsTarget.round_full
    monkeypatch.setattr(rounding, "whole_moments", lambda *a, **k: passes.append(a[2]) or real_moments(*a, **k))
    monkeypatch.setattr(CompressedTensorsTarget, "round_full",
                        lambda self, name, option, *a, **k: rounded.append((name, option)) or real_round(
                            self, name, option, *a, **k))
    src = _source(tmp_path, tokenizer)
    res = compressor.run(_recipe(tmp_path, src, "out", "W4A16"))
    assert res.exit_code == 0, res.report.get("message")
    layers = [m for group in passes for m in group]
    assert len(layers) == len(set(layers)), "a layer's moments were measured twice"
    assert len(rounded) == len(set(rounded))
    planned = {(row["tensor"], row["type"]) for row in res.report["size_plan"]["tensors"]}
    anchor = {(u, "W4A16") for u, _ in planned if u != "lm_head"}  # its head stays bf16, as llm-compressor leaves it
    assert planned | anchor >= set(rounded) >= anchor  # the anchor's units were rounded in that pass too


def test_a_size_below_every_layer_at_its_smallest_scheme_is_refused_with_the_exact_floor(tmp_path, tokenizer):
    src = _source(tmp_path, tokenizer)
    with pytest.raises(compressor.InputError, match="cannot be met.*give a size of at least"):
        compressor.run(_recipe(tmp_path, src, "out", "1000"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("size, formats, match", [
    ("W4A16", ["gguf"], "is a compressed-tensors size"),
    ("Q4_K_M", ["compressed-tensors"], "is a gguf size"),
    ("W4A16", ["hf"], "add compressed-tensors to output.formats"),
])
def test_a_size_the_format_does_not_take_is_refused_naming_the_fix(tmp_path, size, formats, match):
    from compressor.output.registry import target_for

    with pytest.raises(compressor.InputError, match=match):
        target_for(formats, size)


def test_compressed_tensors_beside_a_hugging_face_folder_is_refused():
    from compressor.core.errors import InputError
    from compressor.output.registry import check_folders

    with pytest.raises(InputError, match="keep compressed-tensors alone"):
        check_folders(compressor.recipe_from_dict({"output": {"formats": ["hf", "compressed-tensors"]}}).output.writers())
    check_folders(["compressed-tensors", "gguf"])  # a single file beside the folder


def test_a_scheme_size_defaults_to_the_compressed_tensors_format():
    from compressor.inputs.load import ResolvedSource
    from compressor.pipeline.size import SizeWorkflow
    from compressor.pipeline.structural import StructuralWorkflow
    from compressor.pipeline.preflight import workflow_for

    src = ResolvedSource("/nowhere", None, True)
    r = compressor.recipe_from_dict({"output": {"size": "w4a16"}})
    assert workflow_for(r).default_formats("llama", src) == ["compressed-tensors"]
    sized = workflow_for(compressor.recipe_from_dict({"output": {"size": "Q4_K_M"}}))
    assert type(sized) is SizeWorkflow and not sized.changes_blocks and sized.default_formats("llama", src) == ["gguf"]
    plain = workflow_for(compressor.recipe_from_dict({}))
    assert type(plain) is StructuralWorkflow and plain.changes_blocks and plain.default_formats("llama", src) == ["hf"]
    assert not issubclass(SizeWorkflow, StructuralWorkflow) and not issubclass(StructuralWorkflow, SizeWorkflow)


def test_without_the_library_the_size_is_refused_naming_the_extra(monkeypatch):
    from compressor.output.registry import target_for

    monkeypatch.setattr("compressor.output.ctensors.writer.library_missing",
                        lambda: "not importable: pip install 'compressor[compressed-tensors]'")
    why = target_for(["compressed-tensors"], "W4A16").refusal("llama", None)
    assert "compressor[compressed-tensors]" in why


def test_a_scheme_size_takes_the_same_bits_with_a_group_that_divides_the_rows():
    """SmolLM2's 576 inputs take no group of 128 (llm-compressor's W4A16 refuses the model): the W4A16 size
    and its anchor give such a unit int4 with groups of 64, and int8 one scale per row."""
    from compressor.output.ctensors.target import FLOAT, in_family

    assert in_family("W4A16", [(576, 1536)]) == "W4A16"
    assert in_family("W4A16", [(576, 576), (192, 576)]) == "W4A16_G64"
    assert in_family("W4A16", [(64, 96)]) == "W4A16_G32"
    assert in_family("W8A16", [(1536, 576)]) == "W8A16_CH"
    assert in_family("W4A16", [(8, 20)]) == FLOAT


def test_an_architecture_whose_layers_the_writer_cannot_map_is_refused_before_loading():
    from compressor.output.registry import target_for

    why = target_for(["compressed-tensors"], "W4A16").refusal("gpt2", None)
    assert "Conv1D" in why and "output.formats: [hf]" in why
    assert target_for(["compressed-tensors"], "W4A16").refusal("qwen2", None) is None


def test_the_run_time_estimate_counts_gptq_pricing_and_rounding(tmp_path):
    """Qwen2.5-1.5B's compressed-tensors size was estimated at 32 min and took 57: GPTQ was not counted."""
    from compressor.pipeline.preflight import workflow_for

    model = tiny("llama", hidden_size=128, intermediate_size=256, head_dim=32)
    kwargs = dict(model=model, fwd=1e-4, hidden=False, recorded={})

    def estimate(*args, **options):
        return workflow_for(_recipe(tmp_path, tmp_path / "m.gguf", "out", *args, **options)).estimate(**kwargs)

    gptq, nearest = estimate("W4A16"), estimate("W4A16", rounding="nearest")
    gguf = estimate("Q4_K_M", formats=["gguf"])
    assert gptq["rounding"] > 0 and "rounding" not in nearest
    assert gptq["pricing"] > nearest["pricing"]
    assert gptq["rounding"] > gguf["rounding"]  # the uniform anchor is rounded too; llama.cpp makes the GGUF's
    assert gguf["rounding"] == 0  # every tensor priced on all its rows: the GGUF stores pricing's roundings
