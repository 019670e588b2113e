"""``evaluation.tasks``: lm-eval tasks on the original and the compressed model, side by side in
``report.json`` and the card; refused before loading (exit 2) without lm-eval.

The task folder is built from Python's own documentation text (``tests/tasks.py``); the tests that
run lm-eval are skipped where it is not installed (``pip install 'compressor[eval]'``)."""

from __future__ import annotations

import json

import pytest
import yaml

from checkpoints import TINY_RECIPE, save_tiny_checkpoint, tiny_causal_lm, tiny_tokenizer
from tasks import TASK, cloze_items, write_task_folder

import compressor
from compressor.cli import main

pytestmark = pytest.mark.usefixtures("torch_single_thread")

RECIPE = TINY_RECIPE


@pytest.fixture(autouse=True)
def cache_dir(isolated_cache):
    return isolated_cache


def task_recipe(folder, **policy) -> dict:
    ev = dict(RECIPE["evaluation"], tasks=[TASK], task_paths=[str(folder)])
    return dict(RECIPE, evaluation=ev, policy=dict(RECIPE["policy"], **policy))


def test_cloze_items_come_from_python_docs():
    items = cloze_items(8)
    assert len(items) == 8
    assert all(i["choices"][i["label"]] and len(i["choices"]) == 4 for i in items)


def test_refused_without_lm_eval_before_loading(tmp_path, monkeypatch, no_loading, capsys):
    """Whether or not lm-eval is installed here: its absence is simulated."""
    monkeypatch.setattr("compressor.core.extras.have", lambda module: module != "lm_eval")
    folder = write_task_folder(tmp_path / "tasks")
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    data = dict(task_recipe(folder), model={"source": str(src)}, output={"path": str(tmp_path / "out")})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'compressor[eval]'" in err and "lm_eval" in err
    with pytest.raises(compressor.MissingExtraError, match=r"compressor\[eval\]"):
        compressor.oneshot(tiny_causal_lm("llama"), task_recipe(folder), tokenizer=tiny_tokenizer())
    assert not (tmp_path / "out").exists()


def test_task_budget_needs_tasks():
    with pytest.raises(compressor.RecipeError, match="task_budget"):
        compressor.recipe_from_dict(dict(RECIPE, policy={"task_budget": 0.02}))


def test_tasks_side_by_side_in_report_and_card(tmp_path):
    pytest.importorskip("lm_eval")
    from huggingface_hub import ModelCard

    folder = write_task_folder(tmp_path / "tasks", n=12)
    res = compressor.oneshot(tiny_causal_lm("llama"), task_recipe(folder), tokenizer=tiny_tokenizer(),
                             output_dir=tmp_path / "out")
    rep = json.loads((res.output / "report.json").read_text())
    row = rep["tasks"]["tasks"][0]
    assert row["task"] == TASK and row["metric"] == "acc" and row["samples"] == 12
    assert 0 <= row["original"] <= 1 and 0 <= row["compressed"] <= 1
    assert rep["tasks"]["original"][TASK]["acc"] == row["original"]
    card = ModelCard.load(res.output / "README.md")
    assert any(e.metric_type == "acc" and e.dataset_type == TASK for e in card.data.eval_results)
    assert f"| {TASK} | acc |" in card.text


def test_task_budget_fails_the_gate(tmp_path, monkeypatch):
    """A task drop over ``policy.task_budget`` raises GateFailed, nothing written (lm-eval stood in for)."""
    scores = iter([{TASK: {"acc": 0.75, "primary": "acc", "samples": 8}},
                   {TASK: {"acc": 0.50, "primary": "acc", "samples": 8}}])
    monkeypatch.setattr("compressor.evaluation.tasks.run_tasks", lambda *a, **k: next(scores))
    monkeypatch.setattr("compressor.core.extras.have", lambda module: True)
    folder = write_task_folder(tmp_path / "tasks")
    with pytest.raises(compressor.GateFailed, match="task budget") as info:
        compressor.oneshot(tiny_causal_lm("llama"), task_recipe(folder, task_budget=0.1), tokenizer=tiny_tokenizer(),
                           output_dir=tmp_path / "out")
    assert info.value.report["tasks"]["tasks"][0]["delta"] == pytest.approx(-0.25)
    assert not (tmp_path / "out").exists()
