"""The gate's confirmation split (policy.confirm_fraction): the search measures only its own windows,
its final choice is measured once on held-out windows and must pass there too, else the policy steps
back; both numbers reach report.json, the run summary and the model card."""

from __future__ import annotations

import pytest
import torch

from checkpoints import save_tiny_checkpoint
from test_cli import isolated, recipe_dict  # noqa: F401  (autouse: undoes main()'s logging changes)
from tiny import tiny_model

import compressor
from compressor.evaluation import gate as gate_mod
from compressor.evaluation.gate import Evaluator, confirmation_windows
from compressor.evaluation.teacher import evaluate

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_the_held_out_windows_are_every_kth_and_the_splits_pool_to_every_window():
    assert confirmation_windows(8, 0.25) == [3, 7] and confirmation_windows(10, 0.5) == [1, 3, 5, 7, 9]
    assert confirmation_windows(10, 0.1) == [9] and confirmation_windows(8, 0) == []
    teacher, student = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    g = torch.Generator().manual_seed(0)
    full = Evaluator.build(teacher, {"a": torch.randint(2, 128, (16 * 24,), generator=g)}, seq_len=24, stride=24,
                           batch_size=3, top_k=8)
    search, confirm = full.split(0.25)
    s, c = search.teachers[0], confirm.teachers[0]
    assert c.windows == [3, 7, 11, 15] and sorted(s.windows + c.windows) == list(range(16))
    assert c.topk_logp is full.teachers[0].topk_logp  # one teacher pass: the splits share its rows
    whole = evaluate(student, full.teachers[0])
    both = search(student).pooled(confirm(student)).primary
    for field in ("ppl", "kl", "agreement", "nll_se", "kl_se", "nll_delta_se", "tokens", "windows"):
        assert getattr(both, field) == pytest.approx(getattr(whole, field), rel=1e-9), field
    assert search.baseline.primary.windows == 12 and confirm.baseline.primary.windows == 4
    assert "scores" not in whole.to_json()
    assert full.split(0) == (full, None)


def _run(tmp_path, name: str, policy: dict, replacement: dict | None = None, **evaluation):
    d = recipe_dict(save_tiny_checkpoint(tmp_path / "in", "llama"), tmp_path / name)
    d["policy"] = {"strategy": "allocate", "allocation": "residual", "ppl_budget": 100.0, "max_backoff": 3, **policy}
    d["replacement"] = replacement or {"kind": "prune"}
    d["evaluation"].update(evaluation)
    return compressor.run(compressor.recipe_from_dict(d))


def _seen(monkeypatch) -> list[tuple[str, list[int]]]:
    """(description, windows scored) of every evaluation the gate makes."""
    seen: list[tuple[str, list[int]]] = []

    def spy(model, teacher, *, desc="evaluate"):
        seen.append((desc, teacher.windows))
        return evaluate(model, teacher, desc=desc)

    monkeypatch.setattr(gate_mod, "evaluate", spy)  # where Evaluator looks it up
    return seen


def test_the_search_never_scores_a_held_out_window(tmp_path, monkeypatch):
    seen = _seen(monkeypatch)
    res = _run(tmp_path, "out", {})
    assert res.exit_code == 0, res.report["message"]
    # recipe_dict: 1,024 tokens in windows of 64 every 32 → 31 windows, every 4th held out
    held = set(confirmation_windows(31, 0.25))
    search = [w for desc, w in seen if desc.startswith("gate:")]
    confirm = [w for desc, w in seen if desc.startswith("confirm:")]
    assert search and all(not held & set(w) for w in search)
    assert len(confirm) == 1 and set(confirm[0]) == held
    rows = res.report["allocation_attempts"]
    assert [r["confirmation"] for r in rows].count(True) == 1 and rows[-1]["confirmation"]


def _fail_confirmations(monkeypatch, n: int) -> list[str]:
    """The first ``n`` confirmations fail (as if the held-out windows had measured more)."""
    from compressor.policy import confirm as confirm_mod

    real, calls = confirm_mod.gate_check, []

    def crafted(baseline, candidate, policy):
        ok, why, per = real(baseline, candidate, policy)
        calls.append(why)
        return (False, "over budget on embedded: crafted", per) if len(calls) <= n else (ok, why, per)

    monkeypatch.setattr(confirm_mod, "gate_check", crafted)
    return calls


def test_a_cut_that_fails_confirmation_steps_back_to_one_that_confirms(tmp_path, monkeypatch):
    _fail_confirmations(monkeypatch, 1)
    res = _run(tmp_path, "out", {})
    rows = res.report["allocation_attempts"]
    confirms = [r for r in rows if r["confirmation"]]
    assert res.exit_code == 0, res.report["message"]
    assert [r["passed"] for r in confirms] == [False, True]
    failed, kept = confirms[0]["ffn_keep_target"], confirms[1]["ffn_keep_target"]
    assert kept > failed  # the step back keeps more
    # the search's cut that failed confirmation still passed the search windows
    assert any(not r["confirmation"] and r["passed"] and r["ffn_keep_target"] == failed for r in rows)
    # the bisection went on between them: every search attempt after the step back lies above the failed cut
    after = rows[rows.index(confirms[0]) + 1:]
    assert all(r["ffn_keep_target"] > failed for r in after if not r["confirmation"])
    ev = res.report["evaluation"]
    assert ev["confirmation"]["confirmations"] == 2 and "stepped back" in ev["confirmation"]["stepped_back"][0]
    assert "stepped back" in res.report["message"]
    kept_blocks = {d["index"]: d["size"] for d in res.report["blocks"] if d["decision"] == "kept"}
    assert kept_blocks == {int(i): w for i, w in confirms[1]["blocks"].items()}


def test_when_nothing_confirms_nothing_is_written_and_the_message_says_so(tmp_path, monkeypatch):
    _fail_confirmations(monkeypatch, 100)
    res = _run(tmp_path, "out", {"max_backoff": 2})
    assert res.exit_code == 3
    msg = res.report["message"]
    assert "the search windows passed, but confirmation failed" in msg and "policy.confirm_fraction" in msg
    assert [r["confirmation"] for r in res.report["allocation_attempts"]].count(True) == 2  # max(1, max_backoff)
    assert not (tmp_path / "out").exists()


def test_greedy_rolls_back_the_last_kept_blocks_until_the_set_confirms(tmp_path, monkeypatch):
    _fail_confirmations(monkeypatch, 1)
    res = _run(tmp_path, "out", {"strategy": "greedy", "threshold": -100, "order": "index"},
               {"kind": "prune", "keep": 0.5})
    assert res.exit_code == 0, res.report["message"]
    blocks = res.report["blocks"]
    rolled = [d for d in blocks if "failed confirmation" in d["reason"]]
    kept = [d["index"] for d in blocks if d["decision"] == "kept"]
    assert len(rolled) == 1 and rolled[0]["decision"] == "rejected" and rolled[0]["index"] > max(kept)
    assert res.report["evaluation"]["confirmation"]["confirmations"] == 2


def test_both_numbers_are_in_the_report_the_summary_and_the_card(tmp_path, capsys):
    from compressor.cli.run import _print_summary

    res = _run(tmp_path, "out", {})
    ev = res.report["evaluation"]
    assert ev["confirm_fraction"] == 0.25 and ev["confirmation"]["windows"] == {"embedded": 7}
    (d,) = ev["domains"]
    assert d["search"]["windows"] == 24 and d["confirmation"]["windows"] == 7 and d["windows"] == 31
    for split in ("search", "confirmation"):
        row = d[split]
        assert row["relative_delta_upper"] >= row["relative_delta"] and row["passed"] is True
    # every window together: the published perplexity is of the whole evaluation text
    final = res.report["perplexity"]["final"]
    assert final["windows"] == 31 and final["tokens"] == d["scored_tokens"]
    _print_summary(res.report, None)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("gate [embedded]"))
    assert "search " in line and "over 24 windows" in line and "over 7 held-out windows" in line
    assert f"{d['confirmation']['relative_delta_upper']:+.2%}" in line and "within budget" in line
    card = (res.output / "README.md").read_text()
    assert "held-out windows" in card and f"{d['confirmation']['relative_delta']:+.2%}" in card
    # the limit both splits were held to is the budget less the default headroom, and every place says so
    assert ev["headroom"] == 0.2 and "(the budget less policy.headroom 20%)" in line
    base, budget = res.report["perplexity"]["baseline"]["ppl"], ev["ppl_budget"]
    assert res.report["perplexity"]["budget"] == pytest.approx(base * (1 + budget * 0.8))
    assert d["search"]["limit"] / d["search"]["baseline_ppl"] == pytest.approx(1 + budget * 0.8)
    assert "held to 80% of the budget (policy.headroom 0.2)" in card


def test_confirm_fraction_zero_is_the_old_gate(tmp_path, monkeypatch):
    seen = _seen(monkeypatch)
    res = _run(tmp_path, "out", {"confirm_fraction": 0})
    assert res.exit_code == 0
    assert all(w == list(range(31)) for _, w in seen) and not any(d.startswith("confirm:") for d, _ in seen)
    ev = res.report["evaluation"]
    assert ev["confirmation"] is None and "confirmation" not in ev["domains"][0]
    assert not any(r["confirmation"] for r in res.report["allocation_attempts"])


def test_a_fraction_out_of_range_or_too_few_windows_is_refused(tmp_path, no_loading):
    from compressor.core.errors import InputError, RecipeError

    d = recipe_dict(tmp_path / "in", tmp_path / "out")
    d["policy"]["confirm_fraction"] = 0.6
    with pytest.raises((RecipeError, ValueError), match="confirm_fraction"):
        compressor.recipe_from_dict(d)
    # 4 windows of 64: 1 held out, too few for a standard error (exit 2, before the model loads)
    with pytest.raises(InputError, match=r"policy.confirm_fraction: 0.25 .* 4 windows .* leaves 1 held out"):
        _run(tmp_path, "out", {}, max_tokens=256, min_tokens=128, seq_len=64, stride=64)
