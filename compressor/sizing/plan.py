"""A size plan: what each stored weight becomes (:class:`Choice`), chosen under one byte budget.

plan → allocate: every weight's options (:class:`~compressor.policy.options.Option`: exact bytes, predicted
loss increase, priced by the format's target) are allocated by :func:`plan` — the least summed predicted cost
whose bytes fit the budget (:func:`compressor.policy.options.allocate`) — into a :class:`SizePlan` that the
format's writer stores as it is. :class:`Priced` is what planning keeps of a priced weight, and what the
statistics cache holds (:func:`to_tensors`, :func:`from_tensors`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np
import torch

from compressor.policy.options import Option, allocate, smallest, total_cost, total_size

if TYPE_CHECKING:
    from compressor.sizing.sites import Site

logger = logging.getLogger(__name__)

class Choice(NamedTuple):
    """What an option applies: a GGML type (or another format's scheme), its scales found by ggml with the
    importance matrix or without it, and each code rounded to nearest (ggml's own) or by error-compensating
    rounding through Ĥ (``compensated``: GPTQ onto those scales, :mod:`compressor.fitting.gridround`)."""

    type: Any
    """The format's own name for it: a :class:`~compressor.core.ggml.GGMLType`, or a scheme's name."""
    weighted: bool
    compensated: bool = False


@dataclass
class SizePlan:
    """What the size planner chose, per stored tensor: its option's name (a GGML type for a GGUF, an integer
    scheme for compressed-tensors), an importance matrix for those whose chosen type is cheaper quantized with
    one, and what the writer stores as it is (:attr:`stored`). The writer of the plan's format writes it."""

    types: dict[str, str]
    imatrix: dict[str, np.ndarray] = field(repr=False)
    tensor_bytes: int
    budget_bytes: int
    predicted_nll_increase: float
    rows: list[dict] = field(default_factory=list, repr=False)
    """Per tensor: name, type, bytes, predicted cost, and the cost of every option offered."""
    compensated: set[str] = field(default_factory=set)
    """Tensors whose chosen option is error-compensating rounding (their bytes: :attr:`stored`)."""
    stored: dict = field(default_factory=dict, repr=False)
    """What the writer stores as it is — the compensated tensors, rounded over all their rows once the plan is
    chosen: for a GGUF, tensor name → (type name, raw bytes ``[rows, row_bytes]`` in the file's row order); for
    compressed-tensors, module name → its :class:`~compressor.output.ctensors.grids.Rounded` codes."""

    def to_json(self) -> dict:
        counts: dict[str, int] = {}
        for t in self.types.values():
            counts[t] = counts.get(t, 0) + 1
        return {"tensor_bytes": self.tensor_bytes, "budget_tensor_bytes": self.budget_bytes,
                "predicted_nll_increase": self.predicted_nll_increase,
                "predicted_ppl_change": float(np.expm1(self.predicted_nll_increase)),
                "types_used": dict(sorted(counts.items())), "compensated_tensors": len(self.compensated),
                "tensors": self.rows}


#: How codes may be rounded: ``gptq`` offers error-compensating rounding (GPTQ through Ĥ onto ggml's scales)
#: beside ggml's nearest rounding, each option priced with what it gets; ``nearest`` only ggml's own.
ROUNDINGS = ("gptq", "nearest")


class Rounded(dict):
    """``(tensor, type name) → raw bytes`` (the weight's row order) of the GPTQ roundings that pricing made over
    every row of a tensor: the chosen plan's rounding of that tensor is then these bytes, not a second pass
    (SmolLM2-135M: 20 s of a 230 s run). Bounded by ``limit`` bytes; an offer past it is dropped (rounded
    again later). Offered from :func:`price_all`'s threads: the check and the count are one step under a lock."""

    def __init__(self, limit: int, factors=None) -> None:
        super().__init__()
        self.limit, self.nbytes = limit, 0
        self._lock = threading.Lock()
        self.factors = factors
        """A :class:`~compressor.fitting.gridround.SharedFactors` that keeps pricing's GPTQ factors of Ĥ for the
        plan's rounding (None: pricing's are not kept)."""

    def offer(self, key: tuple[str, str], raw: np.ndarray) -> None:
        with self._lock:
            if self.nbytes + raw.nbytes <= self.limit:
                self[key] = raw
                self.nbytes += raw.nbytes


#: Bytes of full-row GPTQ roundings that pricing keeps for the plan's rounding (:class:`Rounded`).
ROUNDED_BYTES = 1 << 30


@dataclass
class Priced:
    """What planning needs of a tensor once it is priced (its statistics are no longer needed)."""

    name: str
    module: str
    shape: tuple[int, int]
    imatrix: np.ndarray = field(repr=False)

    @classmethod
    def of(cls, site: Site) -> "Priced":
        return cls(site.name, site.module, tuple(site.weight.shape), site.imatrix)


def to_tensors(units: dict[str, list[Option]], priced: list[Priced]) -> tuple[dict[str, torch.Tensor], dict]:
    """Priced options as named tensors and JSON metadata (:mod:`compressor.engine.cache` stores them)."""
    tensors, meta = {}, []
    for i, p in enumerate(priced):
        opts = units[p.name]
        tensors[f"{i}.imatrix"] = torch.from_numpy(p.imatrix.astype(np.float32))
        tensors[f"{i}.size"] = torch.tensor([o.size for o in opts], dtype=torch.float64)
        tensors[f"{i}.cost"] = torch.tensor([o.cost for o in opts], dtype=torch.float64)
        meta.append({"name": p.name, "module": p.module, "shape": list(p.shape), "types": [o.name for o in opts],
                     "weighted": [o.payload.weighted for o in opts],
                     "compensated": [o.payload.compensated for o in opts]})
    return tensors, {"tensors": meta}


def from_tensors(tensors: dict[str, torch.Tensor], meta: dict,
                 payload: Callable[[str, bool, bool], Choice]) -> tuple[dict[str, list[Option]], list[Priced]]:
    """The inverse of :func:`to_tensors`; ``payload(option name, weighted, compensated)`` makes an option's
    :class:`Choice` (the format target's :meth:`~compressor.sizing.target.SizeTarget.payload`)."""
    units, priced = {}, []
    for i, m in enumerate(meta["tensors"]):
        sizes, costs = tensors[f"{i}.size"].tolist(), tensors[f"{i}.cost"].tolist()
        units[m["name"]] = [Option(m["name"], t, sz, c, payload=payload(t, w, g))
                            for t, sz, c, w, g in zip(m["types"], sizes, costs, m["weighted"], m["compensated"])]
        priced.append(Priced(m["name"], m["module"], tuple(m["shape"]), tensors[f"{i}.imatrix"].numpy()))
    return units, priced


def plan(units: dict[str, list[Option]], priced: list[Priced], budget_bytes: int) -> SizePlan:
    """The least predicted cost within ``budget_bytes`` of tensor data (every site's smallest type when
    even that does not fit: the caller compares ``tensor_bytes`` with the budget)."""
    choice = allocate(units, budget_bytes)
    if total_size(choice) > budget_bytes:
        logger.warning("size plan: even the smallest types need %.1f MB of tensor data, over the %.1f MB budget",
                       total_size(smallest(units)) / 1e6, budget_bytes / 1e6)
    by_name = {p.name: p for p in priced}
    rows = []
    for name, o in choice.items():
        s = by_name[name]
        rows.append({"tensor": name, "module": s.module, "shape": list(s.shape), "type": o.name,
                     "bits_per_weight": 8 * o.size / (s.shape[0] * s.shape[1]), "bytes": int(o.size),
                     "imatrix": o.payload.weighted, "rounding": "gptq" if o.payload.compensated else "nearest",
                     "predicted_cost": o.cost, "offered": {x.name: x.cost for x in units[name]}})
    return SizePlan({n: o.name for n, o in choice.items()},
                    {p.name: p.imatrix for p in priced if choice[p.name].payload.weighted},
                    int(total_size(choice)), int(budget_bytes), total_cost(choice), rows,
                    compensated={n for n, o in choice.items() if o.payload.compensated})


def smallest_within(units: dict[str, list[Option]], priced: list[Priced], max_bytes: int, target: float,
                    tolerance: int | None = None) -> SizePlan:
    """The plan with the fewest bytes of tensor data (to within ``tolerance``, default 0.1 % of the range)
    whose predicted loss increase is at most ``target`` (nats per token), between every tensor's smallest
    type and ``max_bytes``: a bisection on the budget, each step an allocation. ``max_bytes``'s plan when
    even that predicts more."""
    lo, hi = int(total_size(smallest(units))), int(max_bytes)
    tolerance = max(256, (hi - lo) // 1000) if tolerance is None else tolerance
    if total_cost(allocate(units, lo)) <= target:
        return plan(units, priced, lo)
    if total_cost(allocate(units, hi)) > target:
        return plan(units, priced, hi)
    while hi - lo > tolerance:  # cost(lo) > target >= cost(hi)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if total_cost(allocate(units, mid)) <= target else (mid, hi)
    return plan(units, priced, hi)

