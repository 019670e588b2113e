"""Trustworthy evaluation data: disjoint from calibration by construction, large
enough to mean something, and several domains in one recipe."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import yaml

from checkpoints import save_tiny_checkpoint, tiny_tokenizer

from compressor.inputs.data import (
    CalibrationSet, OverlapError, TextSource, calibration_set, check_disjoint, evaluation_tokens, same_source,
)
from compressor.recipe import RecipeError, recipe_from_dict

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "river", "stone", "cloud", "light", "metal", "seed", "tower"]


def text_file(path: Path, lines: int = 1200, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(lines)) + "\n")
    return path


def test_same_file_is_recognised_whatever_the_split_names(tmp_path):
    f = text_file(tmp_path / "corpus.txt")
    cal, ev = TextSource(str(f), split="train"), TextSource(str(tmp_path / "." / "corpus.txt"), split="test")
    assert same_source(cal, ev)
    assert not same_source(cal, TextSource(str(text_file(tmp_path / "other.txt", seed=1))))
    assert same_source(TextSource("embedded"), TextSource("embedded", split="test"))


def test_same_txt_for_calibration_and_evaluation_gives_no_overlapping_windows(tmp_path, caplog):
    f = text_file(tmp_path / "corpus.txt")
    tok = tiny_tokenizer()
    cal_src, ev_src = TextSource(str(f), split="train"), TextSource(str(f), split="test")
    cal = calibration_set(tok, cal_src, seq_len=32, max_tokens=4096, evaluation=[ev_src])
    ev = evaluation_tokens(tok, ev_src, cal_src, max_tokens=4096)
    assert "odd-numbered" in caplog.text
    report = check_disjoint(cal, {"corpus": ev})
    assert report["corpus"]["leaked_windows"] == 0

    # Without the document split the same file overlaps, and the check says so.
    leaky = calibration_set(tok, cal_src, seq_len=32, max_tokens=4096)
    with pytest.raises(OverlapError, match="'corpus': [1-9][0-9]* of"):
        check_disjoint(leaky, {"corpus": tokenize_all(tok, f)})


def tokenize_all(tok, f: Path) -> torch.Tensor:
    return torch.tensor(tok(f.read_text(), add_special_tokens=False)["input_ids"])


def test_an_artificially_overlapping_window_raises_wherever_it_sits():
    g = torch.Generator().manual_seed(0)
    ev = torch.randint(0, 1000, (500,), generator=g)
    fit = torch.randint(0, 1000, (6, 16), generator=g)
    held = ev[123:139].clone()[None]  # a window at an unaligned offset
    cal = CalibrationSet(fit=fit, heldout=held)
    with pytest.raises(OverlapError, match="1 of 7 calibration windows"):
        check_disjoint(cal, {"a": torch.randint(0, 1000, (300,), generator=g), "b": ev})
    ok = check_disjoint(CalibrationSet(fit=fit, heldout=fit[:1]), {"b": ev})
    assert ok["b"]["leaked_windows"] == 0


def test_recipe_accepts_one_section_or_a_list_of_domains():
    single = recipe_from_dict({"evaluation": {"dataset": "embedded", "max_tokens": 2048}})
    assert [e.domain_name() for e in single.evaluation_domains()] == ["embedded"]
    assert single.to_dict()["evaluation"]["max_tokens"] == 2048  # the old form round-trips unchanged

    many = recipe_from_dict({"evaluation": [{"dataset": "embedded"}, {"dataset": "/data/wiki/test.txt"},
                                            {"dataset": "/data/code.txt", "name": "code", "seq_len": 128}]})
    assert [e.domain_name() for e in many.evaluation_domains()] == ["embedded", "test", "code"]
    assert recipe_from_dict(many.to_dict()).evaluation_domains() == many.evaluation_domains()
    assert many.calibration.dataset == "self" and many.policy.metric == "ppl"

    with pytest.raises(RecipeError, match=r"evaluation\.1\.strides: unknown key"):
        recipe_from_dict({"evaluation": [{"dataset": "embedded"}, {"strides": 3}]})
    with pytest.raises(RecipeError, match="distinct"):
        recipe_from_dict({"evaluation": [{"dataset": "/a/t.txt"}, {"dataset": "/b/t.txt"}]})
    with pytest.raises(RecipeError, match="calibration source only"):
        recipe_from_dict({"evaluation": {"dataset": "mix"}})
    with pytest.raises(RecipeError, match="min_tokens"):
        recipe_from_dict({"evaluation": {"max_tokens": 512}})
    with pytest.raises(RecipeError, match="policy.metric"):
        recipe_from_dict({"policy": {"metric": "bleu"}})


def test_too_small_evaluation_set_exits_2_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from compressor.cli import main
    from compressor.pipeline import stages

    src = save_tiny_checkpoint(tmp_path / "ckpt", "llama")
    (tmp_path / "tiny_eval.txt").write_text("alpha beta gamma delta omega river stone cloud light metal\n")

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(stages, "load_model", no_model)
    monkeypatch.setenv("COMPRESSOR_CACHE_DIR", str(tmp_path / "cache"))
    # windows within the tiny model's context (64): longer ones are refused first, on their own ground
    recipe = {"model": {"source": str(src)}, "calibration": {"seq_len": 32},
              "evaluation": {"dataset": str(tmp_path / "tiny_eval.txt"), "seq_len": 64},
              "output": {"path": str(tmp_path / "out")}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "min_tokens=1024" in err and "tiny_eval" in err
    assert not (tmp_path / "out").exists()


def test_run_reports_every_domain_and_gates_on_kl(tmp_path, monkeypatch):
    import compressor

    monkeypatch.setenv("COMPRESSOR_CACHE_DIR", str(tmp_path / "cache"))
    src = save_tiny_checkpoint(tmp_path / "ckpt", "llama")
    words = text_file(tmp_path / "words.txt")
    ev = {"max_tokens": 1024, "seq_len": 64, "stride": 32}
    recipe = recipe_from_dict({
        "model": {"source": str(src)},
        "calibration": {"dataset": "mix", "max_tokens": 2048, "seq_len": 32},
        "evaluation": [{"dataset": "embedded", **ev}, {"dataset": str(words), "name": "words", **ev}],
        "policy": {"threshold": -100, "metric": "kl", "kl_budget": 10.0, "order": "index"},
        "replacement": {"kind": "affine"},
        "measure": {"cache": False},
        "output": {"path": str(tmp_path / "out")},
    })
    res = compressor.run(recipe)
    assert res.exit_code == 0, res.report["message"]
    ev_rep = res.report["evaluation"]
    assert [d["name"] for d in ev_rep["domains"]] == ["embedded", "words"]
    for d in ev_rep["domains"]:
        assert d["passed"] and d["metric"] == "kl" and d["kl"] is not None and d["final"]["ppl_se"] > 0
        assert d["tokens"] == 1024 and d["overlap"]["leaked_windows"] == 0
    assert not ev_rep["one_domain"]
    assert res.report["calibration"]["self_tokens"] == 1024  # mix: half of max_tokens self-generated
    card = (tmp_path / "out" / "README.md").read_text()
    assert "What the gate measured" in card and "| words |" in card

    # Over a zero KL budget the gate fails and names the domains.
    strict = recipe.model_copy(update={"policy": recipe.policy.model_copy(update={"kl_budget": 0.0, "gate": False}),
                                       "output": recipe.output.model_copy(update={"path": str(tmp_path / "out2")})})
    res = compressor.run(strict)
    assert res.exit_code == 3 and "over budget on embedded" in res.report["message"] and "words" in res.report["message"]


def bos_tokenizer():
    """The tiny tokenizer, putting BOS in front of text as Gemma's does."""
    from tokenizers import processors

    tok = tiny_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    return tok


def test_windows_start_with_bos_only_where_the_tokenizer_adds_it():
    from compressor.inputs.data import start_windows, window_start

    assert window_start(tiny_tokenizer()) is None  # has a BOS token but does not put it in front of text
    tok = bos_tokenizer()
    assert window_start(tok) == tok.bos_token_id
    laid = start_windows(torch.arange(10, 17), 4, 1)
    assert laid.tolist() == [1, 10, 11, 12, 1, 13, 14, 15, 1, 16]
    assert start_windows(torch.arange(5), 4, None).tolist() == list(range(5))


def test_calibration_and_gate_windows_start_with_bos_for_such_a_tokenizer(tmp_path, caplog):
    from compressor.inputs.calibration import evaluation_streams

    f = text_file(tmp_path / "corpus.txt")
    tok = bos_tokenizer()
    bos = tok.bos_token_id
    plain = calibration_set(tiny_tokenizer(), TextSource(str(f)), seq_len=16, max_tokens=512, heldout_fraction=0.25)
    cal = calibration_set(tok, TextSource(str(f)), seq_len=16, max_tokens=512, heldout_fraction=0.25)
    windows = torch.cat([cal.fit, cal.heldout])
    assert (windows[:, 0] == bos).all() and (windows[:, 1:] != bos).all()
    assert cal.fit.shape[1] == plain.fit.shape[1] == 16
    recipe = recipe_from_dict({"evaluation": {"dataset": str(f), "seq_len": 64, "stride": 64, "max_tokens": 1024,
                                              "min_tokens": 256}})
    ids = evaluation_streams(recipe, tok)[f.stem]
    assert ids.numel() <= 1024 and (ids.view(-1, 64)[:, 0] == bos).all()
    # overlapping windows cannot each start with it: the stream stays plain text, and a warning says so
    overlapping = recipe_from_dict({"evaluation": {"dataset": str(f), "seq_len": 64, "stride": 32,
                                                   "max_tokens": 1024, "min_tokens": 256}})
    assert (evaluation_streams(overlapping, tok)[f.stem] != bos).all() and "stride 32 < seq_len 64" in caplog.text


def test_default_evaluation_is_prose_code_and_self_disjoint_from_calibration_and_from_the_public_stdlib():
    from compressor.inputs.data import EMBEDDED_CODE_FILES, embedded_code_files, load_documents
    from compressor.recipe.schema import EvaluationConfig, Recipe

    r = Recipe()
    assert [e.domain_name() for e in r.evaluation_domains()] == ["embedded", "embedded-code", "self"]
    assert r.self_seed(r.evaluation_domains()[2]) == r.calibration.seed + 1  # never the calibration's text
    assert all(e.stride == e.seq_len == 256 and e.max_tokens == 8192 for e in r.evaluation_domains())
    assert EvaluationConfig(seq_len=128).stride == 128  # stride follows seq_len unless given
    # the gate's code: only underscore-named stdlib files, which the public-stdlib check leaves out
    files = embedded_code_files()
    assert files and all(f.name in EMBEDDED_CODE_FILES and f.name.startswith("_") for f in files)
    cal = load_documents(TextSource("embedded-code"), "calibration")
    ev = load_documents(TextSource("embedded-code"), "evaluation")
    assert ev and not set(cal) & set(ev)
    assert sum("def " in d for d in ev) > len(ev) // 3
    # the first files take turns: the evaluation half samples more than one file
    head = "\n".join(ev[:12])
    assert "Decimal" in head and ("RawIOBase" in head or "IOBase" in head or "BufferedReader" in head)
    assert not same_source(TextSource("embedded"), TextSource("embedded-code"))
