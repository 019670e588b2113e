"""Options and their allocation: the one shape every policy decision takes.

Every unit the policy decides about (a tensor's GGML type, a block's FFN width,
a whole-block affine or low-rank swap) offers a list of :class:`Option`\\ s, each
with a size (bytes, or parameters) and a predicted cost (loss increase, or any
additive proxy of it). :func:`allocate` picks one option per unit minimising the
summed cost subject to a total size: Lagrangian relaxation (each unit picks the
option minimising ``cost + λ·size``, bisection on λ, which finds the lower
convex hull of every unit's curve), then a greedy fill of what the multiplier
left unspent. The same call serves the FFN-width allocation (size = parameters)
and the size planner (size = bytes).

>>> a = [Option("a", "big", 10, 0.0), Option("a", "small", 4, 1.0)]
>>> b = [Option("b", "big", 10, 0.0), Option("b", "small", 5, 3.0)]
>>> sorted(o.name for o in allocate({"a": a, "b": b}, 15).values())
['big', 'small']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class Option:
    """One way to realise one unit."""

    unit: str
    """The unit it belongs to (``blk.3.ffn_down.weight``, ``block 3``)."""
    name: str
    """What it is (``Q4_K``, ``width 1024``, ``affine``)."""
    size: float
    """What it occupies: bytes (size planner) or parameters (FFN allocation)."""
    cost: float
    """Predicted cost, additive over units (predicted loss increase in nats per token, or a proxy)."""
    payload: Any = field(default=None, compare=False, repr=False)
    """What applying it needs (a GGML type, a fitted level, …)."""


def pick(options: list[Option], lam: float) -> Option:
    """The option minimising ``cost + lam·size`` (ties: the smaller size, then the earlier)."""
    return min(options, key=lambda o: (o.cost + lam * o.size, o.size))


def total_size(choice: Mapping[str, Option]) -> float:
    return sum(o.size for o in choice.values())


def total_cost(choice: Mapping[str, Option]) -> float:
    return sum(o.cost for o in choice.values())


def smallest(units: Mapping[str, list[Option]]) -> dict[str, Option]:
    """Every unit at its smallest option (the floor of any budget)."""
    return {u: min(opts, key=lambda o: (o.size, o.cost)) for u, opts in units.items()}


def at_multiplier(units: Mapping[str, list[Option]], lam: float) -> dict[str, Option]:
    """Every unit's best option at multiplier ``lam``."""
    return {u: pick(opts, lam) for u, opts in units.items()}


#: Units whose options the allocation also tries fixing, one at a time (the largest ones): see :func:`allocate`.
LUMPY_UNITS = 3


def allocate(units: Mapping[str, list[Option]], budget: float, *, fill: bool = True,
             lumpy: int = LUMPY_UNITS) -> dict[str, Option]:
    """One option per unit, total size ≤ ``budget``, summed cost minimised over the lower convex hull.

    Returns every unit's smallest option when even those exceed ``budget`` (the caller says so).
    ``fill``: spend what the multiplier leaves below the budget on the upgrades with the best cost
    saved per extra size (the hull's corners are sparse when units are few). ``lumpy``: a multiplier
    cannot take a step of one very large unit that overshoots the budget (Gemma-3-270M's embedding is
    two thirds of the file), though taking it and stepping smaller units down can be cheaper; so each
    larger option of the ``lumpy`` largest units is also tried fixed, the rest allocated around it, and
    the cheapest result kept."""
    best = _allocate(units, budget, fill)
    if not fill or lumpy <= 0:
        return best
    largest = sorted(units, key=lambda u: -max(o.size for o in units[u]))[:lumpy]
    for u in largest:
        rest = {k: v for k, v in units.items() if k != u}
        for o in units[u]:
            if o.size <= best[u].size or o.size > budget or not rest:
                continue
            choice = _allocate(rest, budget - o.size, fill)
            choice[u] = o
            if total_size(choice) <= budget and total_cost(choice) < total_cost(best) - 1e-15:
                best = choice
    return {u: best[u] for u in units}


def _allocate(units: Mapping[str, list[Option]], budget: float, fill: bool) -> dict[str, Option]:
    empty = [u for u, opts in units.items() if not opts]
    if empty:
        raise ValueError(f"units without options: {empty[:5]}")
    floor = smallest(units)
    if total_size(floor) > budget:
        return floor
    lo, hi = 0.0, 1.0
    while total_size(at_multiplier(units, hi)) > budget:
        lo, hi = hi, hi * 4
        if hi > 1e30:
            return floor
    if total_size(at_multiplier(units, 0.0)) <= budget:
        hi = 0.0
    else:
        for _ in range(200):
            mid = (lo + hi) / 2
            if total_size(at_multiplier(units, mid)) > budget:
                lo = mid
            else:
                hi = mid
            if hi - lo <= 1e-12 * hi:
                break
    choice = at_multiplier(units, hi)
    return fill_budget(units, choice, budget) if fill else choice


def fill_budget(units: Mapping[str, list[Option]], choice: dict[str, Option], budget: float) -> dict[str, Option]:
    """Greedily upgrade units (the largest cost saved per extra size first) while the total stays ≤ ``budget``."""
    choice = dict(choice)
    left = budget - total_size(choice)
    while True:
        best, best_rate = None, 0.0
        for u, opts in units.items():
            cur = choice[u]
            for o in opts:
                extra, saved = o.size - cur.size, cur.cost - o.cost
                if saved <= 0 or extra > left:
                    continue
                rate = saved / extra if extra > 0 else float("inf")
                if rate > best_rate:
                    best, best_rate = o, rate
        if best is None:
            return choice
        left -= best.size - choice[best.unit].size
        choice[best.unit] = best
