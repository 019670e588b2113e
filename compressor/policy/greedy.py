"""The greedy gate: whole-block swaps tried one at a time, rolled back over budget.

High R²_lin alone is not trusted. Candidates are swapped in one at a time, in
the policy's order, and each is kept only if the whole model's perplexity on
the evaluation windows stays within budget; otherwise it is rolled back.
Every block's decision and its reason end up in the report.
"""

from __future__ import annotations

import logging
from typing import Callable

from torch import nn

from compressor.fitting.kinds import Fitted
from compressor.engine.profiling import BlockProfile
from compressor.recipe.schema import PolicyConfig
from compressor.fitting.replace import count_params, swap
from compressor.policy.confirm import Confirmation
from compressor.policy.select import candidates
from compressor.evaluation.gate import DomainEvaluations

logger = logging.getLogger(__name__)


def greedy_gate(
    model: nn.Module,
    fitted: dict[int, Fitted],
    profiles: list[BlockProfile],
    decisions: list,
    policy: PolicyConfig,
    baseline: DomainEvaluations,
    evaluate: Callable[[str], DomainEvaluations],
    check: Callable[[DomainEvaluations], tuple[bool, str]],
    *,
    sweep_all: bool = False,
    confirmation: Confirmation | None = None,
) -> tuple[DomainEvaluations, list[int]]:
    """Apply the greedy policy in place; returns (final evaluation, kept blocks).

    ``check(evaluation) -> (within budget on every domain, why)`` is the gate. ``confirmation``: the
    kept set is measured once on the held-out windows, and rolled back block by block (the last kept
    first) until it passes there (:func:`_confirm_kept`)."""
    modules = {i: d.module for i, d in enumerate(decisions)}

    def install(i: int):
        return swap(model, i, fitted[i].build(model.get_submodule(modules[i])))

    order, swap_evals = _prepare(profiles, policy, decisions, install, evaluate, baseline, sweep_all)
    params_before = count_params(model)
    params_now = params_before
    current = baseline
    accepted: list[int] = []
    undo: dict[int, tuple] = {}  # kept block → (its swap, the evaluation before it was kept)
    rejected_in_a_row = 0
    for k, i in enumerate(order):
        d = decisions[i]
        why = _stop_reason(policy, len(accepted), params_now, params_before, rejected_in_a_row)
        if why:
            d.reason = why
            continue
        if not policy.gate:
            undo[i] = (install(i), current)
            params_now = count_params(model)
            accepted.append(i)
            d.decision, d.reason = "kept", "R²_lin threshold rule (no per-block gate)"
            continue
        if i in swap_evals:
            alone_ok, alone_why = check(swap_evals[i])
            if not alone_ok:
                # Alone it already breaks the budget; on top of kept blocks it would too.
                d.decision = "rejected"
                d.reason = f"single swap alone exceeds the budget ({alone_why})"
                rejected_in_a_row += 1
                continue
        s = install(i)
        r = evaluate(f"gate: block {i} ({k + 1}/{len(order)})")
        d.ppl_when_tried = r.ppl
        ok, why = check(r)
        if ok:
            d.decision, d.delta_ppl, d.reason = "kept", r.ppl - current.ppl, why
            params_now = count_params(model)
            undo[i] = (s, current)
            current = r
            accepted.append(i)
            rejected_in_a_row = 0
            logger.info("block %d kept: %s", i, why)
        else:
            s.undo()
            d.decision = "rejected"
            d.reason = f"{why}: rolled back"
            rejected_in_a_row += 1
            logger.info("block %d rejected: %s", i, why)
    if not policy.gate:
        current = evaluate("final perplexity") if accepted else baseline
    return _confirm_kept(confirmation, current, accepted, undo, decisions, policy), accepted


def _prepare(profiles: list[BlockProfile], policy: PolicyConfig, decisions: list, install: Callable,
             evaluate: Callable[[str], DomainEvaluations], baseline: DomainEvaluations,
             sweep_all: bool) -> tuple[list[int], dict[int, DomainEvaluations]]:
    """(the candidates in the order tried, each swept block's evaluation alone)."""
    swap_evals: dict[int, DomainEvaluations] = {}
    swap_delta: dict[int, float] | None = None
    if sweep_all or policy.order == "swap_ppl":
        by_index = policy.model_copy(update={"order": "index"})
        sweep = range(len(profiles)) if sweep_all else candidates(profiles, by_index)[0]
        swap_evals = _single_swaps(sweep, install, evaluate, decisions, baseline)
        swap_delta = {i: r.ppl - baseline.ppl for i, r in swap_evals.items()}
    return _order(profiles, policy, decisions, swap_delta), swap_evals


def _confirm_kept(confirmation: Confirmation | None, current: DomainEvaluations, accepted: list[int],
                  undo: dict[int, tuple], decisions: list, policy: PolicyConfig) -> DomainEvaluations:
    """The kept set measured on the held-out confirmation windows; while it fails there (gate on), the
    last kept block is rolled back (the set before it is the one the search measured then) and the
    rest confirmed again. Edits ``accepted`` in place; returns the search windows' evaluation."""
    if confirmation is None or not confirmation.enabled or not accepted:
        return current
    while accepted:
        ok, _ = confirmation(f"{len(accepted)} block(s) kept ({', '.join(map(str, accepted))})")
        if ok or not policy.gate:
            return current
        i = accepted.pop()
        s, current = undo.pop(i)
        s.undo()
        d = decisions[i]
        d.decision, d.delta_ppl = "rejected", None
        d.reason = f"kept on the search windows, rolled back: the kept set failed confirmation ({confirmation.why})"
        confirmation.stepped_back(f"the kept set failed confirmation; block {i} (the last kept) rolled back"
                                  + ("" if accepted else ": nothing is left"))
    confirmation.reset()
    return current


def _stop_reason(policy: PolicyConfig, kept: int, params_now: int, params_before: int,
                 rejected_in_a_row: int) -> str | None:
    """Why the greedy policy tries no more blocks, or None."""
    if policy.max_blocks is not None and kept >= policy.max_blocks:
        return f"policy.max_blocks={policy.max_blocks} reached"
    if policy.target_ratio is not None and params_now <= policy.target_ratio * params_before:
        return f"policy.target_ratio={policy.target_ratio} reached"
    if policy.patience is not None and rejected_in_a_row >= policy.patience:
        return f"policy.patience={policy.patience}: stopped after {rejected_in_a_row} rejections in a row"
    return None


def _single_swaps(sweep, install: Callable, evaluate: Callable[[str], DomainEvaluations], decisions: list,
                  baseline: DomainEvaluations) -> dict[int, DomainEvaluations]:
    """Each block of ``sweep`` replaced alone, evaluated, and put back (the single-swap sweep)."""
    evals: dict[int, DomainEvaluations] = {}
    for k, i in enumerate(sweep):
        s = install(i)
        try:
            r = evaluate(f"single-swap sweep ({k + 1}/{len(sweep)})")
        finally:
            s.undo()
        decisions[i].swap_ppl = r.ppl
        evals[i] = r
        logger.info("block %d alone: perplexity %.4f (Δ %+.4f)", i, r.ppl, r.ppl - baseline.ppl)
    return evals


def _order(profiles: list[BlockProfile], policy: PolicyConfig, decisions: list,
           swap_delta: dict[int, float] | None) -> list[int]:
    """The candidates in the order they are tried; every other block's decision says why it is not one."""
    order, reasons = candidates(profiles, policy, swap_delta)
    for i, why in reasons.items():
        decisions[i].reason = why
    for i in order:
        decisions[i].decision = "not tried"
    logger.info("%d candidate block(s) in order %s", len(order), order)
    return order
