"""The gguf writer: every kind as an exact gated MLP, GGUF files that an unmodified llama.cpp
(llama-cpp-python) runs with the logits transformers computes, and clear refusals.

Tiny models are built from configs and a byte-level BPE tokenizer is trained here, so nothing is
downloaded. The llama.cpp tests skip where llama-cpp-python is not installed (``tools/setup.sh``
installs it).
"""

from __future__ import annotations

import json
import math
import shutil
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from tiny import byte_level_tokenizer

from compressor.core.modeling import COMPRESSION_FORMAT, AffineFFN, HiddenUnitFFN, LowRankAffineFFN
from compressor.inputs.load import ResolvedSource
from compressor.output.base import VerificationError, WriteRequest
from compressor.output.gated import NotRepresentableError, as_gated

gguf = pytest.importorskip("gguf")
from compressor.output import gguf as gw  # noqa: E402
from compressor.output.gguf import metadata as gmetadata  # noqa: E402
from compressor.output.gguf import naming as gnaming  # noqa: E402
from compressor.output.gguf import plan as gplan  # noqa: E402
from compressor.output.gguf import read as gread  # noqa: E402


def _worse(scores, nats: float):
    """``scores`` (:class:`~compressor.evaluation.external.WindowScores`) with every token's NLL ``nats`` higher."""
    import dataclasses

    return dataclasses.replace(scores, nll=[s + nats * n for s, n in zip(scores.nll, scores.tokens)])


HIDDEN, FF, LAYERS, VOCAB, SEQ = 64, 128, 3, 320, 64
TEXT = ("The quick brown fox jumps over the lazy dog. Numbers 123 4567 and words, words; more words! "
        "A second sentence with other letters: xylophone, quartz, jazz. ") * 12

pytestmark = [pytest.mark.usefixtures("torch_single_thread"),
              pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")]


def needs_llama_cpp():
    return pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer (llama.cpp's ``gpt2`` model) trained on :data:`TEXT`."""
    return byte_level_tokenizer(TEXT)


@pytest.fixture(scope="module")
def ids(tokenizer) -> torch.Tensor:
    return torch.tensor(tokenizer(TEXT).input_ids[: 6 * SEQ])


def tiny(model_type: str, seed: int = 0, **extra) -> torch.nn.Module:
    """A tiny random model whose logits are far from uniform (so a wrong tensor shows)."""
    common = dict(hidden_size=HIDDEN, intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256) | extra
    cfg, cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[model_type]
    torch.manual_seed(seed)
    model = cls(cfg(**common)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms and biases: not all ones / zeros, so their layout matters
                p.add_(torch.randn_like(p) * 0.2)
            elif "embed" in name or "lm_head" in name:
                p.normal_(std=0.5)
            else:
                p.normal_(std=0.08)
    return model


def _randomize(module: torch.nn.Module, std: float = 0.08) -> torch.nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=std)
    return module


REPLACEMENTS = {
    "affine": lambda: AffineFFN(HIDDEN, HIDDEN),
    "low_rank": lambda: LowRankAffineFFN(HIDDEN, HIDDEN, 8),
    "prune": lambda: HiddenUnitFFN(HIDDEN, HIDDEN, 40, "silu", True, True, False),
    "hybrid": lambda: HiddenUnitFFN(HIDDEN, HIDDEN, 24, "silu", True, False, True),
    "bypass_only": lambda: HiddenUnitFFN(HIDDEN, HIDDEN, 0, "silu", True, False, True),
    "constant": lambda: HiddenUnitFFN(HIDDEN, HIDDEN, 0, "silu", True, False, False),
}
WIDTHS = {"affine": HIDDEN, "low_rank": 8, "prune": 40, "hybrid": 24 + HIDDEN, "bypass_only": HIDDEN, "constant": 1}


# --------------------------------------------------------------------------------------------------
# Gated form: exact for every kind
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["original", *REPLACEMENTS])
def test_every_kind_is_an_exact_gated_mlp(model_type, kind):
    model = tiny(model_type, mlp_bias=True) if model_type == "llama" else tiny(model_type)
    module = model.model.layers[1].mlp if kind == "original" else _randomize(REPLACEMENTS[kind]())
    x = torch.randn(4, 7, HIDDEN)
    g = as_gated(module, in_features=HIDDEN)
    with torch.no_grad():
        want = module(x)
        assert g.width == (FF if kind == "original" else WIDTHS[kind])
        torch.testing.assert_close(g(x), want, atol=1e-5, rtol=1e-5)
        padded = g.padded(32)
        assert padded.width % 32 == 0 and padded.width >= g.width
        torch.testing.assert_close(padded(x), want, atol=1e-5, rtol=1e-5)


def test_plain_mlps_are_refused():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64))
    with pytest.raises(NotRepresentableError, match="SiLU-gated"):
        as_gated(gpt2.transformer.h[0].mlp)
    with pytest.raises(NotRepresentableError, match="not SiLU-gated"):
        as_gated(HiddenUnitFFN(HIDDEN, HIDDEN, 8, "gelu", False, True, False))


# --------------------------------------------------------------------------------------------------
# Round trips through llama.cpp
# --------------------------------------------------------------------------------------------------


def _request(model, tokenizer, ids, *, quant="source", dtype=torch.float32, source=None, expected=None, **options):
    from compressor.evaluation.perplexity import perplexity

    if expected is None:
        expected = perplexity(model, ids, seq_len=SEQ, stride=SEQ, shard=False).ppl
    return WriteRequest(model=model, tokenizer=tokenizer, compression={}, dtype=dtype,
                        source=source or ResolvedSource("/nonexistent/tiny-model", None, True),
                        probe_tokens=ids, probe_seq_len=SEQ, probe_stride=SEQ, expected_ppl=expected,
                        options={"quant": quant, **options})


def _llama_cpp_logits(path: Path, window: list[int]) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(window), logits_all=True, n_threads=1, verbose=False)
    try:
        llm.eval(window)
        return np.array(llm.scores[: len(window)])
    finally:
        llm.close()


def _replace(model, kinds: dict[int, str]):
    for i, kind in kinds.items():
        model.model.layers[i].mlp = _randomize(REPLACEMENTS[kind]())
    return model


# (model type, replaced blocks, architecture llama.cpp runs)
ROUND_TRIPS = [
    ("llama", {0: "hybrid", 1: "low_rank"}, "deci"),        # unequal widths → per-layer architecture
    ("llama", {0: "prune", 1: "prune", 2: "prune"}, "llama"),  # one width (40), biases: native llama
    ("mistral", {1: "affine"}, "deci"),
    ("qwen2", {0: "prune", 2: "constant"}, "deci"),          # qwen2 has no FFN bias: deci, q/k rows permuted
    ("qwen2", {}, "qwen2"),                                  # unchanged: the native architecture
]


@pytest.mark.parametrize("model_type,kinds,arch", ROUND_TRIPS, ids=lambda v: str(v))
def test_llama_cpp_runs_the_file_with_transformers_logits(tmp_path, tokenizer, ids, model_type, kinds, arch):
    needs_llama_cpp()
    model = _replace(tiny(model_type), kinds)
    request = _request(model, tokenizer, ids)
    writer = gw.GGUFWriter()
    written = writer.write(request, tmp_path)
    (path,) = written.files
    check = writer.verify(request, written)
    assert check["architecture"] == arch and check["passed"]
    assert check["relative_ppl_diff"] < 1e-4, check
    window = ids[:SEQ].tolist()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([window])).logits[0].numpy()
    got = _llama_cpp_logits(path, window)
    # llama.cpp keeps K and V in float16: agreement to that precision
    assert np.abs(got - want).max() < 2e-2 * max(1.0, np.abs(want).max()), np.abs(got - want).max()
    assert np.abs(want).std() > 0.5  # the logits are informative, so the comparison is too


def test_bf16_is_verified_within_tolerance(tmp_path, tokenizer, ids):
    needs_llama_cpp()
    model = _replace(tiny("llama"), {1: "hybrid"})
    request = _request(model, tokenizer, ids, dtype=torch.bfloat16)
    writer = gw.GGUFWriter()
    written = writer.write(request, tmp_path)
    check = writer.verify(request, written)
    assert check["file_type"] == "MOSTLY_BF16" and check["quant"] == "bf16"
    assert check["relative_ppl_diff"] <= gw.PPL_TOLERANCE


def test_a_mismatch_fails_verification(tmp_path, tokenizer, ids):
    needs_llama_cpp()
    model = _replace(tiny("llama"), {1: "low_rank"})
    request = _request(model, tokenizer, ids)
    written = gw.GGUFWriter().write(request, tmp_path)
    request.expected_ppl *= 1.02  # the in-memory model "disagrees" by 2 %
    with pytest.raises(VerificationError, match="nothing was published"):
        gw.GGUFWriter().verify(request, written)


def test_a_gguf_source_keeps_its_tensors_and_tokenizer(tmp_path, tokenizer, ids):
    """quant: source copies unchanged tensors byte for byte and quantizes the new FFNs to the source's type."""
    needs_llama_cpp()
    from compressor.inputs.load import load_model

    src_dir = tmp_path / "src"
    src_dir.mkdir()
    gw.GGUFWriter().write(_request(tiny("llama"), tokenizer, ids, quant="q8_0", expected=1.0, file="tiny.gguf"),
                          src_dir)
    model, tok, source = load_model(str(src_dir / "tiny.gguf"))
    model.model.layers[1].mlp = _randomize(REPLACEMENTS["prune"]())  # width 40: not a multiple of Q8_0's 32
    request = _request(model, tok, ids, source=source, unquantizable="pad")
    out = tmp_path / "out"
    out.mkdir()
    writer = gw.GGUFWriter()
    written = writer.write(request, out)
    check = writer.verify(request, written)
    assert check["file_type"] == "MOSTLY_Q8_0" and check["ffn_widths"][1] == 64
    # no gate budget given: nothing to hold a quantized file against, and the check says so instead of "passed"
    assert check["compared_with"] is None and "passed" not in check and "not compared" in check["checked"]
    assert check["relative_ppl_diff"] < 0.01  # only the new FFN was quantized
    before = {t.name: t for t in gguf.GGUFReader(src_dir / "tiny.gguf").tensors}
    after = {t.name: t for t in gguf.GGUFReader(out / "model.gguf").tensors}
    changed = {n for n in before if not (n in after and bytes(before[n].data) == bytes(after[n].data))}
    assert changed == {"blk.1.ffn_gate.weight", "blk.1.ffn_up.weight", "blk.1.ffn_down.weight"}
    assert {after[n].tensor_type.name for n in changed} == {"Q8_0"}
    src_meta, out_meta = gguf.GGUFReader(src_dir / "tiny.gguf").fields, gguf.GGUFReader(out / "model.gguf").fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre"):
        assert src_meta[key].contents() == out_meta[key].contents()
    # Like with like: at the source's quantization the output is compared with the source file itself,
    # in llama.cpp on the same windows, by the gate's rule: the upper confidence bound of the change
    # (paired by window) within the budget.
    src_ppl, _ = gread.llama_cpp_perplexity(src_dir / "tiny.gguf", ids, SEQ, SEQ)
    from compressor.recipe.schema import PolicyConfig

    # the policy as the recipe gives it (a fraction, headroom off here) is the rule the check applies
    request.gate = PolicyConfig(ppl_budget=9.0, headroom=0.0)
    check = writer.verify(request, written)
    assert check["source_perplexity"] == pytest.approx(src_ppl) and check["passed"]
    assert check["source_relative_change"] == pytest.approx(check["perplexity"] / src_ppl - 1)
    (row,) = check["domains"]
    assert row["paired"] and row["relative_delta_upper"] > row["relative_delta"]

    def rule(budget: float) -> PolicyConfig:  # the tiny file's change may be below zero: no recipe's budget
        return PolicyConfig().model_copy(update={"ppl_budget": budget, "headroom": 0.0})

    request.gate = rule(row["relative_delta_upper"] + 1e-3)
    assert writer.verify(request, written)["passed"]
    request.gate = rule(row["relative_delta_upper"] - 1e-3)  # the point passes, the bound does not
    assert row["relative_delta"] < request.gate.ppl_budget
    with pytest.raises(gw.GGUFGateMissed, match=r"against the source GGUF at the same quantization.*90% bound"):
        writer.verify(request, written)


def test_quantized_types_and_unquantizable_widths(tmp_path, tokenizer, ids):
    needs_llama_cpp()
    model = _replace(tiny("llama"), {0: "prune", 1: "low_rank"})  # widths 40, 8, 128
    with pytest.raises(gw.GGUFWidthError, match=r"layer 0 width 40 \(needs a multiple of 32\), layer 1 width 8"):
        gplan.plan_for(_request(model, tokenizer, ids, expected=1.0), {"quant": "q8_0"})
    request = _request(model, tokenizer, ids, quant="q8_0", unquantizable="f16")
    writer = gw.GGUFWriter()
    written = writer.write(request, tmp_path)
    check = writer.verify(request, written)
    assert check["ffn_down_types"] == ["F16", "F16", "Q8_0"] and check["relative_ppl_tolerance"] is None
    request = _request(model, tokenizer, ids, quant="q4_k_m", unquantizable="pad", expected=request.expected_ppl)
    written = writer.write(request, tmp_path)
    check = writer.verify(request, written)
    assert check["file_type"] == "MOSTLY_Q4_K_M" and check["ffn_widths"] == [256, 256, 128], check
    assert np.isfinite(check["perplexity"])


# --------------------------------------------------------------------------------------------------
# Refusals, before anything loads
# --------------------------------------------------------------------------------------------------


def test_unsupported_architectures_say_why_and_what_instead():
    writer = gw.GGUFWriter()
    for model_type in ("gpt2", "qwen3", "gemma3_text", "bert"):
        message = writer.unsupported(model_type, "prune")
        assert message and model_type in message and "output.formats: [hf]" in message
    if gw.runtime_missing() is None:
        assert writer.unsupported("llama", "hybrid") is None and writer.unsupported("qwen2", "affine") is None
    assert "q5_k" in writer.check_options({"quant": "q5_k"})


def test_a_non_bpe_tokenizer_is_refused(tokenizer):
    from tokenizers import Tokenizer, models, pre_tokenizers

    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    message = gmetadata.tokenizer_problem(transformers.PreTrainedTokenizerFast(tokenizer_object=wp))
    assert "not BPE" in message and "GGUF of the model" in message
    assert gmetadata.tokenizer_problem(tokenizer) is None


def test_rope_permutation_interleaves_the_halves_of_each_head():
    assert gnaming.rope_permutation(8, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


# --------------------------------------------------------------------------------------------------
# compressor export
# --------------------------------------------------------------------------------------------------


def _hf_folder(folder: Path, tokenizer, ids) -> Path:
    from compressor.output.hf import HFWriter

    model = tiny("llama")
    model.model.layers[1].mlp = _randomize(HiddenUnitFFN(HIDDEN, HIDDEN, 32, "silu", True, False, True))
    entry = {"module": "model.layers.1.mlp", "kind": "hybrid", "format": "compressor.kind.hybrid/v1",
             "config": {"in_features": HIDDEN, "out_features": HIDDEN, "units": 32, "act": "silu", "gated": True,
                        "up_bias": False}}
    request = _request(model, tokenizer, ids, expected=1.0)
    request.compression = {"format": COMPRESSION_FORMAT, "blocks": [entry], "source_model": "/nonexistent/tiny"}
    folder.mkdir()
    HFWriter().write(request, folder)
    return folder


def test_export_writes_a_verified_gguf(tmp_path, tokenizer, ids, capsys):
    needs_llama_cpp()
    from compressor.cli import main

    folder = _hf_folder(tmp_path / "out", tokenizer, ids)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert main(["export", str(folder), "--quant", "f16", "--text", str(text), "-q"]) == 0
    printed = capsys.readouterr().out
    assert (folder / "model.gguf").is_file() and "deci" in printed and "within tolerance" in printed
    assert not list(tmp_path.glob(".*tmp*"))  # the staging folder is gone


def test_export_of_a_folder_from_a_hugging_face_original_does_not_call_it_missing(tmp_path, tokenizer, ids, capsys,
                                                                                  caplog):
    """A folder compressed from a Hugging Face checkpoint has no original GGUF to take types from: ``export``
    says so, rather than that the original "is not on this machine" (issue 58, item 5)."""
    import logging

    needs_llama_cpp()
    from compressor.cli import main

    folder = _hf_folder(tmp_path / "out", tokenizer, ids)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    with caplog.at_level(logging.INFO):
        assert main(["export", str(folder), "--text", str(text)]) == 0
    said = caplog.text + capsys.readouterr().err
    assert "is a Hugging Face checkpoint, not a GGUF" in said and "not on this machine" not in said


def test_export_refuses_before_loading(tmp_path, tokenizer, ids, monkeypatch, capsys):
    from compressor.cli import main

    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("compressor.output.hf.load_compressed", boom)
    assert main(["export", str(tmp_path / "missing")]) == 2
    assert "not a compressor output folder" in capsys.readouterr().err
    folder = tmp_path / "gpt2-out"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "compressed_gpt2", "compression": {"blocks": []}}))
    assert main(["export", str(folder)]) == 2
    assert "gpt2" in capsys.readouterr().err
    if gw.runtime_missing() is None:
        folder = _hf_folder(tmp_path / "llama-out", tokenizer, ids)
        assert main(["export", str(folder), "--quant", "q8_0", "--output", str(tmp_path / "x.bin")]) == 2
        assert "must name a .gguf file" in capsys.readouterr().err
        assert main(["export", str(folder), "--quant", "q4_k_m"]) == 2  # hybrid: 32 units + 64 bypass = 96
        assert "layer 1 width 96 (needs a multiple of 256)" in capsys.readouterr().err


def test_formats_default_to_hf_and_gguf_for_a_gguf_source(tmp_path, tokenizer, ids, monkeypatch):
    """Not set in the recipe: [hf, gguf] for a GGUF source the writer takes, [hf] otherwise; a missing
    llama.cpp is then an exit-2 message that names the default and the opt-out, before loading."""
    from compressor.pipeline import preflight, stages
    from compressor.recipe import recipe_from_dict

    src = tmp_path / "src"
    src.mkdir()
    gw.GGUFWriter().write(_request(tiny("llama"), tokenizer, ids, quant="f16", expected=1.0, file="tiny.gguf"), src)

    def recipe(source: str, **output):
        return recipe_from_dict({"model": {"source": source}, "output": {"path": str(tmp_path / "out"), **output}})

    r = recipe(str(src / "tiny.gguf"))
    assert stages.default_formats(r) == ["hf", "gguf"] and r.output.formats == ["hf", "gguf"]
    assert "gguf" in r.to_yaml()  # the saved recipe names what was written
    assert stages.default_formats(recipe(str(src / "tiny.gguf"), formats=["hf"])) == ["hf"]  # named: kept
    hf = tmp_path / "hf"
    tiny("llama").save_pretrained(hf)
    assert stages.default_formats(recipe(str(hf))) == ["hf"]
    r = recipe(str(src / "tiny.gguf"))
    stages.default_formats(r)
    monkeypatch.setattr("compressor.output.gguf.writer.runtime_missing", lambda: "llama-cpp-python is not importable")
    with pytest.raises(stages.InputError, match=r"gguf is in output.formats by default.*output.formats: \[hf\]"):
        preflight.check_writers(r, tokenizer, "llama", stages.resolve_source(r.model.source, r.model.gguf_file))
    sized = recipe(str(src / "tiny.gguf"), size="Q4_K_M")
    assert stages.default_formats(sized) == ["gguf"]  # a size is the GGUF's: nothing else is written


def test_a_run_from_a_gguf_source_writes_a_smaller_gguf_checked_against_its_source(tmp_path, tokenizer, ids):
    """End to end, as the quickstart does it: a GGUF source, formats not named (so [hf, gguf]), widths
    in multiples of the source's block, the GGUF verified in llama.cpp against the source file itself,
    and report.json comparing like with like."""
    needs_llama_cpp()
    import compressor

    src = tmp_path / "src"
    src.mkdir()
    gw.GGUFWriter().write(_request(tiny("llama"), tokenizer, ids, quant="q8_0", expected=1.0, file="tiny.gguf"), src)
    words = TEXT.split()
    for name, seed in (("cal.txt", 0), ("eval.txt", 1)):  # two different texts from the same words
        rng = np.random.default_rng(seed)
        (tmp_path / name).write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(600)) + "\n")
    recipe = compressor.recipe_from_dict({
        "model": {"source": str(src / "tiny.gguf")},
        "calibration": {"dataset": str(tmp_path / "cal.txt"), "max_tokens": 2048, "seq_len": 32},
        "evaluation": {"dataset": str(tmp_path / "eval.txt"), "max_tokens": 1024, "seq_len": 64, "stride": 64},
        "policy": {"strategy": "allocate", "allocation": "fisher", "ppl_budget": 2.0, "ffn_keep": 0.75},
        "replacement": {"kind": "prune"},
        "measure": {"cache": False},
        "output": {"path": str(tmp_path / "out")},
    })
    res = compressor.run(recipe)
    assert res.exit_code == 0, res.report.get("message")
    assert recipe.output.formats == ["hf", "gguf"] and (res.output / "model.gguf").is_file()
    check = res.report["verification"]["gguf"]
    assert check["file_type"] == "MOSTLY_Q8_0" and check["passed"]
    assert all(w % 32 == 0 for w in check["ffn_widths"]) and min(check["ffn_widths"]) < FF
    # held against the source file in llama.cpp by the gate's rule, on every gate domain
    assert check["source_perplexity"] > 0 and check["domains"] and all(d["passed"] for d in check["domains"])
    assert all(d["relative_delta_upper"] <= d["limit"] / d["source_perplexity"] - 1 + 1e-12 for d in check["domains"])
    # the fits were snapped onto the file's grid: the file holds exactly the weights the gate measured
    reader = {t.name: t for t in gguf.GGUFReader(res.output / "model.gguf").tensors}
    assert res.result.fitted and all(f.stored["out.weight"][0] == "Q8_0" for f in res.result.fitted.values())
    assert res.report["snapped"] == {str(i): "Q8_0" for i in sorted(res.result.fitted)}
    for i, f in res.result.fitted.items():
        raw = reader[f"blk.{i}.ffn_down.weight"]
        assert bytes(raw.data) == f.stored["out.weight"][1].numpy().tobytes()
        down = res.result.model.model.layers[i].mlp.out.weight.detach().float().numpy()
        assert np.array_equal(gguf.quants.dequantize(raw.data, raw.tensor_type).reshape(down.shape), down)
    same = res.report["size"]["like_with_like"]
    assert same["source_bytes"] == (src / "tiny.gguf").stat().st_size and same["ratio"] < 1
    assert "GGUF at the source's quantization" in same["what"]
    assert "formats:\n  - hf\n  - gguf" in (res.output / "recipe.yaml").read_text()


def test_a_source_gguf_tensor_table_is_read_once_per_file_version(tmp_path, tokenizer, ids, monkeypatch):
    """The checks before loading, the width check and the plan share one read of the source's table."""
    path = tmp_path / "tiny.gguf"
    gw.GGUFWriter().write(_request(tiny("llama"), tokenizer, ids, quant="q8_0", expected=1.0, file=path.name),
                          tmp_path)
    reads = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda p, *a, **k: reads.append(p) or real(p, *a, **k))
    gread._source_types.cache_clear()
    first = gread.source_tensor_types(path)
    assert gread.source_tensor_types(path) == first and gread.source_down_block(path) == 32 and len(reads) == 1
    first["blk.0.ffn_down.weight"] = None  # callers get a copy: the cached table cannot be changed
    assert gread.source_tensor_types(path)["blk.0.ffn_down.weight"] is not None
    path.touch()
    import os

    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # a new version of the file
    gread.source_tensor_types(path)
    assert len(reads) == 2


def _size_source(tmp_path: Path, tokenizer, ids, quant: str) -> Path:
    """A tiny llama GGUF at ``quant`` (``src/tiny.gguf``), and calibration and evaluation texts beside it."""
    src = tmp_path / "src"
    src.mkdir()
    gw.GGUFWriter().write(_request(tiny("llama"), tokenizer, ids, quant=quant, expected=1.0, file="tiny.gguf"), src)
    words = TEXT.split()
    for name, seed in (("cal.txt", 0), ("eval.txt", 1)):
        rng = np.random.default_rng(seed)
        (tmp_path / name).write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(600)) + "\n")
    return src / "tiny.gguf"


def _size_recipe(tmp_path: Path, source: Path, out: str, size: str, policy: dict, **output):
    """A size recipe on :func:`_size_source`'s files, its output at ``tmp_path / out``."""
    import compressor

    return compressor.recipe_from_dict({
        "model": {"source": str(source)},
        "calibration": {"dataset": str(tmp_path / "cal.txt"), "max_tokens": 2048, "seq_len": 32},
        "evaluation": {"dataset": str(tmp_path / "eval.txt"), "max_tokens": 1024, "seq_len": 64, "stride": 64},
        "policy": policy, "measure": {"cache": False},
        "output": {"path": str(tmp_path / out), "size": size, **output},
    })


def test_a_size_plan_re_quantizes_the_source_within_its_budget_beside_the_preset(tmp_path, tokenizer, ids,
                                                                                  monkeypatch):
    """``output.size`` end to end on a tiny GGUF source: the file is no larger than llama.cpp's preset of
    that name (made from the same F16), every planned tensor is written in its planned type, llama.cpp
    runs it, and the preset's perplexity on the same windows is reported beside it. A budget that cannot
    be met fails the gate (exit 3) with nothing written."""
    needs_llama_cpp()
    import compressor

    src = _size_source(tmp_path, tokenizer, ids, "q8_0")

    def recipe(out: str, budget: float):
        return _size_recipe(tmp_path, src, out, "Q4_0", {"ppl_budget": budget})

    r = recipe("out", 5.0)
    res = compressor.run(r)
    assert res.exit_code == 0, res.report.get("message")
    assert r.output.formats == ["gguf"]
    assert sorted(p.name for p in res.output.iterdir()) == ["README.md", "model.gguf", "model.imatrix", "recipe.yaml",
                                                            "report.json"]
    card = (res.output / "README.md").read_text()  # the card says what the file is: its types, bytes, the preset
    assert "Tensor types:" in card and "llama.cpp's Q4_0" in card and f"{res.report['verification']['gguf']['file_bytes']:,} bytes" in card
    from compressor.reports.card import model_card

    both = json.loads(json.dumps(res.report))  # written as [hf, gguf]: the card still describes the planned GGUF
    both["recipe"]["output"]["formats"] = ["hf", "gguf"]
    card_both = model_card(both)
    assert "Tensor types:" in card_both and "holds the original weights, unchanged" in card_both
    assert "0 of 0 FFN blocks" not in card_both and "library_name: gguf" in card_both
    from minimal_report import checked_report

    assert checked_report(json.loads((res.output / "report.json").read_text())).planned()[0] == "gguf"
    check, plan = res.report["verification"]["gguf"], res.report["size_plan"]
    assert check["quant"] == "plan" and check["file_bytes"] <= check["budget_bytes"] == plan["budget_bytes"]
    assert check["file_bytes"] == check["planned_file_bytes"] == plan["planned_file_bytes"]  # known before writing
    assert check["preset"]["name"] == "Q4_0" and check["preset"]["file_bytes"] == check["budget_bytes"]
    assert check["perplexity"] > 0 and check["preset"]["perplexity"] > 0 and check["gate_passed"]
    assert [d["name"] for d in check["domains"]] == ["eval"] and check["domains"][0]["preset_relative_change"] > -1
    assert check["domains"][0]["paired"] and check["domains"][0]["relative_delta_upper"] >= check["relative_change"]
    written = {t.name: t.tensor_type.name for t in gguf.GGUFReader(res.output / "model.gguf").tensors}
    assert all(written[row["tensor"]] == row["type"] for row in plan["tensors"])
    assert not list(tmp_path.glob(".*.size-*"))  # the F16 and the preset are cleaned up
    small = recipe("out2", 5.0)
    small.output.size = "2bpw"  # below what rows of 64 take (the 32-element types: 4.5 bits at least)
    with pytest.raises(compressor.InputError, match="cannot be met.*give a size of at least") as refused:
        compressor.run(small)
    floor = int(re.search(r"at least ([\d,]+) bytes", str(refused.value)).group(1).replace(",", ""))
    exact = recipe("out_floor", 5.0)
    exact.output.size = str(floor)  # the size the refusal named is met, to the byte
    met = compressor.run(exact)
    assert met.exit_code == 0 and met.report["verification"]["gguf"]["file_bytes"] == floor
    shutil.rmtree(tmp_path / "out_floor")
    real = gread.read_scores

    def tripled(path, *args):  # the planned file made 3× worse in perplexity, the preset left alone
        return _worse(real(path, *args), math.log(3) if path.name == "model.gguf" else 0.0)

    monkeypatch.setattr("compressor.output.gguf.read.read_scores", tripled)
    failed = compressor.run(recipe("out3", 0.5))
    assert failed.exit_code == 3 and "larger output.size" in failed.report["message"]
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()
    from compressor.engine.runstate import state_dir

    # refused by the size gate (exit 3) or by a size that cannot be met (exit 2): no run state left behind
    assert not state_dir(tmp_path / "out2").exists() and not state_dir(tmp_path / "out3").exists()
    assert not list(tmp_path.glob(".*tmp*")) and not list(tmp_path.glob(".*.size-*"))


def test_the_pricing_passs_moments_round_the_plan_without_a_second_pass(tmp_path, tokenizer, ids, monkeypatch,
                                                                        isolated_cache):
    """The input moments measured for pricing round the chosen plan: kept in memory when one pass holds every
    layer's, written to the work folder (or pricing's GPTQ factors of them) and mapped back when memory splits the
    layers into groups. Neither
    reads the calibration windows a second time, and both write the same file, byte for byte, as a run
    whose prices come from the cache, or whose disk has no room for them, and whose rounding measures the
    moments again."""
    needs_llama_cpp()
    import hashlib

    import compressor
    from compressor.pipeline.size import prices, rounding

    src = _size_source(tmp_path, tokenizer, ids, "q8_0")
    passes, spilled = [], []
    real, real_spill, real_factor = rounding.whole_moments, prices._spilled, prices.spill_factor
    monkeypatch.setattr(rounding, "whole_moments", lambda *a, **k: passes.append(a[2]) or real(*a, **k))
    monkeypatch.setattr(prices, "_spilled", lambda m, path: spilled.append(path) or real_spill(m, path))
    # a GGUF's pricing factors the same Ĥ its rounding does: the factor goes to the work folder in the moment's place
    monkeypatch.setattr(prices, "spill_factor", lambda f, path: spilled.append(path) or real_factor(f, path))

    def run(out: str, cache: bool = False):
        r = _size_recipe(tmp_path, src, out, "Q4_0", {"ppl_budget": 50.0})
        r.measure.cache = cache
        res = compressor.run(r)
        assert res.exit_code == 0 and res.report["size_plan"]["compensated_tensors"] > 0
        return hashlib.sha256((res.output / "model.gguf").read_bytes()).hexdigest()

    kept = run("kept", cache=True)
    assert passes == [] and spilled == []
    with monkeypatch.context() as m:
        m.setattr(prices, "moments_budget", lambda: 1)  # every layer its own group
        split = run("split")
    assert passes == [] and len(spilled) > 1 and not spilled[0].exists()  # removed with the work folder
    again = run("again", cache=True)  # prices from the cache: the rounding measures the moments
    assert len(passes) >= 1
    measured = len(passes)

    def full_disk(moments, path):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(prices, "moments_budget", lambda: 1)
        m.setattr(prices, "_spilled", full_disk)
        m.setattr(prices, "spill_factor", full_disk)
        m.setattr(prices, "ROUNDED_BYTES", 0)  # and pricing keeps no rounding of its own
        no_room = run("no_room")  # nothing kept: measured again, the same file
    assert len(passes) > measured
    assert kept == split == again == no_room


def test_the_smallest_size_within_the_budget_steps_back_when_the_gate_fails(tmp_path, tokenizer, ids, monkeypatch):
    """``output.size: smallest``: the planned file is smaller than the F16 and its predicted change is within
    the share of the budget it planned for; when llama.cpp measures the first file over the gate, the plan
    steps back to more bytes and the second file passes; with no back-off left, exit 3, every attempt
    recorded and nothing written."""
    needs_llama_cpp()
    import compressor

    src = _size_source(tmp_path, tokenizer, ids, "f16")

    def recipe(out: str, **policy):
        return _size_recipe(tmp_path, src, out, "smallest", {"ppl_budget": 0.05, **policy})

    real, calls = gread.read_scores, []

    def worse_first(path, *args):  # the first planned file measured 2× worse; the later ones as they are
        calls.append(path.name)
        return _worse(real(path, *args),
                      math.log(2) if calls.count("model.gguf") == 1 and path.name == "model.gguf" else 0.0)

    monkeypatch.setattr("compressor.output.gguf.read.read_scores", worse_first)
    res = compressor.run(recipe("out"))
    assert res.exit_code == 0, res.report.get("message")
    plan, check = res.report["size_plan"], res.report["verification"]["gguf"]
    attempts = plan["search"]["attempts"]
    first, passed = attempts[0], [a for a in attempts if a["passed"]]
    assert not first["passed"] and passed and all(a["tensor_bytes"] > first["tensor_bytes"] for a in passed)
    assert len({a["file_bytes"] for a in attempts}) == len(attempts)  # every byte count measured once
    assert check["file_bytes"] == min(a["file_bytes"] for a in passed) and check["gate_passed"]
    assert check["file_bytes"] < src.stat().st_size

    calls.clear()
    monkeypatch.setattr("compressor.output.gguf.read.read_scores", lambda path, *a: _worse(
        real(path, *a), math.log(2) if path.name == "model.gguf" else 0.0))
    failed = compressor.run(recipe("out2", max_backoff=1))
    assert failed.exit_code == 3 and "policy.max_backoff" in failed.report["message"]
    assert [a["passed"] for a in failed.report["size_plan"]["search"]["attempts"]] == [False, False]
    assert not (tmp_path / "out2").exists() and not list(tmp_path.glob(".*.size-*"))


def test_the_size_plan_summary_puts_the_file_beside_the_preset(capsys):
    """``output.size``'s summary: the file, its types, and per domain its change (with the bound) beside the
    preset's — not the unchanged in-memory model's gate lines."""
    from compressor.cli.run import _print_summary
    from minimal_report import minimal_report

    report = minimal_report(**{
              "status": "success", "message": "ok", "blocks": [], "strategy": "size",
              "perplexity": {"baseline": {"ppl": 10.0}, "final": {"ppl": 10.0, "tokens": 8, "seq_len": 4, "stride": 4},
                             "budget": 10.5},
              "size_plan": {"size": "Q3_K_M", "budget_bytes": 1000, "types_used": {"Q4_K": 3, "Q6_K": 1}},
              "verification": {"gguf": {
                  "quant": "plan", "planned_format": "gguf", "file_bytes": 900, "planned_file_bytes": 900,
                  "budget_bytes": 1000, "predicted_relative_change": 0.01,
                  "preset": {"name": "Q3_K_M", "file_bytes": 1000},
                  "domains": [{"name": "prose", "perplexity": 10.2, "relative_change": 0.02, "confidence": 0.9,
                               "relative_delta_upper": 0.03, "reference_perplexity": 10.0,
                               "preset_relative_change": 0.08}]}}})
    _print_summary(report, Path("out"))
    out = capsys.readouterr().out
    assert "tensor types: Q4_K ×3, Q6_K ×1" in out and "beside it: llama.cpp's Q3_K_M" in out
    assert "llama.cpp [prose]: perplexity 10.2000, +2.00 % (90% bound +3.00 %)" in out and "Q3_K_M: +8.00 %" in out
    assert "gate [" not in out and "out/model.gguf" in out
    report["size_plan"]["search"] = {"target_predicted_ppl_change": 0.03, "attempts": [
        {"file_bytes": 800_000, "passed": False}, {"file_bytes": 900_000, "passed": True}]}
    _print_summary(report, Path("out"))
    assert "planned for a predicted +3.00 %; files measured: 0.8 MB over, 0.9 MB passed" in capsys.readouterr().out


def test_the_layout_is_read_from_the_header_as_gguf_py_reads_the_file(tmp_path, tokenizer, ids):
    """:func:`~compressor.output.gguf.budget.header_layout` skips the metadata gguf-py decodes: the same data
    offset, tensor names, shapes and data bytes, in F16 and in quantized types (an alignment of its own
    included); a file that is not a GGUF is refused."""
    needs_llama_cpp()
    from compressor.output.gguf.budget import header_layout

    src = _size_source(tmp_path, tokenizer, ids, "q8_0")
    f16 = tmp_path / "f16.gguf"
    gw.GGUFWriter().write(_request(tiny("llama"), tokenizer, ids, quant="f16", expected=1.0, file="f16.gguf"), tmp_path)
    aligned = tmp_path / "aligned.gguf"  # general.alignment set: the data offset moves with it
    writer = gguf.GGUFWriter(str(aligned), "llama")
    writer.add_custom_alignment(64)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "", "déf"])
    writer.add_tensor("w", np.ones((3, 64), dtype=np.float32))
    writer.add_tensor("b", np.ones(5, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path in (src, f16, aligned):
        reader = gguf.GGUFReader(path)
        offset, alignment, tensors = header_layout(path)
        assert offset == reader.data_offset and alignment == reader.alignment
        assert tensors == [(t.name, tuple(int(d) for d in t.shape), int(t.n_bytes)) for t in reader.tensors]
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF"):
        header_layout(tmp_path / "not.gguf")


def test_a_size_above_the_f16_file_is_said(tmp_path, tokenizer, ids, caplog):
    """A size above the F16 file cannot be meant: refused (exit 2) with the F16's bytes (issue 71, minor 7:
    ``1e20`` was taken and printed as "100000000.0 TB"). The F16's own size quantizes nothing: said in the log,
    not silent; the budget's layout is the F16 file's, to the byte."""
    needs_llama_cpp()
    import logging

    from compressor.core.errors import InputError
    from compressor.output.gguf.budget import measure_budget
    from compressor.recipe.schema import Size

    request = _request(tiny("llama"), tokenizer, ids, quant="f16", expected=1.0)
    with pytest.raises(InputError, match="more than this model's F16 file") as refused:
        measure_budget(Size.of("1GB"), request, tmp_path)
    f16_bytes = (tmp_path / "f16.gguf").stat().st_size
    from compressor.core.errors import EXIT_INVALID, exit_code_for

    assert f"{f16_bytes:,} bytes" in str(refused.value) and exit_code_for(refused.value) == EXIT_INVALID
    with caplog.at_level(logging.WARNING):
        budget = measure_budget(Size.of(str(f16_bytes)), request, tmp_path)
    assert budget.limit == f16_bytes and "nothing is quantized" in caplog.text
    assert budget.layout.file_bytes == (tmp_path / "f16.gguf").stat().st_size
    assert budget.layout.file_bytes_of({}) == budget.layout.file_bytes  # every planned tensor F16: the F16 file


def test_a_size_plan_rounds_with_error_compensation_and_stores_it_in_the_files_row_order(tmp_path, tokenizer, ids,
                                                                                      monkeypatch):
    """Error-compensating rounding (GPTQ through Ĥ onto ggml's scales) is offered beside ggml's own and taken
    where it prices lower; its bytes are what the file stores, in llama.cpp's row order (attn_q/attn_k of a
    llama GGUF are permuted), and llama.cpp runs the file. The bytes pricing rounded over every row are the
    ones stored: the same file as rounding the plan again. ``output.rounding: nearest`` offers ggml's only."""
    needs_llama_cpp()
    import compressor
    from compressor.core.ggml import GGMLType
    from compressor.fitting.gridround import dequantize

    src = _size_source(tmp_path, tokenizer, ids, "f16")

    def recipe(out: str, **output):
        return _size_recipe(tmp_path, src, out, "Q4_0", {"ppl_budget": 5.0}, **output)

    res = compressor.run(recipe("out"))
    assert res.exit_code == 0, res.report.get("message")
    rows = {r["tensor"]: r for r in res.report["size_plan"]["tensors"]}
    gptq = {n for n, r in rows.items() if r["rounding"] == "gptq"}
    assert gptq and res.report["size_plan"]["compensated_tensors"] == len(gptq)
    assert all(r["offered"][r["type"]] == r["predicted_cost"] for r in rows.values())
    written = {t.name: t for t in gguf.GGUFReader(res.output / "model.gguf").tensors}
    model = res.result.model
    q = "blk.0.attn_q.weight"
    if q in gptq:  # the stored rows are in llama.cpp's order: the file's q rows are the model's, permuted
        t = written[q]
        values = dequantize(np.asarray(t.data).reshape(t.shape[1], -1), GGMLType[rows[q]["type"]],
                            (int(t.shape[1]), int(t.shape[0])))
        w = model.model.layers[0].self_attn.q_proj.weight.detach().float().numpy()
        perm = gnaming.rope_permutation(w.shape[0], model.config.num_attention_heads)
        assert np.abs(values - w[perm]).mean() < 0.5 * np.abs(values - w).mean()
    # every tensor of the tiny model is priced on all its rows: the plan's rounding is pricing's bytes
    assert "compensated_rounding_s" not in res.report["size_plan"]["timings"]
    monkeypatch.setattr("compressor.pipeline.size.prices.ROUNDED_BYTES", 0)
    again = compressor.run(recipe("again"))
    assert again.report["size_plan"]["timings"]["compensated_rounding_s"] > 0
    assert (again.output / "model.gguf").read_bytes() == (res.output / "model.gguf").read_bytes()
    near = compressor.run(recipe("near", rounding="nearest"))
    assert near.exit_code == 0 and near.report["size_plan"]["compensated_tensors"] == 0
    assert {r["rounding"] for r in near.report["size_plan"]["tensors"]} == {"nearest"}
    assert res.report["size_plan"]["predicted_nll_increase"] <= near.report["size_plan"]["predicted_nll_increase"]
