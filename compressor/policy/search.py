"""The gate's search: the largest cut the gate lets through, by bisection over one target.

A *target* is one number, larger meaning less compression, whose top (``ceiling``: the original
model) passes trivially: the FFN allocation's kept fraction, or a size planner's budget. The search
knows nothing of what a target means; the caller gives

* ``measure(target, variant) -> Attempt``: realise the target, evaluate it, say whether the gate holds
  (``variant``: another way to realise the same choice, e.g. the teacher-target re-fit);
* ``key(target)``: what the target chooses. Targets a step apart can choose the same, and then share one
  measurement (the first target it was measured at); an empty key chooses nothing, and is not tried;
* ``between(failed, passed)``: the next target between a failing and a passing one, or None.

Every attempt is measured once and kept in the order measured (:attr:`TargetSearch.attempts`): one
cache, which a later step goes on from: a re-fit at the found target (another variant), or a
confirmation on other windows that rejects the choice (:meth:`TargetSearch.step_back`, then
:meth:`TargetSearch.bisect`).

>>> s = TargetSearch(lambda t, v: Attempt(t, t >= 0.6, ""), key=lambda t: round(t, 3),
...                  between=lambda f, p: (f + p) / 2, floor=0.0)
>>> round(s.run(steps=6).target, 3), len(s.attempts)
(0.609, 7)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

logger = logging.getLogger(__name__)


@dataclass
class Attempt:
    """One target realised and gated."""

    target: float
    """The target it was measured at."""
    passed: bool
    why: str
    """The gate's words."""
    outcome: Any = field(default=None, repr=False)
    """What the caller needs to take it (its evaluation, choice, fits)."""
    record: dict = field(default_factory=dict, repr=False)
    """The attempt as the report lists it."""


def smallest_cut(failed: float, steps: int, next_keep: Callable[[float], float | None]) -> float | None:
    """The kept fraction a bisection of ``steps`` steps reaches when every step fails, starting from the
    failing ``failed`` (the floor) with the original model passing; None when it takes no step."""
    last = None
    for _ in range(steps):
        mid = next_keep(failed)
        if mid is None:
            break
        failed = last = mid
    return last


class TargetSearch:
    """Bisection between the largest known failing target and the smallest known passing one."""

    def __init__(self, measure: Callable[[float, str], Attempt], key: Callable[[float], Hashable],
                 between: Callable[[float, float], float | None], *, floor: float, ceiling: float = 1.0,
                 describe: Callable[[float], str] = "{:g}".format,
                 first_step: Callable[[float], float | None] | None = None) -> None:
        self.measure, self.key, self.between, self.describe = measure, key, between, describe
        self.first_step = first_step
        """``first_step(failed)``: the largest target above ``failed`` that chooses anything (the smallest
        cut there is), or None; tried right after a failing smallest cut of the bisection."""
        self.failed, self.passed, self.ceiling = floor, ceiling, ceiling
        self.best: Attempt | None = None
        self._tried: dict[tuple, Attempt] = {}
        self._rejected: set = set()
        """Keys of choices that passed here but failed elsewhere (:meth:`step_back`)."""

    @property
    def attempts(self) -> list[Attempt]:
        """Every attempt measured, in order."""
        return list(self._tried.values())

    def measured(self, target: float, variant: str = "none") -> Attempt:
        """The attempt of what ``target`` chooses, measured now or taken from an earlier target."""
        k = (variant, self.key(target))
        if k not in self._tried:
            self._tried[k] = self.measure(target, variant)
        return self._tried[k]

    def run(self, steps: int, *, start: float | None = None, gate: bool = True) -> Attempt | None:
        """The passing attempt with the smallest target found in ``steps`` bisection steps, or None.

        ``start``: a target tried first (taken when it passes, or ``gate`` is off; the bisection runs
        below it when it fails). Without ``gate`` only ``start`` is taken. The smallest target the
        bisection can reach is measured before it: when it passes, the bisection runs as it would have
        and reuses it, so it ends on the same target; when it fails, no smaller target can pass, and
        the bisection runs above it instead (between it and the ceiling), down to one step at most."""
        if start is not None:
            first = self.measured(start)
            if first.passed or not gate:
                self.best = first
                if first.passed:
                    self.passed = start
                return first
            self.failed = start
        if not gate:
            return None
        floor = smallest_cut(self.failed, steps, lambda f: self.between(f, self.ceiling))
        if floor is not None and steps > 1:
            at_floor = self.measured(floor)
            if not at_floor.passed:
                logger.warning("the smallest cut of the bisection (%s) is over the gate's budget (%s); searching "
                               "smaller cuts (at most %d attempts)", self.describe(floor), at_floor.why, steps)
                self.failed = floor
                self._try_first_step()
        return self.bisect(steps)

    def _try_first_step(self) -> None:
        """The smallest cut there is, measured before the bisection goes up to it step by step: when it
        fails, no cut passes (the bisection then ends at once); when it passes, the bisection runs
        between it and the failing cut below."""
        top = self.first_step(self.failed) if self.first_step is not None else None
        if top is None or not self.key(top) or not self.failed < top < self.passed:
            return
        a = self.measured(top)
        if a.passed and self.key(top) not in self._rejected:
            self.best, self.passed = a, top
        else:
            self.failed = top

    def bisect(self, steps: int) -> Attempt | None:
        """Up to ``steps`` more steps from where the search stands; the best passing attempt so far."""
        for _ in range(steps):
            mid = self.between(self.failed, self.passed)
            if mid is None or not self.key(mid):  # nothing left between, or a target that chooses nothing
                break
            a = self.measured(mid)
            if a.passed and self.key(mid) not in self._rejected:  # a target choosing a rejected choice fails
                self.best, self.passed = a, mid
            else:
                self.failed = mid
        return self.best

    def step_back(self) -> Attempt | None:
        """The best attempt failed elsewhere (a confirmation on other windows): its target counts as
        failing, and the best is the passing attempt next above it (None: only the ceiling passes).
        :meth:`bisect` then searches between them; a target there that chooses what failed fails too."""
        self.failed = self.passed
        self._rejected.add(self.key(self.failed))
        above = [a for (variant, k), a in self._tried.items()
                 if variant == "none" and a.passed and a.target > self.failed and k not in self._rejected]
        self.best = min(above, key=lambda a: a.target, default=None)
        self.passed = self.best.target if self.best else self.ceiling
        return self.best
