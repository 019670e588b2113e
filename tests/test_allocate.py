"""Allocation of one parameter budget across blocks (compressor.policy.allocate)."""

from __future__ import annotations

import itertools
import random

import pytest

from compressor.policy.allocate import BlockCurve, allocate
from compressor.fitting.kinds import Level


def _curves(seed: int, n_blocks: int = 4, n_levels: int = 5) -> list[BlockCurve]:
    rng = random.Random(seed)
    curves = []
    for i in range(n_blocks):
        full = 1000
        sizes = sorted(rng.sample(range(1, 100), n_levels), reverse=True)
        errs = sorted((rng.random() for _ in sizes))
        levels = [Level(s, 10 * s, e) for s, e in zip(sizes, errs)]
        curves.append(BlockCurve(i, full, levels, weight=rng.uniform(0.5, 5)))
    return curves


def _cost(curves, choice) -> float:
    return sum(0.0 if choice[c.index] is None else c.weight * choice[c.index].heldout_rel_error for c in curves)


def _params(curves, choice) -> int:
    return sum(c.ffn_params if choice[c.index] is None else choice[c.index].params for c in curves)


@pytest.mark.parametrize("seed", range(5))
def test_lagrangian_choice_is_optimal_for_the_budget_it_uses(seed):
    """Brute force over every combination: nothing within the same parameters costs less."""
    curves = _curves(seed)
    total = sum(c.ffn_params for c in curves)
    for keep in (0.9, 0.6, 0.3, 0.1):
        choice = allocate(curves, int(keep * total), "fisher")
        used = _params(curves, choice)
        assert used <= int(keep * total) or all(choice[c.index] is not None for c in curves)
        options = [[None] + c.levels for c in curves]
        best = min(
            _cost(curves, dict(zip(range(len(curves)), combo)))
            for combo in itertools.product(*options)
            if _params(curves, dict(zip(range(len(curves)), combo))) <= used
        )
        assert _cost(curves, choice) == pytest.approx(best, abs=1e-12)


def test_more_budget_never_costs_more_and_sensitive_blocks_keep_more():
    curves = _curves(0)
    total = sum(c.ffn_params for c in curves)
    costs = [_cost(curves, allocate(curves, int(k * total), "fisher")) for k in (0.2, 0.4, 0.6, 0.8, 1.0)]
    assert costs == sorted(costs, reverse=True)
    # two identical curves, one 100x more sensitive: it keeps at least as many parameters
    lv = [Level(s, 10 * s, 1 - s / 100) for s in (80, 60, 40, 20)]
    pair = [BlockCurve(0, 1000, lv, weight=1.0), BlockCurve(1, 1000, lv, weight=100.0)]
    choice = allocate(pair, 1200, "fisher")
    p = {c.index: (c.ffn_params if choice[c.index] is None else choice[c.index].params) for c in pair}
    assert p[1] >= p[0]


def test_uniform_gives_every_block_the_same_fraction():
    lv = [Level(s, 10 * s, 1 - s / 100) for s in (100, 75, 50, 25)]
    curves = [BlockCurve(i, 1000, list(lv), weight=w) for i, w in enumerate((1.0, 50.0, 0.1))]
    choice = allocate(curves, 1600, "uniform")
    assert {lv.size for lv in choice.values()} == {50}


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="fisher"):
        allocate(_curves(0), 100, "magic")


def test_when_no_cut_passes_the_message_gives_the_smallest_cut_and_its_cost():
    from compressor.policy.compress import no_cut_message

    attempts = [{"ffn_params_kept": 650, "ffn_params_total": 1000, "ppl": 150.0},
                {"ffn_params_kept": 970, "ffn_params_total": 1000, "ppl": 108.5}]
    msg = no_cut_message(attempts, 100.0, 0.05, "relative")
    assert "even the smallest tried (keep 97.0 % → +8.5 %" in msg and "budget of +5.0 %" in msg
    assert "keep 65.0 % → +50.0 %; keep 97.0 % → +8.5 %" in msg and "policy.ppl_budget" in msg


def test_a_single_attempt_says_it_was_the_smallest_cut_the_search_reaches():
    from compressor.policy.compress import no_cut_message

    attempts = [{"ffn_params_kept": 978, "ffn_params_total": 1000, "ppl": 118.1}]
    msg = no_cut_message(attempts, 100.0, 0.05, "relative")
    assert "even the smallest tried (keep 97.8 % → +18.1 %" in msg and "only cut" in msg and "tried:" not in msg
    assert "calibration.dataset: self" not in msg
    # self-written calibration: its domain is the first thing to change
    msg = no_cut_message(attempts, 100.0, 0.05, "relative", self_written=True)
    assert "calibration.dataset: self" in msg and "domain you use the model for" in msg and "ppl_budget" in msg


def test_with_several_gate_domains_the_message_gives_each_cut_the_cost_of_its_worst_domain():
    """Qwen2.5-Coder-1.5B gated on WikiText and Python: the message said "+0.4 % … is over the budget
    of +5.0 %" (the first domain's change) where the cut failed at +16.8 % on Python."""
    from compressor.policy.compress import no_cut_message

    def tried(kept, wiki, python, blocks):
        return {"ffn_params_kept": kept, "ffn_params_total": 1000, "ppl": wiki, "passed": False, "blocks": blocks,
                "domains": {"wikitext": {"ppl": wiki, "kl": 0.0}, "python": {"ppl": python, "kl": 0.0}}}

    attempts = [tried(978, 16.44, 10.087, {"5": 8448, "27": 8704}), tried(999, 16.44, 9.497, {"27": 8704})]
    msg = no_cut_message(attempts, 16.376, 0.05, "relative", baselines={"wikitext": 16.376, "python": 8.134})
    assert "even the smallest tried (keep 99.9 % → +16.8 % on python)" in msg
    assert "keep 97.8 % → +24.0 % on python" in msg and "+0.4 %" not in msg
    # the block narrowed alone, every cut tried narrowed it: named, with the way to leave it out
    assert "Block 27 narrowed alone (to 8,704 units) fails" in msg and "every cut tried narrowed it" in msg
    assert "policy.exclude: [27]" in msg and "--measurements-from" in msg
    # one domain: the cost as before, no domain named
    one = no_cut_message(attempts, 16.376, 0.05, "relative", baselines={"wikitext": 16.376})
    assert "keep 99.9 % → +0.4 % perplexity on the gate's text" in one and "on python" not in one


def test_no_block_is_named_when_every_failed_cut_narrowed_several():
    from compressor.policy.compress import no_cut_message

    attempts = [{"ffn_params_kept": 970, "ffn_params_total": 1000, "ppl": 108.5, "passed": False,
                 "blocks": {"1": 64, "2": 64}}]
    assert "policy.exclude" not in no_cut_message(attempts, 100.0, 0.05, "relative")


def test_the_smallest_cut_is_where_a_bisection_of_failures_ends():
    from compressor.policy.compress import smallest_cut

    # halving the removed share from a floor of 0.3 kept: 0.65, 0.825, 0.9125, 0.95625, 0.978125
    assert smallest_cut(0.3, 5, lambda f: (f + 1.0) / 2) == pytest.approx(1 - 0.7 / 32)
    assert smallest_cut(0.3, 0, lambda f: (f + 1.0) / 2) is None
    grid = [0.5, 0.75]  # a grid search runs out of widths before its steps
    assert smallest_cut(0.3, 5, lambda f: next((k for k in grid if k > f), None)) == 0.75


def _prune_run(tmp_path, name: str, policy: dict):
    import compressor
    from checkpoints import save_tiny_checkpoint
    from test_cli import recipe_dict

    d = recipe_dict(save_tiny_checkpoint(tmp_path / "in", "llama"), tmp_path / name)
    d["policy"] = {"strategy": "allocate", "allocation": "residual", **policy}
    d["replacement"] = {"kind": "prune"}
    return compressor.run(compressor.recipe_from_dict(d))


def test_when_the_smallest_cut_fails_the_search_goes_below_it(tmp_path):
    """A budget nothing can meet: the smallest cut of the bisection first, then the smallest cut there
    is (one step of one block), which fails too, so nothing above it is tried; exit 3, and a message
    that says so (no block left out: policy.drop_failing_blocks 0)."""
    # two steps: the smallest cut removes 17.5 % of the FFN parameters (a few units of a tiny FFN at least)
    res = _prune_run(tmp_path, "out", {"metric": "kl", "kl_budget": 1e-12, "max_backoff": 2, "drop_failing_blocks": 0})
    attempts = res.report["allocation_attempts"]
    keeps = [a["ffn_keep_target"] for a in attempts]
    assert res.exit_code == 3 and len(attempts) == 2 and not any(a["passed"] for a in attempts)
    assert attempts[-1]["blocks_replaced"] == 1
    assert keeps[0] == pytest.approx(1 - 0.7 / 4) and keeps == sorted(keeps)  # then halving the cut
    assert all(a["blocks_replaced"] > 0 for a in attempts)
    allocations = [tuple(sorted(a["blocks"].items())) for a in attempts]
    assert len(set(allocations)) == len(allocations)
    kept = [a["ffn_params_kept"] for a in attempts]
    assert kept == sorted(kept) and kept[0] < kept[-1]
    msg = res.report["message"]
    assert f"keep {100 * kept[-1] / attempts[0]['ffn_params_total']:.1f} %" in msg.split("tried:")[0]
    assert "KL 1e-12 nats/token" in msg and "policy.kl_budget" in msg and "+5.0 %" not in msg
    # the limit the gate held the bound to: the budget less policy.headroom (0.2 by default)
    assert "the gate's limit of KL 8e-13 nats/token (the budget of KL 1e-12 nats/token less policy.headroom 20%" in msg
    assert "divided by 1 − headroom" in msg


def test_end_to_end_the_block_that_fails_alone_is_left_out_and_named(tmp_path):
    """The same budget with policy.drop_failing_blocks at its default (1): the one-step cut's block is
    left out, a second search runs over the others and fails too; exit 3, nothing written, and the
    message and the block's decision say what was left out."""
    res = _prune_run(tmp_path, "out", {"metric": "kl", "kl_budget": 1e-12, "max_backoff": 2})
    rows = res.report["allocation_attempts"]
    first = [r for r in rows if not r.get("left_out")]
    (dropped,) = {int(b) for b in first[-1]["blocks"]}
    again = [r for r in rows if r.get("left_out") == [dropped]]
    assert res.exit_code == 3 and again and all(str(dropped) not in r["blocks"] for r in again)
    msg = res.report["message"]
    assert f"left out block {dropped}" in msg and "policy.drop_failing_blocks" in msg
    (second,) = {int(b) for b in again[-1]["blocks"]}
    assert f"policy.exclude: [{', '.join(map(str, sorted({dropped, second})))}]" in msg
    d = next(b for b in res.report["blocks"] if b["index"] == dropped)
    assert d["decision"] == "not a candidate" and "left out by the search" in d["reason"]


def test_a_cut_below_the_smallest_of_the_bisection_passes_when_it_is_within_budget(tmp_path):
    """The smallest cut of the bisection fails, a smaller one is within budget: it is written (exit 0)."""
    probe = _prune_run(tmp_path, "probe", {"metric": "kl", "kl_budget": 1e-12, "max_backoff": 2})
    floor, below = probe.report["allocation_attempts"][:2]
    kl = lambda a: max(d["kl"] for d in a["domains"].values())  # noqa: E731
    assert kl(below) < kl(floor)
    res = _prune_run(tmp_path, "out", {"metric": "kl", "kl_budget": (kl(below) * kl(floor)) ** 0.5, "max_backoff": 2})
    attempts = res.report["allocation_attempts"]
    assert res.exit_code == 0 and [a["passed"] for a in attempts][:2] == [False, True]
    assert attempts[1]["ffn_keep_target"] == pytest.approx(below["ffn_keep_target"])
    assert res.report["params"]["after"] < res.report["params"]["before"]


def test_a_passing_smallest_cut_leaves_the_bisection_where_it_was(tmp_path):
    """The floor is tried first and reused: the bisection ends on the cut it found without it."""
    res = _prune_run(tmp_path, "out", {"ppl_budget": 100.0, "max_backoff": 3})
    rows = res.report["allocation_attempts"]
    keeps = [a["ffn_keep_target"] for a in rows if not a["confirmation"]]
    # the floor (0.9125) first, then the bisection from 0.65: every cut passes this budget
    assert res.exit_code == 0 and keeps == pytest.approx([0.9125, 0.65, 0.475, 0.3875])
    # then the choice, once, on the held-out windows
    assert rows[-1]["confirmation"] and rows[-1]["passed"] and rows[-1]["ffn_keep_target"] == pytest.approx(0.3875)


def test_allocating_whole_block_affine_swaps_runs_to_the_end(tmp_path):
    """allocate with the affine kind (no teacher target) used to fail after the gate with an AttributeError."""
    import compressor
    from checkpoints import save_tiny_checkpoint
    from test_cli import recipe_dict

    d = recipe_dict(save_tiny_checkpoint(tmp_path / "in", "llama"), tmp_path / "out")
    d["policy"] = {"strategy": "allocate", "allocation": "residual", "ffn_keep": 0.5, "ppl_budget": 100.0}
    d["replacement"] = {"kind": "affine"}
    res = compressor.run(compressor.recipe_from_dict(d))
    assert res.exit_code == 0 and res.report["allocation_attempts"][-1]["target"] == "none"


def test_scarce_calibration_rows_are_named_with_the_tokens_needed():
    """Qwen2.5-Coder-1.5B at the default 16,384 tokens: 14,336 fit rows for 8,960 units is 1.6 per unit;
    SmolLM2-135M's 1,536 units get 9.3 and no warning."""
    from compressor.policy.compress import scarce_rows_message

    msg = scarce_rows_message(14336, 8960, 16384, 0.125)
    assert msg is not None and "1.6 per unit" in msg and "calibration.max_tokens ≥ 51,200 (now 16,384)" in msg
    assert f"at least {14336 / (14336 - 8704):.1f}×" in msg  # n / (n − p) at the first cut's 8,704 units
    assert "replacement.ridge" in msg
    assert scarce_rows_message(14336, 1536, 16384, 0.125) is None
    assert "underdetermined" in scarce_rows_message(4000, 8960, 4096, 0.125)
    # the default ridge keeps the re-solve from fitting the rows' noise: no warning then
    assert scarce_rows_message(14336, 8960, 16384, 0.125, ridge=1.0) is None


from types import SimpleNamespace  # noqa: E402


class _Installed:
    """A stand-in for the model: the choice installed last, as the gate's evaluation reads it."""

    def __init__(self):
        self.choice = {}
        self.installs = []

    def install(self, choice, target, desc):
        self.choice = {i: lv for i, lv in choice.items() if lv is not None}
        self.installs.append(desc)
        return {i: SimpleNamespace(params=lv.params, heldout_r2=0.9) for i, lv in self.choice.items()}

    def restore(self):
        self.choice = {}


def _drop_run(drop: int, bad: set[int]):
    """run_allocate over four blocks whose block 3 is the allocation's cheapest step, with a gate that
    fails every cut narrowing a block of ``bad`` (as Qwen2.5-Coder-1.5B's block 27 did)."""
    from compressor.fitting.kinds import Level
    from compressor.policy.allocate import BlockCurve
    from compressor.policy.gate import run_allocate
    from compressor.policy.result import BlockDecision
    from compressor.recipe.schema import PolicyConfig

    curves = [BlockCurve(i, 100, [Level(s, s, (1 - s / 100) * (0.1 if i == 3 else 1 + i)) for s in (25, 50, 75)])
              for i in range(4)]
    decisions = [BlockDecision(i, f"b{i}", 0.9, 0.9, 0.0, False, ffn_params=100) for i in range(4)]
    installed = _Installed()
    pol = PolicyConfig(drop_failing_blocks=drop, max_backoff=4)

    def evaluate(desc):
        return SimpleNamespace(ppl=1.0, kl=0.0, domains={}, choice=dict(installed.choice))

    def check(r):
        hit = sorted(bad & set(r.choice))
        return (not hit), (f"over budget (block {hit})" if hit else "within budget")

    final, fits, log = run_allocate(installed, curves, decisions, pol, evaluate("baseline"), evaluate, check, {})
    return fits, log, decisions, installed


def test_a_block_whose_smallest_step_fails_alone_is_left_out_and_the_search_runs_again():
    """Qwen2.5-Coder-1.5B, default recipe: every cut narrowed block 27 first, whose one step alone was
    +9.5 % on code; the run exited 3 with nothing written. The search now leaves that block out and
    searches the others, and says so."""
    fits, log, decisions, installed = _drop_run(drop=1, bad={3})
    assert fits and 3 not in fits
    first = [r for r in log if "left_out" not in r]
    again = [r for r in log if r.get("left_out") == [3]]
    assert first and not any(r["passed"] for r in first) and list(first[-1]["blocks"]) == ["3"]
    assert again and any(r["passed"] for r in again) and all("3" not in r["blocks"] for r in again)
    d3 = decisions[3]
    assert d3.decision == "not a candidate" and "policy.drop_failing_blocks" in d3.reason and f"{first[-1]['blocks']['3']} units" in d3.reason
    # the second search's descriptions name what it left out, so its records are never another's
    assert any("block 3 left out" in desc for desc in installed.installs)


def test_no_block_is_left_out_when_the_setting_is_zero_or_several_blocks_fail():
    fits, log, decisions, _ = _drop_run(drop=0, bad={3})
    assert not fits and not any("left_out" in r for r in log)
    assert decisions[3].decision == "rejected"
    # a block left out once, and the next search's one-block cut fails too: at most drop_failing_blocks
    fits, log, decisions, _ = _drop_run(drop=1, bad={0, 1, 2, 3})
    assert not fits and {tuple(r.get("left_out", [])) for r in log} == {(), (3,)}


def test_the_no_cut_message_names_the_blocks_already_left_out():
    from compressor.policy.compress import no_cut_message

    attempts = [{"ffn_params_kept": 999, "ffn_params_total": 1000, "ppl": 110.0, "passed": False,
                 "blocks": {"5": 64}, "left_out": [27]}]
    msg = no_cut_message(attempts, 100.0, 0.05, "relative", left_out=[27])
    assert "left out block 27" in msg and "policy.exclude: [5, 27]" in msg


def test_after_a_failing_smallest_cut_the_one_step_cut_is_measured_next():
    """Qwen2.5-Coder-1.5B: the smallest cut of the bisection failed, and the bisection went up step by
    step to the one-block cut (six evaluations, four minutes each) before it was clear that no cut could
    pass. The one-step cut is now measured second: failing, the search ends there; passing, the
    bisection runs between the two."""
    from compressor.policy.search import Attempt, TargetSearch

    def search(passes):
        measured = []

        def measure(t, variant):
            measured.append(round(t, 4))
            return Attempt(t, passes(t), "")

        s = TargetSearch(measure, key=lambda t: round(t, 2) if t < 0.995 else (), between=lambda f, p: (f + p) / 2,
                         floor=0.3, first_step=lambda failed: 0.99)
        return s.run(steps=5), measured

    best, measured = search(lambda t: False)  # even one step fails: two evaluations, nothing passes
    assert best is None and measured == [0.9781, 0.99]
    best, measured = search(lambda t: t >= 0.985)  # the one step passes: the bisection runs below it
    assert measured[:2] == [0.9781, 0.99] and best.target >= 0.985 and all(0.9781 < t < 0.99 for t in measured[2:])
    best, measured = search(lambda t: t >= 0.5)  # the smallest cut passes: as before, no extra evaluation
    assert 0.99 not in measured


def test_the_first_step_is_the_largest_kept_fraction_that_narrows_a_block():
    from compressor.fitting.kinds import Level
    from compressor.policy.allocate import Allocation, BlockCurve

    curves = [BlockCurve(i, 100, [Level(s, s, (1 - s / 100) * (1 + i)) for s in (25, 50, 75)]) for i in range(3)]
    a = Allocation(curves)
    top = a.first_step(0.3)
    assert len(a.key(top)) == 1 and a.key(top)[0][0] == 0 and not a.key(top + 1e-6)
