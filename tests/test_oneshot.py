"""``compressor.oneshot`` on a model object, as a Hugging Face user calls it, and its exceptions.

Tiny llama from a config (``tests/checkpoints.py``); nothing is downloaded. The statistics cache
points into ``tmp_path``; every test checks that it leaves nothing behind outside it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoints import TINY_RECIPE, save_tiny_checkpoint, tiny_causal_lm, tiny_tokenizer

import compressor

pytestmark = pytest.mark.usefixtures("torch_single_thread")

RECIPE = TINY_RECIPE


@pytest.fixture(autouse=True)
def cache_dir(isolated_cache):
    return isolated_cache


def calibration_texts() -> list[str]:
    from compressor.inputs.data import _embedded_documents

    return _embedded_documents("calibration")


def test_oneshot_on_a_loaded_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = save_tiny_checkpoint(tmp_path / "tiny", "llama")
    m = AutoModelForCausalLM.from_pretrained(src)
    tok = AutoTokenizer.from_pretrained(src)
    before = sum(p.numel() for p in m.parameters())
    res = compressor.oneshot(m, RECIPE, tokenizer=tok, dataset=calibration_texts())
    assert res.model is m and res.output is None
    assert sum(p.numel() for p in res.model.parameters()) < before
    assert res.report["status"] == "success" and res.report["output"] is None
    ids = tok("def f(x):", return_tensors="pt").input_ids
    out = res.model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5
    # its own save_pretrained folder reloads, with the same logits
    res.model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert sum(p.numel() for p in again.parameters()) == sum(p.numel() for p in res.model.parameters())
    with torch.no_grad():
        assert torch.allclose(again(ids).logits, res.model(ids).logits, atol=1e-5)
    # the texts' temporary file is gone; nothing but what the test made
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "stats-cache") == ["saved", "tiny"]


def test_oneshot_writes_output_dir(tmp_path):
    m, tok = tiny_causal_lm("llama"), tiny_tokenizer()
    res = compressor.oneshot(m, RECIPE, tokenizer=tok, output_dir=tmp_path / "out",
                             overrides={"policy.ppl_budget": 0.6})
    assert res.output == (tmp_path / "out").resolve()
    rep = json.loads((res.output / "report.json").read_text())
    assert rep["recipe"]["policy"]["ppl_budget"] == 0.6
    assert rep["model"]["source"] == "in-memory"
    assert 0 <= rep["agreement"]["next_token"] <= 1
    assert set(rep["agreement"]["continuations"]) >= {"identical", "matching_prefix", "tokens"}
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(res.output)
    assert sum(p.numel() for p in again.parameters()) == rep["params"]["after"]


def test_gate_that_cannot_be_met_raises_gate_failed(tmp_path):
    m, tok = tiny_causal_lm("llama"), tiny_tokenizer()
    recipe = dict(RECIPE, policy={"threshold": 1.0})  # no candidate: min_blocks cannot be reached
    with pytest.raises(compressor.GateFailed) as info:
        compressor.oneshot(m, recipe, tokenizer=tok, output_dir=tmp_path / "out")
    assert "min_blocks" in str(info.value)
    assert info.value.report["status"] == "rejected" and info.value.attempts == []
    assert not isinstance(info.value, SystemExit)
    assert [p.name for p in tmp_path.iterdir() if p.name != "stats-cache"] == []


def test_bad_recipe_raises_input_error_before_anything(tmp_path, no_loading):
    m, tok = tiny_causal_lm("llama"), tiny_tokenizer()
    with pytest.raises(compressor.InputError, match="policy.ppl_budgt"):
        compressor.oneshot(m, dict(RECIPE, policy={"ppl_budgt": 0.1}), tokenizer=tok, output_dir=tmp_path / "out")
    with pytest.raises(compressor.InputError, match="overrides"):
        compressor.oneshot(m, RECIPE, tokenizer=tok, overrides=3)
    with pytest.raises(compressor.InputError, match="dataset"):
        compressor.oneshot(m, RECIPE, tokenizer=tok, dataset=[1, 2])
    with pytest.raises(compressor.InputError, match="tokenizer"):
        compressor.oneshot(m, RECIPE)  # a model from a config names no tokenizer
    assert [p.name for p in tmp_path.iterdir() if p.name != "stats-cache"] == []


def test_run_keeps_its_exit_code(tmp_path):
    """``compressor.run`` still reports a failed gate as ``exit_code == 3`` (existing callers)."""
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    recipe = compressor.recipe_from_dict(dict(RECIPE, model={"source": str(src)}, policy={"threshold": 1.0},
                                              output={"path": str(tmp_path / "out")}))
    res = compressor.run(recipe)
    assert res.exit_code == compressor.EXIT_GATE and res.output is None
    assert not (tmp_path / "out").exists()


def test_exit_codes_by_exception_class():
    from compressor.core.errors import exit_code_for

    assert exit_code_for(compressor.GateFailed("x")) == 3
    assert exit_code_for(compressor.RecipeError("x")) == 2
    assert exit_code_for(compressor.InputError("x")) == 2
    assert exit_code_for(RuntimeError("x")) == 1
    assert issubclass(compressor.RecipeError, compressor.InputError)
