"""Allocate one global parameter target across blocks from their error curves.

Each block offers its original FFN (cost 0) and the rungs of its kind's
ladder (:class:`~compressor.fitting.kinds.Level`). A rung's cost is its held-out
relative error times the block's *sensitivity* weight; the allocation
minimises the summed cost subject to the total FFN parameters, by bisection
on the Lagrange multiplier (each block then picks the rung minimising
``cost + λ·params``, which handles non-convex curves through their lower
convex hull). ``uniform`` instead gives every block the same kept fraction:
the baseline that allocation must beat.

Sensitivity weights (computed by the caller, :mod:`compressor.policy.compress`):

* ``fisher``: ``Σ_o M_oo Var(y_o)`` with ``M`` the loss-gradient second moment
  at the block output (:mod:`compressor.engine.sensitivity`), so a rung's cost
  approximates the loss increase it causes;
* ``residual``: the block's output energy relative to the residual stream it
  is added to, ``SST/n ÷ E‖r‖²`` (no extra pass).
"""

from __future__ import annotations

from dataclasses import dataclass

from compressor.fitting.kinds import Level
from compressor.engine.resume import register_record


@dataclass
class BlockCurve:
    index: int
    ffn_params: int
    levels: list[Level]
    weight: float = 1.0
    """Cost per unit of held-out relative error (the block's sensitivity)."""


def _pick(c: BlockCurve, lam: float) -> Level | None:
    best, best_val = None, lam * c.ffn_params  # the original block: no error
    for lv in c.levels:
        val = c.weight * lv.heldout_rel_error + lam * lv.params
        if val < best_val - 1e-18:
            best, best_val = lv, val
    return best


def _total(curves: list[BlockCurve], choice: dict[int, Level | None]) -> int:
    return sum(c.ffn_params if choice[c.index] is None else choice[c.index].params for c in curves)


def allocate(curves: list[BlockCurve], budget_params: int, mode: str = "fisher") -> dict[int, Level | None]:
    """Per block: the chosen rung, or None to keep the original FFN.

    The total of the chosen parameters is ≤ ``budget_params`` when any
    choice reaches it (otherwise the smallest rung of every block)."""
    if mode == "uniform":
        return _uniform(curves, budget_params)
    if mode not in ("fisher", "residual"):
        raise ValueError(f"allocation must be 'fisher', 'residual' or 'uniform', got {mode!r}")
    floor = {c.index: min(c.levels, key=lambda lv: lv.params) if c.levels else None for c in curves}
    if _total(curves, floor) > budget_params:
        return floor
    lo, hi = 0.0, 1.0
    while _total(curves, {c.index: _pick(c, hi) for c in curves}) > budget_params:
        hi *= 4
        if hi > 1e30:
            return floor
    for _ in range(200):
        mid = (lo + hi) / 2
        if _total(curves, {c.index: _pick(c, mid) for c in curves}) > budget_params:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return {c.index: _pick(c, hi) for c in curves}


def uniform_widths(curves: list[BlockCurve]) -> list[int]:
    """Sizes every block offers that are cheaper than every original block, ascending: the widths one
    width for all blocks can take (``output.architecture: standard``)."""
    if not curves:
        return []
    common = set.intersection(*({lv.size for lv in c.levels if lv.params < c.ffn_params} for c in curves))
    return sorted(w for w in common if w > 0)


def widths_params(curves: list[BlockCurve], width: int) -> int:
    """Total parameters with every block at ``width`` (a size of :func:`uniform_widths`)."""
    return sum(next(lv.params for lv in c.levels if lv.size == width) for c in curves)


def _uniform(curves: list[BlockCurve], budget_params: int) -> dict[int, Level | None]:
    """Every block at the rung nearest the same kept fraction of its units."""
    def at(q: float) -> dict[int, Level | None]:
        out = {}
        for c in curves:
            top = max(lv.size for lv in c.levels) or 1
            out[c.index] = min(c.levels, key=lambda lv: (abs(lv.size / top - q), lv.params))
        return out

    lo, hi = 0.0, 1.0
    if _total(curves, at(hi)) <= budget_params:
        return at(hi)
    for _ in range(40):
        mid = (lo + hi) / 2
        if _total(curves, at(mid)) <= budget_params:
            lo = mid
        else:
            hi = mid
    return at(lo)


register_record(BlockCurve)
