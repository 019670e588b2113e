"""Calibration on several kinds of text, and the KL tail in the report (issue 72, item 5).

* a size run's default calibration mixes the model's own writing, prose and code (the quickstart too), from
  the embedded texts' calibration halves: no window the gate scores is fitted on;
* ``calibration.dataset`` takes a list of ``{source, weight}``: the tokens split by weight, deterministically,
  each source cut into windows of its own, the windows (and so every cache key made from them) changing with
  the list; a bad list is refused naming the field and what is allowed;
* every measured file's domain row carries the KL's 99.9th percentile beside its 99th, equal to numpy's over
  the per-token KL of the two models' full distributions.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoints import tiny_tokenizer
from tiny import random_windows, tiny_model

from compressor.inputs.calibration import build_calibration, evaluation_streams, self_settings
from compressor.inputs.data import check_disjoint
from compressor.recipe import RecipeError, load_recipe, recipe_from_dict
from compressor.recipe.schema import SIZE_CALIBRATION, split_by_weight

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "river", "stone", "cloud", "light", "metal", "seed", "tower"]
EVALUATION = [{"dataset": d, "seq_len": 32, "max_tokens": 1024} for d in ("embedded", "embedded-code")]


def _text_file(path: Path, lines: int = 1500) -> Path:
    rng = random.Random(0)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(lines)) + "\n")
    return path


def _size(extra: dict | None = None, calibration: dict | None = None) -> dict:
    d = {"output": {"path": "/tmp/never-written", "size": "Q4_K_M"}, "evaluation": EVALUATION}
    if calibration is not None:
        d["calibration"] = calibration
    return {**d, **(extra or {})}


def _sources(recipe) -> list[tuple[str, float]]:
    return [(s.source, s.weight) for s in recipe.calibration.dataset]


# --- the default --------------------------------------------------------------------------------------------


def test_a_size_runs_default_calibration_mixes_its_own_writing_prose_and_code():
    r = recipe_from_dict(_size(calibration={"max_tokens": 4096, "seq_len": 32}))
    assert _sources(r) == [("self", 0.5), ("embedded", 0.25), ("embedded-code", 0.25)]
    assert [n for _, n in r.calibration.shares()] == [2048, 1024, 1024]
    assert r.calibration.writes_self() and self_settings(r).n_tokens == 2048
    assert r.to_dict()["calibration"]["dataset"][0] == {"source": "self", "weight": 0.5, "config": None,
                                                        "split": "train", "text_column": "text"}
    assert recipe_from_dict(_size()).calibration.describe() == "self 0.5 + embedded 0.25 + embedded-code 0.25"
    # the resolved recipe reloads to itself (a dry run's output is a recipe)
    again = recipe_from_dict(r.to_dict())
    assert again.calibration == r.calibration and again.sha256() == r.sha256()


def test_a_structural_run_and_a_named_dataset_keep_their_calibration():
    assert recipe_from_dict({}).calibration.dataset == "self"
    assert recipe_from_dict(_size(calibration={"dataset": "self"})).calibration.dataset == "self"
    assert recipe_from_dict(_size(calibration={"dataset": "embedded"})).calibration.dataset == "embedded"


def test_the_shipped_size_recipes_calibrate_on_several_kinds_of_text():
    for name in ("smollm2-135m-gguf.yaml", "smollm2-135m-w4a16.yaml"):
        r = load_recipe(ROOT / "recipes" / name)
        assert r.output.size is not None
        assert {s for s, _ in _sources(r)} == {"self", "embedded", "embedded-code"}, name


def test_a_size_default_too_small_for_its_sources_says_so_and_how_to_fix_it():
    with pytest.raises(RecipeError, match=r"calibration.max_tokens: a size run calibrates by default on self 0.5.*"
                                          r"less than one window of seq_len 128; raise max_tokens to at least 512"):
        recipe_from_dict(_size(calibration={"max_tokens": 256, "seq_len": 128}))
    recipe_from_dict(_size(calibration={"max_tokens": 256, "seq_len": 128, "dataset": "self"}))


# --- the list's schema --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset, extra, message", [
    ([{"source": "self", "weight": -1}], {}, "calibration.dataset.0.weight: Input should be greater than 0"),
    ([{"source": "self", "weight": 1, "wieght": 2}], {},
     "calibration.dataset.0.wieght: unknown key; allowed keys here: source, weight, config, split, text_column"),
    ([{"source": "self"}], {}, "calibration.dataset.0.weight: Field required"),
    ([{"source": "mix", "weight": 1}], {}, "'mix' is itself a mixture"),
    ([], {}, "an empty list"),
    ([{"source": "self", "weight": 1}, {"source": "self", "weight": 2}], {}, r"dataset.1.source: 'self' is listed"),
    ([{"source": "self", "weight": 1}], {"config": "wikitext-2-raw-v1"}, "set config on the entry"),
    ([{"source": "self", "weight": 1}], {"self_tokens": 256}, "self_tokens: read by dataset 'mix' only"),
    ([{"source": "self", "weight": 1000}, {"source": "embedded", "weight": 1}], {},
     r"dataset.1.weight: 1.0 gives 'embedded' 16 of max_tokens 16384, less than one window of seq_len 128"),
])
def test_a_bad_calibration_list_is_refused_naming_the_field(dataset, extra, message):
    with pytest.raises(RecipeError, match=message) as err:
        recipe_from_dict({"calibration": {"dataset": dataset, **extra}})
    assert ".str:" not in str(err.value) and "list[" not in str(err.value)  # no pydantic branch tags


def test_tokens_split_by_weight_are_whole_sum_to_the_budget_and_never_change():
    assert split_by_weight(10, [1, 1, 1]) == [4, 3, 3]
    assert split_by_weight(7, [0.1, 0.2, 0.7]) == [1, 1, 5]
    assert split_by_weight(16384, [s["weight"] for s in SIZE_CALIBRATION]) == [8192, 4096, 4096]
    for total in (64, 1000, 16383):
        for weights in ([3, 1], [0.2, 0.3, 0.5], [1e-3, 1, 7]):
            counts = split_by_weight(total, weights)
            assert sum(counts) == total and counts == split_by_weight(total, weights)
            assert all(abs(c - total * w / sum(weights)) < 1 for c, w in zip(counts, weights))


# --- the windows --------------------------------------------------------------------------------------------


def _recipe(tmp_path: Path, dataset, max_tokens: int = 3072, evaluation=EVALUATION):
    return recipe_from_dict({"calibration": {"dataset": dataset, "max_tokens": max_tokens, "seq_len": 32},
                             "evaluation": evaluation, "output": {"path": str(tmp_path / "out")}})


def test_each_source_gives_its_share_in_windows_of_its_own_none_the_gate_scores(tmp_path):
    tok = tiny_tokenizer()
    f = _text_file(tmp_path / "corpus.txt")
    listed = [{"source": str(f), "weight": 0.5}, {"source": "embedded", "weight": 0.25},
              {"source": "embedded-code", "weight": 0.25}]
    r = _recipe(tmp_path, listed)
    cal, info = build_calibration(r, None, tok, use_cache=False)
    assert [(s["share"], s["tokens"]) for s in info["sources"]] == [(1536, 1536), (768, 768), (768, 768)]
    assert info["self_tokens"] == 0 and cal.fit.shape[0] + cal.heldout.shape[0] == 3072 // 32 - 0
    # every window is one source's: the file's words, the reference text's or the code's
    windows = torch.cat([cal.fit, cal.heldout])
    file_ids = set(tok(f.read_text(), add_special_tokens=False)["input_ids"])
    from_file = sum(set(w.tolist()) <= file_ids for w in windows)
    assert from_file == 1536 // 32
    # the gate's prose and code are the embedded texts' other halves: nothing the gate scores was fitted on
    streams = evaluation_streams(r, tok)
    overlap = check_disjoint(cal, streams)
    assert all(v["leaked_windows"] == 0 for v in overlap.values())
    # the same list gives the same windows; another split of the same sources other windows (a new cache key)
    assert build_calibration(r, None, tok, use_cache=False)[0].fingerprint() == cal.fingerprint()
    other = [dict(listed[0], weight=0.25), listed[1], dict(listed[2], weight=0.5)]
    assert build_calibration(_recipe(tmp_path, other), None, tok, use_cache=False)[0].fingerprint() != \
        cal.fingerprint()
    assert _recipe(tmp_path, other).sha256() != r.sha256()


def test_a_listed_file_the_gate_also_reads_is_split_by_document(tmp_path):
    tok = tiny_tokenizer()
    f = _text_file(tmp_path / "corpus.txt")
    evaluation = [{"dataset": str(f), "seq_len": 32, "max_tokens": 1024}]
    r = _recipe(tmp_path, [{"source": str(f), "weight": 1}, {"source": "embedded", "weight": 1}],
                evaluation=evaluation)
    cal, _ = build_calibration(r, None, tok, use_cache=False)
    assert check_disjoint(cal, evaluation_streams(r, tok))["corpus"]["leaked_windows"] == 0


def test_the_default_mix_with_the_models_own_writing_builds_and_stays_off_the_gates_text(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model("llama")
    r = recipe_from_dict(_size(calibration={"max_tokens": 1024, "seq_len": 32}))
    cal, info = build_calibration(r, model, tok, use_cache=False)
    assert [s["source"] for s in info["sources"]] == ["self", "embedded", "embedded-code"]
    assert info["self_tokens"] == 512 and info["text_tokens"] > 0
    assert cal.fit.shape[0] + cal.heldout.shape[0] >= 1024 // 32 - 3  # BOS in front of each read window
    assert all(v["leaked_windows"] == 0 for v in check_disjoint(cal, evaluation_streams(r, tok)).values())
    # a `mix` (embedded + self) builds the windows it built before the list existed: text first, then self
    mix = recipe_from_dict({"calibration": {"dataset": "mix", "max_tokens": 1024, "seq_len": 32},
                            "evaluation": EVALUATION})
    assert [(s.source, n) for s, n in mix.calibration.shares()] == [("embedded", 512), ("self", 512)]


# --- the KL tail ----------------------------------------------------------------------------------------------


def test_every_measured_domain_row_gives_the_kl_p99_9_beside_the_p99():
    """The reloaded-checkpoint path (compressed-tensors, :func:`model_scores`) against a brute-force KL of the
    two models' full distributions; llama.cpp's path fills the same row from the same per-token KL."""
    from compressor.evaluation.external import model_scores
    from compressor.evaluation.perplexity import windows
    from compressor.evaluation.teacher import TeacherCache

    model, other = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = random_windows(16, 32).flatten()
    seq = stride = 32
    vocab = model.get_input_embeddings().weight.shape[0]
    teacher = TeacherCache.build(model, ids, seq_len=seq, stride=stride, top_k=vocab)
    row = model_scores(other, ids, seq, stride, teacher).row("code", 10.0)
    flat, per_token = ids.tolist(), []
    for b, e, scored in windows(len(flat), seq, stride):
        k = min(scored, e - b - 1)
        with torch.no_grad():
            p = torch.log_softmax(model(torch.tensor([flat[b:e]])).logits[0, -k - 1:-1].double(), -1)
            q = torch.log_softmax(other(torch.tensor([flat[b:e]])).logits[0, -k - 1:-1].double(), -1)
        per_token.append((p.exp() * (p - q)).sum(-1).numpy())
    kl = np.concatenate(per_token)
    assert row["kl_p999"] == pytest.approx(np.quantile(kl, 0.999), rel=1e-3)
    assert row["kl_p99"] == pytest.approx(np.quantile(kl, 0.99), rel=1e-3)
    assert row["kl_mean"] <= row["kl_p99"] < row["kl_p999"] <= kl.max() * (1 + 1e-3)


def test_a_run_calibrated_on_a_list_reports_each_sources_share_and_saves_a_recipe_that_runs_again(tmp_path,
                                                                                                  monkeypatch):
    import json

    import compressor
    from checkpoints import save_tiny_checkpoint

    monkeypatch.setenv("COMPRESSOR_CACHE_DIR", str(tmp_path / "cache"))
    src = save_tiny_checkpoint(tmp_path / "ckpt", "llama")
    words = _text_file(tmp_path / "words.txt")
    listed = [{"source": str(words), "weight": 0.5}, {"source": "self", "weight": 0.25},
              {"source": "embedded-code", "weight": 0.25}]
    res = compressor.run(recipe_from_dict({
        "model": {"source": str(src)},
        "calibration": {"dataset": listed, "max_tokens": 2048, "seq_len": 32},
        "evaluation": [{"dataset": d, "max_tokens": 1024, "seq_len": 64, "stride": 64}
                       for d in ("embedded", "embedded-code")],
        "policy": {"threshold": -100, "ppl_budget": 10.0, "order": "index"}, "replacement": {"kind": "affine"},
        "measure": {"cache": False}, "output": {"path": str(tmp_path / "out")},
    }))
    assert res.exit_code == 0, res.report["message"]
    cal = json.loads((tmp_path / "out" / "report.json").read_text())["calibration"]
    assert cal["data"] == "words.txt 0.5 + self 0.25 + embedded-code 0.25"  # a file by its name, no path
    assert [(s["source"], s["share"]) for s in cal["sources"]] == [(str(words), 1024), ("self", 512),
                                                                    ("embedded-code", 512)]
    assert cal["self_tokens"] == 512 and all(s["tokens"] == s["share"] for s in cal["sources"])
    assert all(d["overlap"]["leaked_windows"] == 0 for d in res.report["evaluation"]["domains"])
    saved = load_recipe(tmp_path / "out" / "recipe.yaml")
    assert [(s.source, s.weight) for s in saved.calibration.dataset] == [(d["source"], d["weight"]) for d in listed]


def test_a_gguf_size_run_calibrates_on_the_mix_by_default_and_reports_the_kl_tail_per_domain(tmp_path,
                                                                                              monkeypatch):
    """End to end in llama.cpp: no calibration dataset named, so the mix; every gate domain's row (and the
    preset's beside it) carries the KL's p99.9 beside its p99."""
    pytest.importorskip("llama_cpp")
    import compressor
    from test_gguf import _size_source, byte_level_tokenizer, TEXT, SEQ

    monkeypatch.setenv("COMPRESSOR_CACHE_DIR", str(tmp_path / "cache"))
    tok = byte_level_tokenizer(TEXT)
    src = _size_source(tmp_path, tok, torch.tensor(tok(TEXT).input_ids[: 6 * SEQ]), "q8_0")
    res = compressor.run(recipe_from_dict({
        "model": {"source": str(src)}, "calibration": {"max_tokens": 2048, "seq_len": 32},
        "evaluation": [{"dataset": d, "max_tokens": 1024, "seq_len": 64, "stride": 64}
                       for d in ("embedded", "embedded-code")],
        "policy": {"metric": "kl", "kl_budget": 5.0}, "measure": {"cache": False},
        "output": {"path": str(tmp_path / "out"), "size": "Q4_0"},
    }))
    assert res.exit_code == 0, res.report.get("message")
    assert [s["source"] for s in res.report["calibration"]["sources"]] == ["self", "embedded", "embedded-code"]
    ev = res.report["evaluation"]  # the gate's domains are kinds the mix drew from: a note, not a warning
    assert ev["one_domain"] and "calibration also drew from" in ev["notes"][0]
    assert not any("come from one domain" in w for w in ev["warnings"])
    domains = res.report["verification"]["gguf"]["domains"]
    assert [d["name"] for d in domains] == ["embedded", "embedded-code"]
    for d in domains:
        assert 0 < d["kl_median"] <= d["kl_p99"] <= d["kl_p999"] and 0 < d["same_top_token"] <= 1
        assert d["preset_kl_p99"] <= d["preset_kl_p999"]
