"""Error-compensating rounding of a chosen plan: every compensated tensor's codes over all its rows.

Prices are computed on a sample of rows (:mod:`.prices`); once a plan is chosen, each tensor whose option is
GPTQ (:attr:`~compressor.sizing.plan.SizePlan.compensated`) is rounded over all its rows with its layer's
input second moment Ĥ — the pricing pass's, kept in memory (SmolLM2-135M: 0.4 GB) or mapped from the work
folder (Qwen2.5-1.5B's 9.8 GB), or, with prices from the cache, measured again in groups of layers that fit
in memory — by the size target's rounding
(:meth:`~compressor.sizing.target.SizeTarget.round_full`). What it returns goes on
:attr:`SizePlan.stored` (a GGUF's raw bytes in the file's row order; an integer scheme's codes and scales), and
the writer stores it as it is. Each (tensor, type) is rounded once per run, whatever the search tries.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch
from accelerate.utils import send_to_device

from compressor.core import distributed as dist
from compressor.core import onload
from compressor.core.params import tied_head
from compressor.core.progress import progress
from compressor.core.threads import side_by_side
from compressor.fitting.gridround import Factor, SharedFactors, rounds_blockwise
from compressor.pipeline.size.prices import StatisticsPrecision, moment_groups, whole_moments
from compressor.pipeline.size.share import RoundRequest, Shares, exchange
from compressor.sizing.plan import Priced, SizePlan
from compressor.sizing.sites import priced_rows

logger = logging.getLogger(__name__)

#: Rounded bytes of a tensor at least this large go to the work folder (:attr:`Compensator.spill`).
SPILL_BYTES = 1 << 20


class Compensator:
    """Full-row GPTQ bytes of the tensors a plan compensates (:meth:`fill`), each (tensor, type) once."""

    def __init__(self, request, priced: list[Priced], windows: torch.Tensor, batch_size: int,
                 timings: dict, target, moments: dict | None = None, rounded: dict | None = None,
                 units: dict | None = None, precision: "StatisticsPrecision | None" = None,
                 spill: Path | None = None, shares: "Shares | None" = None, crossfit: bool = False) -> None:
        """``moments``: every linear layer's Ĥ over ``windows``, as the pricing pass measured it (None: measured
        here, in groups). ``rounded``: ``(tensor, type) → bytes`` pricing already rounded over every row on the
        same Ĥ (:attr:`~.prices.Measured.rounded`): stored as they are, not rounded again. ``units``: every
        tensor's priced options, whose compensated ones a tensor priced on all its rows is rounded beside.
        ``precision``, ``crossfit``: how moments measured here are measured (the pricing pass's: in that precision,
        the mean of the two halves' moments where prices are cross-fitted, so that a run with cached prices writes a
        fresh run's bytes; default float32, one pass). ``spill``: a folder the rounded bytes are written to
        as each tensor is done and mapped back (file pages, not the run's memory: a 3B's grow to 1.2 GB by the
        end of its rounding, and stay until the file is written and checked); None keeps them in memory.
        ``shares``: which rank rounds each layer (:class:`~.share.Shares`, pricing's: the rank that kept its
        moment); None or one rank: everything here."""
        self.request, self.windows, self.batch_size, self.timings = request, windows, batch_size, timings
        self.priced = {p.name: p for p in priced}
        self.target = target
        self.moments = moments
        self._done: dict[tuple[str, str], object] = {}
        self._rounded = rounded if rounded is not None else {}
        self.units = units or {}
        self.precision = precision or StatisticsPrecision("float32")
        self.crossfit = crossfit
        self.spill = spill
        self.shares = shares if shares is not None and shares.split else None

    @classmethod
    def of(cls, request, measured, windows: torch.Tensor, batch_size: int, timings: dict, target,
           spill: Path | None) -> "Compensator":
        """The rounding of what :func:`~.prices.measure_and_price` (or, on another rank, :func:`~.prices.follow`)
        measured and kept."""
        return cls(request, measured.priced, windows, batch_size, timings, target, moments=measured.moments,
                   rounded=measured.rounded, units=measured.units, precision=measured.precision, spill=spill,
                   shares=measured.shares, crossfit=measured.crossfit)

    def _kept(self, name: str, option: str, raw):
        """``raw`` written to the spill folder and mapped back (:meth:`~compressor.sizing.target.SizeTarget.spill`:
        a GGUF tensor's bytes, an integer scheme's codes and scales) when it holds at least :data:`SPILL_BYTES`,
        else as it is; a full disk keeps it in memory (said once)."""
        if self.spill is None:
            return raw
        path = self.spill / "rounded" / f"{name}.{option}"
        try:
            return self.target.spill(raw, path, SPILL_BYTES)
        except OSError as exc:
            logger.warning("size plan: rounded bytes kept in memory, not in %s (%s)", path.parent, exc)
            self.spill = None
            return raw

    def fill(self, *plans: SizePlan) -> None:
        """Put every compensated tensor's bytes on each plan's ``stored``: what none was rounded in before, in
        one pass over the calibration windows (a plan and the anchor beside it share Ĥ and its factor); under
        torchrun each rank rounds its share (:meth:`serve`), rank 0 keeps every tensor's bytes."""
        need = sorted({(n, p.types[n]) for p in plans for n in p.compensated} - set(self._done))
        if need:  # what pricing rounded over all rows is stored as it is, by the rank that priced it (_round_group)
            t0 = time.perf_counter()
            ask = RoundRequest(need, self._groups(need))
            if self.shares is not None:
                dist.broadcast_object(ask)  # the other ranks wait for it in :meth:`follow`
            self.serve(ask)
            if self.shares is not None or any(k not in self._rounded for k in need):  # not only pricing's bytes
                self.timings["compensated_rounding_s"] = self.timings.get("compensated_rounding_s", 0.0) + (
                    time.perf_counter() - t0)
        for p in plans:
            p.stored = {n: (p.types[n], self._done[n, p.types[n]]) for n in p.compensated}

    def follow(self):
        """A rank other than 0: round this rank's share of every plan rank 0 asks for, until rank 0 says the run
        ended; returns that last word (``(failure or None, report)``, what the runner waits for). This rank's work
        folder (its moments, factors) goes on every exit."""
        folder = self.spill
        try:
            while isinstance(ask := dist.broadcast_object(), RoundRequest):
                self.serve(ask)
            return ask
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    def _groups(self, need: list[tuple[str, str]]) -> list[list[str]]:
        """The layers ``need`` rounds through, in module order, cut into groups whose moments fit in memory at
        once (an onloaded model: one layer, one parent module, at a time)."""
        model = self.request.model
        modules = {self._moments_module(name) for name, _ in need}
        order = [n for n, _ in model.named_modules() if n in modules]
        return moment_groups(model, order, budget=0 if onload.is_offloaded(model) else None)

    def serve(self, ask: RoundRequest) -> None:
        """Round ``ask``'s tensors group by group, this rank's share of each (all of them in one process); rank 0
        keeps its own as they are made and gathers the others' after each group (one group's bytes in flight)."""
        by_module: dict[str, list[tuple[str, str]]] = {}
        for name, t in ask.need:
            by_module.setdefault(self._moments_module(name), []).append((name, t))
        main = dist.is_main()
        bar = progress(total=len(ask.need), desc="size plan: compensated rounding", unit="tensor") if main else None
        for group in ask.groups:
            mine = group if self.shares is None else self.shares.mine(group)
            out: dict = {}

            def keep(key, raw):  # from the rounding's threads
                if main:
                    self._done[key] = self._kept(*key, raw)
                else:
                    out[key] = send_to_device(raw, "cpu")  # what crosses to rank 0

            def mine_rounded() -> dict:
                self._round_group(mine, by_module, keep)
                return out

            if self.shares is None:
                mine_rounded()
            elif (parts := exchange(mine_rounded, to_main=True)) is not None:  # rank 0: every rank's bytes
                self.shares.rounded[0] += sum(len(by_module.get(m, [])) for m in mine)
                for r, part in enumerate(parts[1:], start=1):
                    self.shares.rounded[r] += len(part)
                    for key, raw in part.items():
                        keep(key, raw)
            if bar is not None:
                bar.update(sum(len(by_module.get(m, [])) for m in group))
        if bar is not None:
            bar.close()

    def _round_group(self, group: list[str], by_module: dict, keep) -> None:
        """Every ``(tensor, type)`` of ``group``'s layers handed to ``keep``: from what pricing rounded over all
        rows, else rounded through the layer's moment (kept by pricing, or measured here)."""
        todo: list[str] = []
        for m in group:
            for key in by_module[m]:
                if key in self._rounded:
                    keep(key, self.target.store(*key, self._rounded[key], self.request))
            if any(key not in self._rounded for key in by_module[m]):
                todo.append(m)
        if not todo:
            return
        model = self.request.model
        moments = (self.moments if self.moments is not None and all(m in self.moments for m in todo) else
                   self._measure(model, todo))
        # each layer's Ĥ, or the GPTQ factor pricing kept of it in its place (:func:`.prices._for_rounding`)
        layers = [(m, moments[m] if isinstance(moments[m], Factor) else moments[m].float(),
                   [k for k in by_module[m] if k not in self._rounded]) for m in todo]
        del moments
        factors = getattr(self._rounded, "factors", None) or SharedFactors()  # pricing's, where it kept them
        factors.expect(h for _, h, _ in layers)
        # layers side by side where the target's rounding is single-threaded numpy and ggml work (each
        # tensor's bytes are its own, whatever ran beside it); else one at a time on torch's own threads
        threads = None if self.target.rounds_side_by_side else 1
        for _ in side_by_side(lambda layer: self._round_layer(*layer, factors, keep), layers, threads):
            pass

    def _alongside(self, name: str, option: str) -> list[str] | None:
        """The compensated options pricing rounded ``name`` in together over all its rows (in pricing's order),
        or None (priced on a sample of rows, or no such options known)."""
        rows, width = self.priced[name].shape
        together = [o.name for o in self.units.get(name, []) if o.payload.compensated]
        return together if rows <= priced_rows(width) and option in together else None

    def _moments_module(self, name: str) -> str:
        """The layer whose input second moment prices tensor ``name``: its own, or a tied embedding's head (the
        rule :func:`compressor.sizing.sites.sites` prices it by)."""
        model = self.request.model
        module = self.priced[name].module
        if tied_head(model) and model.get_submodule(module) is model.get_input_embeddings():
            names = {id(m): n for n, m in model.named_modules()}
            return names[id(model.get_output_embeddings())]
        return module

    def _measure(self, model, group: list[str]) -> dict:
        """Ĥ of ``group`` over the windows, measured as the pricing pass measured it (:attr:`precision`, and the
        halves' mean with :attr:`crossfit`: :func:`~.prices.whole_moments`)."""
        with self.precision.context(model):
            return whole_moments(model, self.windows, group, self.batch_size, self.crossfit)[1]

    def _round_layer(self, module: str, h: "torch.Tensor | Factor", tensors: list[tuple[str, str]],
                     factors: SharedFactors, keep) -> int:
        """Every ``(tensor, type)`` of layer ``module`` rounded through its input moment ``h`` (or the GPTQ factor
        pricing kept of it) and handed to ``keep``; how many."""
        # one solve per input, shared by every option rounded here (the plan's and the anchor's) and the layers
        # that read the same input; the targets' GPTQ checks it was made with their settings (act-order, default
        # damping)
        # with its block-wise factor where a type rounded block by block is among them (IQ1_*, IQ2_*, IQ3_*)
        # (the types pricing rounded a tensor in together are rounded together again: any of them counts)
        together = {(name, t): self._alongside(name, t) for name, t in tensors}
        fac = factors.get(h, blockwise=any(rounds_blockwise(x) for (_, t), also in together.items()
                                           for x in (also or [t])))
        model = self.request.model
        for name, t in tensors:
            weight = onload.weight(model, self.priced[name].module)
            keep((name, t), self.target.round_full(name, t, weight, fac, self.priced[name], self.request,
                                                   alongside=together[(name, t)]))
        return len(tensors)
