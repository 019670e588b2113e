"""Allocate: one global parameter target split across blocks, from their error curves.

Each block offers its options (:mod:`compressor.policy.options`): its original FFN (cost 0) and
the rungs of its kind's ladder (:class:`~compressor.fitting.kinds.Level`), sized in parameters. A
rung's cost is its held-out relative error times the block's *sensitivity* weight; the allocation
minimises the summed cost subject to the total FFN parameters (:func:`compressor.policy.options.allocate`:
bisection on the Lagrange multiplier, which handles non-convex curves through their lower convex
hull; no greedy fill, see :func:`allocate`). ``uniform`` instead gives every block the same kept
fraction: the baseline that allocation must beat. :class:`Allocation` is the choice at a kept
fraction as the gate's search sees it, per block or (``output.architecture: standard``) one width
for every block.

Sensitivity weights (computed by :func:`compressor.policy.plan.block_weight`):

* ``fisher``: ``Σ_o M_oo Var(y_o)`` with ``M`` the loss-gradient second moment
  at the block output (:mod:`compressor.engine.sensitivity`), so a rung's cost
  approximates the loss increase it causes;
* ``residual``: the block's output energy relative to the residual stream it
  is added to, ``SST/n ÷ E‖r‖²`` (no extra pass).
"""

from __future__ import annotations

from dataclasses import dataclass

from compressor.core.errors import InputError
from compressor.fitting.kinds import Level
from compressor.engine.records import register_record
from compressor.policy import options
from compressor.policy.options import Option
from compressor.policy.result import blocks_phrase


@dataclass
class BlockCurve:
    index: int
    ffn_params: int
    levels: list[Level]
    weight: float = 1.0
    """Cost per unit of held-out relative error (the block's sensitivity)."""


def block_options(c: BlockCurve) -> list[Option]:
    """The block's original FFN (cost 0, payload None) and its rungs (payload: the :class:`Level`)."""
    unit = f"block {c.index}"
    return [Option(unit, "original", c.ffn_params, 0.0)] + [
        Option(unit, f"{lv.size} units", lv.params, c.weight * lv.heldout_rel_error, lv) for lv in c.levels]


def _total(curves: list[BlockCurve], choice: dict[int, Level | None]) -> int:
    return sum(c.ffn_params if choice[c.index] is None else choice[c.index].params for c in curves)


def allocate(curves: list[BlockCurve], budget_params: int, mode: str = "fisher") -> dict[int, Level | None]:
    """Per block: the chosen rung, or None to keep the original FFN.

    The total of the chosen parameters is ≤ ``budget_params`` when any choice reaches it (otherwise
    the smallest rung of every block). The multiplier's choice is taken as it is (``fill=False``):
    the gate's search sets the target, and a greedy fill would move every target's allocation."""
    if mode == "uniform":
        return _uniform(curves, budget_params)
    if mode not in ("fisher", "residual"):
        raise ValueError(f"allocation must be 'fisher', 'residual' or 'uniform', got {mode!r}")
    units = {f"block {c.index}": block_options(c) for c in curves}
    choice = options.allocate(units, budget_params, fill=False)
    return {c.index: choice[f"block {c.index}"].payload for c in curves}


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


class Allocation:
    """The choice at a kept fraction of the FFN parameters of ``curves`` (the blocks that may change):
    per block by :func:`allocate`, or with ``standard`` one width for every block, the largest on the
    grid (:func:`uniform_widths`) within the target. What the gate's search
    (:class:`compressor.policy.search.TargetSearch`) searches over. ``left_out``: blocks a search before
    this one left out (``policy.drop_failing_blocks``), named in every description so that its
    measurements (and a resume's records) are never taken for another allocation's."""

    def __init__(self, curves: list[BlockCurve], mode: str = "fisher", *, standard: bool = False,
                 multiple: int = 1, left_out: tuple[int, ...] = ()) -> None:
        self.curves, self.mode, self.standard, self.multiple = curves, mode, standard, multiple
        self.left_out = tuple(left_out)
        self.total = sum(c.ffn_params for c in curves)
        self.grid = uniform_widths(curves) if standard else []
        if standard and not self.grid:
            raise InputError(f"output.architecture: standard: no FFN width in multiples of {multiple} is both "
                             "offered by every block and smaller than the original FFN; this model's FFN is too "
                             "narrow for that grid (set output.width_multiple, or use output.architecture: custom)")

    def choose(self, keep: float) -> dict[int, Level | None]:
        if not self.standard:
            return allocate(self.curves, int(keep * self.total), self.mode)
        fitting = [w for w in self.grid if widths_params(self.curves, w) <= keep * self.total] or self.grid[:1]
        return {c.index: next(lv for lv in c.levels if lv.size == fitting[-1]) for c in self.curves}

    def key(self, keep: float) -> tuple:
        """(block, units) of every block ``keep`` narrows: empty when it narrows none."""
        return tuple(sorted((i, lv.size) for i, lv in self.choose(keep).items() if lv is not None))

    def between(self, failed: float, passed: float) -> float | None:
        """The next target of the bisection: halfway, or for one width, the middle grid width between."""
        if not self.standard:
            return (failed + passed) / 2
        inside = [k for k in (widths_params(self.curves, w) / self.total for w in self.grid) if failed < k < passed]
        return inside[len(inside) // 2] if inside else None

    def first_step(self, failed: float) -> float | None:
        """The largest kept fraction above ``failed`` that narrows anything: the allocation's first step
        (under ``standard``, the widest width on the grid), found on the choices alone, no evaluation.
        None when nothing above ``failed`` narrows a block."""
        lo, hi = failed, 1.0
        if not self.key(lo):
            return None
        for _ in range(40):  # key(lo) narrows something, key(hi) nothing (or hi is the original)
            mid = (lo + hi) / 2
            if self.key(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def describe(self, keep: float) -> str:
        if self.standard:
            return f"FFN width {next(iter(self.choose(keep).values())).size} in every block"
        left = f", {blocks_phrase(self.left_out)} left out" if self.left_out else ""
        return f"keep {keep:.1%} of FFN parameters" + (
            f" (widths in multiples of {self.multiple})" if self.multiple > 1 else "") + left

    def kept_params(self, choice: dict[int, Level | None]) -> int:
        return _total(self.curves, choice)


register_record(BlockCurve)
