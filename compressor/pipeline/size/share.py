"""Pricing and rounding split across ranks by tensor (``torchrun``: :mod:`compressor.core.distributed`).

After each group's statistics every rank holds the same merged F and Ĥ (the sums are exchanged with
``all_gather``), so the tensors of a group can be priced on different ranks: :class:`Shares` deals each input
second moment — with every layer that reads it (q/k/v, gate/up: one GPTQ factor, one fused unit) — to one rank,
the costliest first onto the least loaded rank so far (longest-processing-time), from shapes alone, so every
rank deals the same. A rank prices its share, keeps its share's moments (or GPTQ factors) for the plan's
rounding, and rounds its share of the chosen plan; rank 0 gathers the options and the rounded bytes, plans and
writes. What a tensor gets does not depend on where it ran: the file is the one process's, byte for byte.

A failure on one rank inside a shared step is carried through the exchange (:func:`exchange`), so every rank
leaves the step together: rank 0 raises it, the others wait for rank 0's verdict as after any failure there.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

from torch import nn

from compressor.core import distributed as dist


class Shares:
    """Which rank prices and rounds each layer: dealt group by group as the groups are measured, the load
    carried across groups (a whole model evens out, not each decoder layer); one process owns everything."""

    def __init__(self, world: int | None = None) -> None:
        self.world = dist.world_size() if world is None else world
        self.owner: dict[str, int] = {}
        """Module name → the rank that prices it, rounds it and keeps its moment."""
        self.load = [0.0] * self.world
        self.priced = [0] * self.world
        """Tensors (allocation units) each rank priced, and rounded over all their rows (counted on rank 0)."""
        self.rounded = [0] * self.world

    def deal(self, model: nn.Module, group: list[str], moments: dict, stays: set[str] = frozenset()) -> None:
        """Deal ``group``'s modules (in module order): the modules whose ``moments`` are one matrix go
        together; ``stays``: modules priced with others of their group that only rank 0 sees whole (a stack
        of experts in one GGUF tensor), kept on rank 0."""
        units: dict[object, list[str]] = {}
        for m in group:
            units.setdefault(("rank0",) if m in stays else id(moments[m]) if m in moments else m, []).append(m)
        work = [(_cost(model, names), i, key) for i, (key, names) in enumerate(units.items())]
        for cost, _, key in sorted(work, key=lambda w: (-w[0], w[1])):
            r = 0 if key == ("rank0",) else min(range(self.world), key=lambda k: (self.load[k], k))
            self.load[r] += cost
            for m in units[key]:
                self.owner[m] = r

    def mine(self, group: list[str], rank: int | None = None) -> list[str]:
        """The modules of ``group`` dealt to ``rank`` (default: this one)."""
        rank = dist.rank() if rank is None else rank
        return [m for m in group if self.owner.get(m, 0) == rank]

    @property
    def split(self) -> bool:
        """Whether more than one rank takes part."""
        return self.world > 1

    def to_json(self) -> dict:
        """What the report's ``size_plan.ranks`` says: how the work was shared (read when the report is written,
        so the rounding's counts are the run's)."""
        return {"world_size": self.world, "tensors_priced": self.priced, "tensors_rounded": self.rounded}


def _cost(model: nn.Module, names: list[str]) -> float:
    """A unit's work, in multiply-adds: GPTQ's factor of its d × d input moment once, then each layer's rows
    through it (about ten options priced, each a column loop of rows × d²). ``names``: linear layers (the groups
    of :class:`~.prices.MomentPasses` are)."""
    layers = [model.get_submodule(m) for m in names]
    d = max(m.in_features for m in layers)
    return d ** 3 / 3 + 10 * sum(m.out_features for m in layers) * d ** 2


@dataclass(frozen=True)
class Failed:
    """A rank's failure inside a shared step, carried through the exchange."""

    rank: int
    message: str


def exchange(step, *, to_main: bool = False) -> list | None:
    """``step()`` on every rank, then every rank's result in rank order — on every rank, or on rank 0 only
    (``to_main``: the others get None; rounded bytes go to the one writer, not to every rank). An exception in
    ``step`` on any rank is raised on rank 0 after the exchange, so that no rank is left waiting in a collective
    the others left; rank 0 then leaves the run and says why to every rank (the runner's last broadcast), which
    the others raise as :class:`~compressor.core.distributed.RankFailed` (here, or where they wait next)."""
    try:
        mine = step()
    except Exception as exc:  # KeyboardInterrupt and SIGTERM end the whole job (torchrun stops every rank)
        if dist.world_size() == 1:
            raise
        mine = Failed(dist.rank(), f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}")
    if dist.world_size() == 1:
        return [mine]
    parts = gather_to_main(mine) if to_main else dist.all_gather_objects(mine)
    if parts is None:  # not rank 0, to_main: rank 0 decides
        return None
    failed = [p for p in parts if isinstance(p, Failed)]
    if not failed:
        return parts
    if dist.is_main():
        raise RuntimeError(f"rank {failed[0].rank} failed in the size plan's shared step: {failed[0].message}")
    verdict = dist.broadcast_object()  # rank 0's, as it leaves the run
    raise dist.RankFailed(*(verdict[0] if isinstance(verdict, tuple) and verdict[0] else (1, failed[0].message)))


def gather_to_main(obj) -> list | None:
    """``obj`` of every rank in rank order on rank 0 (pickled; tensors on the CPU), None elsewhere."""
    import torch.distributed as tdist

    out = [None] * dist.world_size() if dist.is_main() else None
    tdist.gather_object(obj, out, dst=0)
    return out


@dataclass(frozen=True)
class RoundRequest:
    """What rank 0 asks every rank to round for a chosen plan: ``(tensor, option)`` pairs, and the groups of
    layers walked one after another (rank 0's, so every rank walks the same)."""

    need: list[tuple[str, str]]
    groups: list[list[str]]


def ordered(parts: list[dict], order: list[str]) -> dict:
    """Every rank's ``name → value`` merged, in ``order`` (a name none of them has is skipped; one that two
    have is a bug in the dealing)."""
    merged: dict = {}
    for part in parts:
        twice = set(merged) & set(part)
        if twice:
            raise RuntimeError(f"two ranks priced {sorted(twice)[:4]}: the shares overlap")
        merged.update(part)
    out = {n: merged.pop(n) for n in order if n in merged}
    out.update(merged)
    return out
