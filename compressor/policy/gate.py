"""The allocate strategy's gate: the largest FFN cut the gate lets through.

Each attempt allocates a kept fraction (:class:`~compressor.policy.allocate.Allocation`), installs it
(:class:`~compressor.policy.apply.Installer`: re-solves from the kept statistics) and evaluates it;
:class:`~compressor.policy.search.TargetSearch` bisects the kept fraction, one attempt per
allocation. At the fraction found, the teacher-target fit (one more calibration pass) is tried and
kept if it passes; then the chosen fits are installed and every block's decision recorded.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from compressor.evaluation.gate import DomainEvaluations
from compressor.fitting.kinds import Fitted
from compressor.policy.allocate import Allocation
from compressor.policy.apply import Choice, Installer, record_choice, reject_all
from compressor.policy.confirm import Confirmation
from compressor.policy.result import BlockDecision
from compressor.policy.search import Attempt, TargetSearch
from compressor.policy.select import allocation_excluded
from compressor.recipe.schema import PolicyConfig

logger = logging.getLogger(__name__)

# Without policy.ffn_keep the bisection searches kept fractions above this.
MIN_FFN_KEEP = 0.3


class AllocationAttempts:
    """The search's ``measure``: install the allocation at a kept fraction, fitted to a target
    (``"none"``: independent fits re-solved from the kept statistics), evaluate it, gate it. An
    attempt's record is a row of the report's ``allocation_attempts``; :attr:`log` holds them in the
    order measured, with the confirmations (``"confirmation": true``) among them."""

    def __init__(self, allocation: Allocation, installer: Installer, evaluate: Callable[[str], DomainEvaluations],
                 check: Callable[[DomainEvaluations], tuple[bool, str]], timings: dict[str, float],
                 log: list[dict] | None = None) -> None:
        self.allocation, self.installer, self.evaluate, self.check, self.timings = (
            allocation, installer, evaluate, check, timings)
        self.log: list[dict] = [] if log is None else log
        self.first = len(self.log)
        """Where this search's rows begin in :attr:`log` (one log across the searches of a run)."""
        self.installed: tuple[float, str] | None = None
        """(kept fraction, target) of what the model holds now."""

    def install(self, keep: float, target: str) -> tuple[Choice, dict[int, Fitted]]:
        a = self.allocation
        choice = a.choose(keep)
        desc = f"fit ({target}) at ffn_keep {keep!r}" + (
            f", {a.describe(keep)}" if a.standard or a.multiple > 1 or a.left_out else "")
        fits = self.installer.install(choice, target, desc)
        self.installed = (keep, target)
        return choice, fits

    def __call__(self, keep: float, target: str = "none") -> Attempt:
        a, t = self.allocation, time.perf_counter()
        choice, fits = self.install(keep, target)
        key = "refit_s" if target == "none" else "teacher_pass_s"  # re-solves, or one more calibration pass
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t
        r = self.evaluate(f"gate: {a.describe(keep)}")
        ok, why = self.check(r)
        row = self._row(keep, target, choice, r, ok, why, confirmation=False)
        logger.info("keep %.1f%% of FFN parameters (%d blocks replaced%s): %s", 100 * row["ffn_params_kept"] / a.total,
                    row["blocks_replaced"], f", width {row['width']}" if a.standard else "", why)
        return Attempt(keep, ok, why, outcome=(r, choice, fits), record=row)

    def confirm(self, best: Attempt, confirmation: Confirmation) -> bool:
        """``best`` installed and measured on the confirmation windows (a row of :attr:`log`)."""
        target = best.record["target"]
        if self.installed != (best.target, target):  # deterministic: the same fits as when it was measured
            self.install(best.target, target)
        ok, why = confirmation(self.allocation.describe(best.target))
        self._row(best.target, target, best.outcome[1], confirmation.final, ok, why, confirmation=True)
        return ok

    def failing_alone(self) -> dict | None:
        """The row of this search's one-block cut, when that cut failed and no cut of the search passed:
        every cut the allocation makes narrows that block, so none can pass while it is in. None
        otherwise (a cut passed, or every failing cut narrowed several blocks)."""
        rows = [r for r in self.log[self.first:] if not r["confirmation"]]
        if any(r["passed"] for r in rows):
            return None
        alone = [r for r in rows if len(r["blocks"]) == 1]
        return alone[-1] if alone else None

    def _row(self, keep: float, target: str, choice: Choice, r: DomainEvaluations, ok: bool, why: str, *,
             confirmation: bool) -> dict:
        a = self.allocation
        row = {"width": next(iter(choice.values())).size} if a.standard else {}
        row.update({"ffn_keep_target": keep, "target": target, "ffn_params_kept": a.kept_params(choice),
                    "ffn_params_total": a.total, "blocks_replaced": sum(lv is not None for lv in choice.values()),
                    "blocks": {str(i): lv.size for i, lv in sorted(choice.items()) if lv is not None},
                    "ppl": r.ppl, "passed": ok, "gate": why, "confirmation": confirmation,
                    "domains": {n: {"ppl": ev.ppl, "kl": ev.kl} for n, ev in r.domains.items()}})
        if a.left_out:
            row["left_out"] = list(a.left_out)
        self.log.append(row)
        return row


def _settle(search: TargetSearch, best: Attempt | None, pol: PolicyConfig, target: str) -> Attempt | None:
    """At the kept fraction found, the teacher-target fit when it passes (else the independent fits)."""
    if best is None or target == "none":  # whole-block kinds (affine) have no teacher target
        return best
    # The search ran on independent fits (each step a re-solve, no calibration pass); the
    # teacher-target fit, one more pass over the calibration data, is tried at the level found.
    refit = search.measured(best.target, target)
    if refit.passed or not pol.gate:
        return refit
    logger.warning("target %s at ffn_keep %.3f failed the gate (%s); keeping the independent fits",
                   target, best.target, refit.why)
    return best


def confirmed_choice(attempts: AllocationAttempts, search: TargetSearch, pol: PolicyConfig, target: str,
                     confirmation: Confirmation | None) -> Attempt | None:
    """The search's choice, confirmed on the held-out windows: while it fails there (gate on), its cut
    counts as failing, the search steps back to the passing cut above it and bisects between
    (:meth:`TargetSearch.step_back`), at most ``max(1, policy.max_backoff)`` confirmations. None: no
    choice passed (or none confirmed)."""
    best = _settle(search, search.run(pol.max_backoff, start=pol.ffn_keep, gate=pol.gate), pol, target)
    if confirmation is None or not confirmation.enabled:
        return best
    budget = max(1, pol.max_backoff)
    while best is not None:
        if attempts.confirm(best, confirmation) or not pol.gate:
            return best
        failed = attempts.allocation.describe(best.target)
        if confirmation.count >= budget:
            confirmation.stepped_back(f"{failed} failed confirmation and the {budget} confirmation(s) of "
                                      "policy.max_backoff are spent: nothing is kept")
            break
        search.step_back()
        best = _settle(search, search.bisect(pol.max_backoff), pol, target)
        confirmation.stepped_back(f"{failed} passed on the search windows but failed confirmation; stepped back to "
                                  + (attempts.allocation.describe(best.target) if best else "the original model"))
    confirmation.reset()
    return None


def allocate_gate(attempts: AllocationAttempts, search: TargetSearch, decisions: list[BlockDecision],
                  excluded: set[int], pol: PolicyConfig, baseline: DomainEvaluations,
                  target: str = "none", confirmation: Confirmation | None = None,
                  ) -> tuple[DomainEvaluations, dict[int, Fitted]]:
    """Search, re-fit to ``target`` at the kept fraction found, confirm, install the choice and record
    it; returns (final evaluation on the search windows, the installed fits by block)."""
    best = confirmed_choice(attempts, search, pol, target, confirmation)
    if best is None:
        attempts.installer.restore()
        reject_all(decisions, excluded)
        return baseline, {}
    r, choice, fits = best.outcome
    fitted_to = best.record["target"]
    if attempts.installed != (best.target, fitted_to):  # deterministic: the same fits as when it was measured
        choice, fits = attempts.install(best.target, fitted_to)
    record_choice(decisions, excluded, attempts.allocation.curves, choice, fits, best.target, fitted_to, best.why,
                  standard=attempts.allocation.standard)
    return r, fits


def run_allocate(installer: Installer, curves, decisions: list[BlockDecision], pol: PolicyConfig,
                 baseline: DomainEvaluations, evaluate, check, timings: dict[str, float], *, target: str = "none",
                 standard: bool = False, multiple: int = 1, confirmation: Confirmation | None = None,
                 ) -> tuple[DomainEvaluations, dict[int, Fitted], list[dict]]:
    """The allocate strategy on pass A's ``curves``: (final evaluation on the search windows, installed
    fits, attempts as report rows, confirmations among them).

    When no cut passes and the search's one-block cut failed, that block is left out and the search
    runs again over the others (``policy.drop_failing_blocks`` times at most; never under
    ``standard``, whose one width is every block's): its smallest step alone is over the budget, so
    every cut of the allocation, which narrows it first, fails with it. Its decision says so, and
    every row of a later search lists the blocks left out (``left_out``)."""
    excluded = allocation_excluded(decisions, pol, standard=standard)
    log: list[dict] = []
    left_out: list[int] = []
    while True:
        allocation = Allocation([c for c in curves if c.index not in excluded], pol.allocation, standard=standard,
                                multiple=multiple, left_out=tuple(left_out))
        attempts = AllocationAttempts(allocation, installer, evaluate, check, timings, log=log)
        search = TargetSearch(attempts, allocation.key, allocation.between, floor=MIN_FFN_KEEP,
                              describe=allocation.describe, first_step=allocation.first_step)
        final, fits = allocate_gate(attempts, search, decisions, excluded, pol, baseline, target, confirmation)
        row = None if fits or standard or not pol.gate else attempts.failing_alone()
        if row is None or len(left_out) >= pol.drop_failing_blocks or len(allocation.curves) < 2:
            return final, fits, log
        (culprit, width), = ((int(i), w) for i, w in row["blocks"].items())
        left_out.append(culprit)
        excluded.add(culprit)
        why = f"its smallest step alone (to {width:,} units) failed the gate: {row['gate']}"
        d = next(d for d in decisions if d.index == culprit)
        d.decision, d.reason = "not a candidate", f"left out by the search (policy.drop_failing_blocks): {why}"
        logger.warning("no cut passed the gate, and block %d's smallest step alone failed it (%s): searching again "
                       "without block %d (%d of policy.drop_failing_blocks: %d)", culprit, row["gate"], culprit,
                       len(left_out), pol.drop_failing_blocks)
