"""Select: which blocks are candidates, of the greedy policy (and in which order) or of the allocation.

Functions of the profile and the recipe's policy; the gates that decide which candidates survive
live in :mod:`compressor.policy.greedy` and :mod:`compressor.policy.gate`.
"""

from __future__ import annotations

import logging

from compressor.engine.profiling import BlockProfile
from compressor.recipe.schema import PolicyConfig

logger = logging.getLogger(__name__)


def candidates(
    profiles: list[BlockProfile], policy: PolicyConfig, swap_delta: dict[int, float] | None = None
) -> tuple[list[int], dict[int, str]]:
    """Return (ordered candidate indices, reason for every non-candidate)."""
    n = len(profiles)
    bad = [i for i in policy.include + policy.exclude if i >= n]
    if bad:
        raise ValueError(f"policy.include/exclude: blocks {bad} do not exist; the model has {n} blocks (0..{n - 1})")
    reasons: dict[int, str] = {}
    chosen: list[BlockProfile] = []
    for p in profiles:
        if p.index in policy.exclude:
            reasons[p.index] = "excluded by policy.exclude"
        elif p.index in policy.include:
            chosen.append(p)
        elif not p.r2_lin >= policy.threshold:  # also rejects NaN
            reasons[p.index] = f"R²_lin {p.r2_lin:.4f} < threshold {policy.threshold}"
        elif policy.skip_outlier_dominated and p.outlier_dominated:
            reasons[p.index] = (
                f"outlier-dominated: {p.outlier_sst_share:.0%} of held-out variance in {p.outlier_rows} rows "
                f"(bulk R² {p.r2_bulk:.2f}); set policy.skip_outlier_dominated: false to try it anyway"
            )
        else:
            chosen.append(p)
    if policy.order == "r2":
        chosen.sort(key=lambda p: (-p.r2_lin, p.index))
    elif policy.order == "swap_ppl":
        if swap_delta is None:
            raise ValueError("policy.order: swap_ppl needs the single-swap sweep")
        chosen.sort(key=lambda p: (swap_delta.get(p.index, float("inf")), p.index))
    else:
        chosen.sort(key=lambda p: p.index)
    return [p.index for p in chosen], reasons


def allocation_excluded(decisions: list, policy: PolicyConfig, *, standard: bool = False) -> set[int]:
    """The blocks the allocate strategy leaves as they are (``policy.exclude``, and outlier-dominated
    blocks unless ``standard``: one width for every block), each decision marked with why."""
    excluded = set(policy.exclude)
    flagged = [d.index for d in decisions if d.outlier_dominated]
    if policy.skip_outlier_dominated and not standard:
        excluded |= set(flagged)
    elif policy.skip_outlier_dominated and flagged:
        logger.info("blocks %s are outlier-dominated; output.architecture: standard prunes them to the one width "
                    "too (policy.skip_outlier_dominated does not apply)", flagged)
    for d in decisions:
        if d.index in excluded:
            d.decision = "not a candidate"
            d.reason = "excluded by policy.exclude" if d.index in policy.exclude else (
                "outlier-dominated; set policy.skip_outlier_dominated: false to allow it")
    return excluded
