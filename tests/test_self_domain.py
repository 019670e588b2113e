"""The ``self`` evaluation domain: text the original model writes under a seed the calibration does not use,
one row per window, cached, bound into the resume key, gated like any other domain."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints import save_tiny_checkpoint, tiny_tokenizer
from test_cli import isolated, recipe_dict  # noqa: F401  (autouse: undoes main()'s logging changes)
from tiny import tiny_model

import compressor
from compressor.core.errors import RecipeError
from compressor.inputs.calibration import self_evaluation_streams
from compressor.inputs.selfcal import SelfCalSettings, generate_tokens
from compressor.recipe import recipe_from_dict
from compressor.recipe.schema import Recipe

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _recipe(evaluation, calibration=None) -> Recipe:
    return Recipe.model_validate({"calibration": calibration or {}, "evaluation": evaluation})


def test_self_is_a_domain_with_its_own_seed():
    r = _recipe([{"dataset": "embedded"}, {"dataset": "self"}])
    e = r.evaluation_domains()[1]
    assert e.domain_name() == "self" and e.self_written() and r.self_seed(e) == 1
    assert r.self_seed(_recipe([{"dataset": "self", "seed": 7}]).evaluation_domains()[0]) == 7
    # the calibration's seed is the fitted text; with a calibration read from a file it is free
    assert _recipe({"dataset": "self", "seed": 0}, {"dataset": "embedded"}).self_seed(
        _recipe({"dataset": "self", "seed": 0}, {"dataset": "embedded"}).evaluation_domains()[0]) == 0


@pytest.mark.parametrize("evaluation, calibration, words", [
    ({"dataset": "self", "seed": 0}, {}, ["calibration.seed", "another seed"]),
    ({"dataset": "self", "seed": 5}, {"dataset": "mix", "seed": 5}, ["calibration.seed"]),
    ({"dataset": "embedded", "seed": 3}, {}, ["seed", "remove seed"]),
    ({"dataset": "self", "seq_len": 64, "stride": 32}, {}, ["stride (32) must equal seq_len (64)"]),
    ({"dataset": "mix"}, {}, ["calibration source only", "'self'"]),
])
def test_a_self_domain_that_cannot_work_is_refused_naming_the_field(evaluation, calibration, words):
    with pytest.raises(RecipeError) as err:
        recipe_from_dict({"calibration": calibration, "evaluation": evaluation})
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_the_rows_are_the_models_own_writing_one_per_window_under_the_domains_seed(isolated_cache):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    r = _recipe([{"dataset": "self", "max_tokens": 1000, "seq_len": 64, "min_tokens": 512}])
    ids = self_evaluation_streams(r, model, tok, use_cache=True)["self"]
    assert ids.shape == (960,)  # whole rows: 1000 // 64 windows of 64
    rows = ids.view(-1, 64)
    assert (rows[:, 0] == tok.bos_token_id).all()  # each window starts as the model's input does
    # exactly what the sampler writes under seed calibration.seed + 1, and not the calibration's text
    same = generate_tokens(model, tok, SelfCalSettings(n_tokens=1000, seq_len=62, seed=1))
    assert torch.equal(ids, same[:960])
    calibration_like = generate_tokens(model, tok, SelfCalSettings(n_tokens=1000, seq_len=62, seed=0))
    assert not torch.equal(ids, calibration_like[:960])
    # the second call reads the cache (nothing is sampled)
    cached = list((isolated_cache / "selfcal").glob("*.safetensors"))
    assert len(cached) == 1
    again = self_evaluation_streams(r, model, tok, use_cache=True)["self"]
    assert torch.equal(ids, again)


def test_a_run_gates_on_the_models_own_writing_and_reports_it(tmp_path, isolated_cache):
    d = recipe_dict(save_tiny_checkpoint(tmp_path / "in", "llama"), tmp_path / "out")
    d["evaluation"] = [{"dataset": "embedded", "max_tokens": 1024, "seq_len": 64},
                       {"dataset": "self", "max_tokens": 1024, "seq_len": 64}]
    d["policy"] = {"strategy": "allocate", "allocation": "residual", "ppl_budget": 100.0, "max_backoff": 1}
    d["replacement"] = {"kind": "prune"}
    result = compressor.run(compressor.recipe_from_dict(d))
    assert result.exit_code == 0, result.report.get("message")
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    rows = {row["name"]: row for row in rep["evaluation"]["domains"]}
    assert list(rows) == ["embedded", "self"]
    assert rows["self"]["dataset"] == "self" and rows["self"]["tokens"] == 1024
    assert rows["self"]["search"]["windows"] + rows["self"]["confirmation"]["windows"] == 16
    assert rows["self"]["overlap"]["leaked_windows"] == 0
    assert not rep["evaluation"]["one_domain"]
    assert rep["timings"]["self_evaluation_s"] >= 0 and "self_evaluation_s" not in rep["calibration"]
    assert "self" in (tmp_path / "out" / "README.md").read_text()


def test_the_resume_key_binds_the_written_text():
    from compressor.inputs.data import CalibrationSet
    from compressor.pipeline.stages import calibration_key

    r = _recipe([{"dataset": "embedded"}, {"dataset": "self"}])
    cal = CalibrationSet(fit=torch.zeros(2, 8, dtype=torch.long), heldout=torch.zeros(1, 8, dtype=torch.long))
    a = calibration_key(r, cal, {"embedded": torch.arange(10), "self": torch.arange(10)})
    b = calibration_key(r, cal, {"embedded": torch.arange(10), "self": torch.arange(1, 11)})
    assert a != b and a.startswith(cal.fingerprint())
    assert calibration_key(_recipe({"dataset": "embedded"}), cal, {"embedded": torch.arange(10)}) == cal.fingerprint()


def test_the_estimate_counts_text_still_to_write():
    from compressor.pipeline.estimate import estimate_run

    model = tiny_model("llama")
    r = _recipe([{"dataset": "embedded"}, {"dataset": "self"}])
    assert "self-written evaluation" not in estimate_run(r, model, self_text_cached=True, hidden=True).stages
    est = estimate_run(r, model, self_text_cached=True, hidden=True, self_eval_tokens=8192)
    assert est.stages["self-written evaluation"] > 0


def test_the_estimate_counts_only_the_text_not_in_the_cache(isolated_cache):
    from compressor.engine.cache import model_fingerprint
    from compressor.pipeline.stages import Loaded, _text_to_write

    model, tok = tiny_model("llama"), tiny_tokenizer()
    r = _recipe([{"dataset": "self", "max_tokens": 1024, "seq_len": 64}], {"dataset": "embedded"})
    loaded = Loaded(model, tok, None, "llama", None)
    fp = model_fingerprint(model)
    assert _text_to_write(r, loaded, fp) == (True, 1024)  # an embedded calibration writes nothing
    self_evaluation_streams(r, model, tok, use_cache=True, model_fp=fp)
    assert _text_to_write(r, loaded, fp) == (True, 0)
    assert _text_to_write(r, loaded, None) == (False, 1024)  # no cache: everything is written
