"""Allocate: the plan at a byte budget, with every option's bytes padded as the file stores them.

Every option's size is its tensor's data padded to the GGUF alignment, and what is not planned is
fixed by the budget's layout (:class:`~compressor.sizing.budget.Layout`), so a plan's file
bytes are exact before it is written: :meth:`Planner.file_bytes`.
"""

from __future__ import annotations

import dataclasses
import math

from compressor.sizing.budget import Budget, padded
from compressor.policy.options import Option, smallest, total_size
from compressor.sizing.plan import Priced, SizePlan, plan, smallest_within


class Planner:
    """Plans of one model's priced tensors under one :class:`Budget`; each tensor budget planned once."""

    def __init__(self, units: dict[str, list[Option]], priced: list[Priced], budget: Budget) -> None:
        align = budget.layout.alignment
        self.units = {u: [dataclasses.replace(o, size=padded(o.size, align)) for o in opts]
                      for u, opts in units.items()}
        self.priced, self.budget = priced, budget
        unplanned = sum(padded(b, align) for n, b in budget.layout.planned.items() if n not in self.units)
        self.fixed = budget.overhead + unplanned
        """File bytes no plan changes: metadata, tokenizer, 1-D tensors, and 2-D tensors nobody priced (F16)."""
        self._plans: dict[int, SizePlan] = {}

    @property
    def tensor_budget(self) -> int:
        """Tensor bytes the budget leaves."""
        return self.budget.limit - self.fixed

    @property
    def floor(self) -> int:
        """The smallest file any plan makes (every tensor at its smallest type)."""
        return self.fixed + int(total_size(smallest(self.units)))

    @property
    def ceiling(self) -> int:
        """Tensor bytes of the F16 file's plannable tensors (a plan at this budget keeps them all F16 or better)."""
        return int(total_size({u: max(opts, key=lambda o: o.size) for u, opts in self.units.items()}))

    def at(self, tensor_bytes: int) -> SizePlan:
        """The least predicted cost within ``tensor_bytes`` of (padded) tensor data."""
        key = int(tensor_bytes)
        if key not in self._plans:
            self._plans[key] = plan(self.units, self.priced, key)
        return self._plans[key]

    def smallest_within(self, nll: float) -> SizePlan:
        """The fewest bytes whose predicted loss increase is at most ``nll`` (nats per token)."""
        return smallest_within(self.units, self.priced, self.tensor_budget, nll)

    def file_bytes(self, size_plan: SizePlan) -> int:
        return self.fixed + size_plan.tensor_bytes

    def key(self, tensor_bytes: float) -> tuple:
        """What a tensor budget chooses: plans that choose the same types are one file."""
        return tuple(sorted(self.at(int(tensor_bytes)).types.items()))

    def describe(self, tensor_bytes: float) -> str:
        p = self.at(int(tensor_bytes))
        return (f"{self.file_bytes(p) / 1e6:.2f} MB (predicted perplexity "
                f"{100 * math.expm1(p.predicted_nll_increase):+.2f} %)")
