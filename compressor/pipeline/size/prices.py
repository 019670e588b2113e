"""Prices: every planned tensor's options (GGML type → exact bytes, predicted loss increase).

One backward pass over a spread share of the calibration windows (:func:`fisher_windows`) gives the
loss-gradient second moment F of every linear layer's outputs
(:func:`compressor.engine.tensorstats.output_fisher`); a forward pass over every window gives each layer's
input second moment Ĥ (:class:`MomentPasses`: the whole model at once where every moment fits in memory, else a
decoder layer at a time); they are kept for the chosen plan's rounding (:class:`Measured`): in memory when one
pass holds them all, else each layer's written to the run's work folder as it is priced and mapped back from
disk; each tensor is then priced in
every option of the size's target format (:meth:`~compressor.sizing.target.SizeTarget.price_all`:
every GGML type its rows take, or every integer scheme). The prices are cached with the
statistics (``measure.cache``): a second size of the same model and calibration text costs no pass.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from compressor.core import distributed as dist
from compressor.core.onload import is_offloaded
from compressor.core.archs import arch_for, find_blocks
from compressor.engine.layerwise import layer_moments, output_fisher_sequential
from compressor.engine.tensorstats import input_moments, linear_names, output_fisher
from compressor.fitting.gridround import Factor, SharedFactors, spill_factor
from compressor.pipeline.size.share import Shares, exchange, ordered
from compressor.sizing.plan import ROUNDED_BYTES, Rounded, from_tensors, to_tensors
from compressor.sizing.sites import sites
from compressor.recipe.schema import Recipe
from compressor.sizing.target import SizeTarget

logger = logging.getLogger(__name__)


#: Bytes of input second moments a whole-model pass may hold at least (float32 d_in² per input): Qwen2.5-1.5B's 28
#: layers need 9.8 GB at once (29 GB cross-fitted), so a smaller machine measures and prices them a layer at a time.
MOMENTS_BUDGET_BYTES = 2 << 30


def moments_budget() -> int:
    """Bytes of moments per pass: a third of the memory available now (the model is loaded; pricing a
    group's tensors takes round trips and products beside them; :func:`~compressor.core.hostmem.available_bytes`:
    within a container's or job's limit), at least :data:`MOMENTS_BUDGET_BYTES`. Fewer groups, fewer passes."""
    from compressor.core.hostmem import available_bytes

    avail = available_bytes()
    return MOMENTS_BUDGET_BYTES if avail is None else max(MOMENTS_BUDGET_BYTES, avail // 3)


def moment_groups(model, names: list[str], budget: int | None = None, copies: int = 1) -> list[list[str]]:
    """``names`` (in module order) cut into consecutive groups whose moments (``copies`` matrices per input)
    fit ``budget`` (default: :func:`moments_budget`); modules of one parent (q/k/v, gate/up, which share
    their input) stay in one group."""
    budget = moments_budget() if budget is None else budget
    groups: list[list[str]] = [[]]
    used, parent = 0, None
    for n in names:
        size = 4 * copies * model.get_submodule(n).in_features ** 2
        p = n.rsplit(".", 1)[0]
        if groups[-1] and used + size > budget and p != parent:
            groups.append([])
            used = 0
        groups[-1].append(n)
        used += size
        parent = p
    return groups


#: Bytes of GPTQ factors of Ĥ that pricing keeps for the chosen plan's rounding (:class:`~compressor.fitting.
#: gridround.SharedFactors`): SmolLM2-135M's 121 take 0.4 GB; a larger model's rounding solves the rest again.
FACTOR_BYTES = 1 << 30

#: Bump when what a priced option means changes: cached prices of another version are not read.
PRICES_VERSION = 9  # 9: a compressed-tensors unit's tied options in order of name (8: tree-ordered sums)

#: Calibration tokens the loss-gradient pass reads (:func:`fisher_windows`). F is one mean square per output
#: (a diagonal, d_out numbers per layer), where Ĥ is a d_in × d_in matrix that GPTQ inverts: F settles on far
#: fewer tokens, and its backward pass costs twice a forward (SmolLM2-135M, 16,384 tokens: 94 s of a 407 s
#: run). Ĥ and the token counts still read every window.
FISHER_TOKENS = 2048


def fisher_windows(windows: torch.Tensor, tokens: int = FISHER_TOKENS) -> torch.Tensor:
    """At most ``tokens`` worth of ``windows`` ([n, seq_len]), spread evenly over them (the first and the
    last included), so that F reads every part of the text rather than its beginning."""
    n, seq = windows.shape
    k = min(n, max(1, -(-tokens // max(seq, 1))))
    if k >= n:
        return windows
    return windows[torch.linspace(0, n - 1, k).round().long().unique()]


@dataclass(frozen=True)
class StatisticsPrecision:
    """How the size plan's calibration passes (F's backward, Ĥ's forwards) multiply: ``float32``, or
    ``bfloat16`` — a float32 model run under a bfloat16 autocast, as GPTQ implementations measure Ĥ on a bfloat16
    model, each ``XᵀX`` the float32 product of the bfloat16 activations the layer multiplies
    (:func:`~compressor.engine.tensorstats.gram`), every sum in float32. ``output.size_precision: auto`` takes
    bfloat16 where the device multiplies it natively (a GPU that supports it; a CPU with AVX512-BF16 or AMX): on
    the 2-core AVX512-BF16 machine a bfloat16 product takes a quarter of a float32 one's time, and the off-grid
    SmolLM2-135M's statistics took about 20 s instead of 51 s, Ĥ within 0.15 % on the two layers checked (relative
    norm of the difference), the file's WikiText-2 test score within noise
    (``tools/size/results/size_frontier_offgrid_smollm2_planner_speed.json``).
    """

    name: str

    @classmethod
    def resolve(cls, setting: str, model) -> "StatisticsPrecision":
        """``setting`` (``auto``, ``float32``, ``bfloat16``) for ``model`` where it runs."""
        if setting != "auto":
            return cls(setting)
        dtype, device = _dtype_and_device(model)
        return cls("bfloat16" if dtype == torch.float32 and native_bfloat16(device) else "float32")

    def context(self, model):
        """The context the passes run in: autocast to bfloat16 for a float32 model, else nothing. Autocast keeps
        each weight's bfloat16 cast (and the weight) until the context ends; an onloaded layer's weights are new
        tensors each time they are read, so with the cache every layer read would stay alive (a random-weight 1B's
        layer-0 capture held 6 GB): onloaded, each use casts anew."""
        from contextlib import nullcontext

        dtype, device = _dtype_and_device(model)
        if self.name == "bfloat16" and dtype == torch.float32:
            return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=not is_offloaded(model))
        return nullcontext()


def _dtype_and_device(model) -> tuple[torch.dtype, torch.device]:
    """The token embedding's dtype, and the device the passes compute on (an offloaded model's hook's, not the
    meta device its weights wait on: :func:`~compressor.core.onload.execution_device`)."""
    from compressor.core.onload import execution_device

    return model.get_input_embeddings().weight.dtype, execution_device(model)


def native_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 natively (faster than float32), not by emulation."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    if device.type != "cpu":
        return False
    try:  # private probes of the CPU's instruction sets; absent ones mean "not known to be fast"
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return False


@dataclass
class Measured:
    """What :func:`measure_and_price` returns: every unit's options, what planning keeps of each priced
    tensor, whether they came from the cache, and the input moments of every linear layer (None with cached
    prices, or groups of layers and no folder to spill them to): the chosen plan's rounding then measures
    nothing again."""

    units: dict
    priced: list
    cached: bool
    moments: dict | None = None
    rounded: dict | None = None
    """``(tensor, type) → bytes`` of GPTQ roundings pricing made over all rows (:class:`~compressor.sizing.
    plan.Rounded`), for the chosen plan's rounding; None with cached prices."""
    precision: StatisticsPrecision | None = None
    """How the statistics were (or, with cached prices, would have been) measured: the plan's rounding measures
    any moments again the same way."""
    shares: "Shares | None" = None
    """Which rank priced each layer, and keeps its moments for the rounding (None: cached prices, rank 0 alone)."""
    crossfit: bool = False
    """Whether Ĥ is the mean of the two halves' moments (cross-fitted prices): the rounding measures any moments
    again the same way (:func:`whole_moments`), so that a run with cached prices writes a fresh run's bytes."""


def measure_and_price(recipe: Recipe, model, windows: torch.Tensor, timings: dict, target,
                      spill: Path | None = None) -> Measured:
    """Every tensor's options in ``target``'s format (bytes, predicted cost) and importance matrix: from the
    statistics cache when the same model, calibration windows and pricing settings were priced before
    (``measure.cache``), else measured (a backward pass over :func:`fisher_windows`, then input moments of
    every window, a decoder layer at a time where they do not fit at once) and priced. ``spill``: a folder for
    each layer's moments, kept for the rounding (Qwen2.5-1.5B: 9.8 GB written once, where measuring them again
    took 15 min)."""
    from compressor.engine import cache

    key = None
    precision = StatisticsPrecision.resolve(recipe.output.size_precision, model)
    crossfit = target.heldout_prices and recipe.output.rounding == "gptq" and windows.shape[0] >= 2
    if recipe.measure.cache:
        settings = {"prices": PRICES_VERSION, **target.cache_settings(), "format": target.format,
                    "batch_size": recipe.calibration.batch_size, "rounding": recipe.output.rounding,
                    "heldout": target.heldout_prices, "precision": precision.name}
        data_fp = hashlib.sha256(windows.numpy().tobytes()).hexdigest()
        key = "prices-" + cache.stats_key(cache.model_fingerprint(model), data_fp, settings)
        hit = cache.get(key)
        if hit is not None:
            dist.broadcast_object(None)  # nothing for the other ranks to measure
            logger.info("size plan: prices of every tensor type from the cache (%s)", key)
            units, priced = from_tensors(hit[0], json.loads(hit[1]["prices"]), target.payload)
            return Measured(units, priced, True, precision=precision, crossfit=crossfit)
    go = Statistics(precision.name, crossfit, MomentPasses.plan(model, crossfit), target, recipe.output.rounding, spill)
    dist.broadcast_object(go)  # under torchrun: every rank measures its share and prices its tensors (:func:`follow`)
    measured = go.price(model, windows, recipe.calibration.batch_size, timings)
    if key is not None:
        tensors, meta = to_tensors(measured.units, measured.priced)
        cache.put(key, tensors, {"prices": json.dumps(meta)})
    return measured


@dataclass(frozen=True)
class Statistics:
    """How a size plan's statistics are measured and priced, decided on rank 0 and handed to every rank (under
    torchrun each measures its share of the batches, the sums merged in one order: :class:`~compressor.core.
    distributed.TreeReduce`, the same bits as one process; then each prices its share of the tensors,
    :mod:`.share`): the precision, cross-fitted halves or not, the groups of layers whose moments one pass holds
    (from rank 0's free memory; None: layer by layer), the target (with what its budget learnt: the converter's
    names), the rounding, and rank 0's work folder."""

    precision: str
    crossfit: bool
    groups: list[list[str]] | None
    target: SizeTarget | None = None
    rounding: str = "gptq"
    workdir: Path | None = None

    def fisher(self, model, windows: torch.Tensor, batch_size: int):
        """F from a spread subset of ``windows`` (:func:`fisher_windows`), token counts from all of them; an onloaded
        model one layer's weights at a time, its forward recomputed for the backward."""
        fisher_of = output_fisher_sequential if is_offloaded(model) else output_fisher
        with StatisticsPrecision(self.precision).context(model):
            return fisher_of(model, fisher_windows(windows), batch_size=batch_size, counted=windows,
                             parallel=dist.world_size() > 1)

    def passes(self, model, windows: torch.Tensor, batch_size: int) -> "MomentPasses":
        return MomentPasses(model, windows, batch_size, StatisticsPrecision(self.precision), self.crossfit,
                            groups=self.groups, parallel=dist.world_size() > 1)

    def _price_share(self, model, fisher, moments: dict, namer, mine: list[str], folds, tokens: dict,
                     rounded: Rounded) -> tuple[dict, list]:
        """This rank's share ``mine`` of a group's tensors priced: their options, what planning keeps of each."""
        these = sites(model, fisher, moments, namer, modules=set(mine), folds=folds, tokens=tokens)
        return self.target.price_all(these, self.rounding, kept=rounded), self.target.priced(these)

    def spill(self) -> Path | None:
        """Where this rank keeps its moments, factors and rounded bytes: the work folder (rank 0), a folder of
        its own in it (another rank)."""
        if self.workdir is None or dist.rank() == 0:
            return self.workdir
        return Path(self.workdir) / f"rank-{dist.rank()}"

    def price(self, model, windows: torch.Tensor, batch_size: int, timings: dict) -> "Measured":
        """F, then each group's moments, each group's tensors priced by the rank they are dealt to
        (:class:`~.share.Shares`; one process: all of them) and every rank's options gathered in the order
        one process makes them; this rank's moments (or GPTQ factors) kept for the plan's rounding."""
        target, spill, crossfit = self.target, self.spill(), self.crossfit
        t0 = time.perf_counter()
        fisher = self.fisher(model, windows, batch_size)
        timings["statistics_s"] = time.perf_counter() - t0
        units, priced, namer, shares = {}, [], target.namer(model), Shares()
        index = {n: i for i, (n, _) in enumerate(model.named_modules())}
        passes = self.passes(model, windows, batch_size)
        kept: dict | None = {} if passes.count == 1 or spill is not None else None
        # pricing's GPTQ factors are the plan's rounding's where both factor the same Ĥ (not with held-out prices,
        # which factor each half's): kept in memory with the moments of one group, else written to the work folder
        # in place of the moments (Qwen2.5-1.5B: its 28 down projections' 8,960-wide factors, ~55 s, not solved twice)
        writes = FactorFiles(spill / "factors") if spill is not None and not crossfit and passes.count > 1 else None
        rounded = Rounded(ROUNDED_BYTES, SharedFactors(keep_bytes=FACTOR_BYTES if passes.count == 1 else 0,
                                                       spill=writes))
        for i, (group, folds, moments) in enumerate(passes):
            t0 = time.perf_counter()
            together = {m for m in group if (n := namer(f"{m}.weight")) is not None and not target.apart(n)}
            shares.deal(model, group, moments, stays=together)
            mine = shares.mine(group)
            parts = exchange(functools.partial(self._price_share, model, fisher, moments, namer, mine, folds,
                                               passes.tokens, rounded))
            del folds
            for r, (_, part) in enumerate(parts):
                shares.priced[r] += len(part)
            # in the order one process prices them: module order, then the stacks of experts (rank 0's, in order)
            these = sorted((p for _, part in parts for p in part),
                           key=lambda p: (0, index[p.module]) if target.apart(p.name) else (1, 0))
            units.update(ordered([u for u, _ in parts], [p.name for p in these]))
            priced += these
            if kept is not None:
                own = {m: moments[m] for m in mine if m in moments}
                try:
                    kept.update(own if passes.count == 1 else
                                _for_rounding(own, rounded.factors, spill / f"moments-{i}.pt") if own else {})
                except OSError as exc:  # a full disk costs a second pass, not the run
                    logger.warning("size plan: the input moments could not be kept in %s (%s); the rounding of the "
                                   "chosen plan measures them again", spill, exc)
                    kept = None
            del moments
            timings["pricing_s"] = timings.get("pricing_s", 0.0) + time.perf_counter() - t0
        timings["statistics_s"] += passes.seconds
        if shares.split and dist.is_main():
            logger.info("size plan: pricing shared by %d ranks (tensors priced per rank: %s); each rounds the plan's "
                        "tensors of the layers it priced", shares.world, ", ".join(map(str, shares.priced)))
        return Measured(units, priced, False, kept, rounded, StatisticsPrecision(self.precision), shares, crossfit)


def follow(request, windows: torch.Tensor, batch_size: int) -> tuple[Statistics, Measured] | None:
    """A rank other than 0 in a size run: measure this rank's share of the statistics rank 0 asks for and price
    its share of the tensors; returns rank 0's settings and what this rank measured and kept (its rounding
    follows: :meth:`~.rounding.Compensator.follow`), or None when rank 0's prices came from the cache (it rounds
    alone)."""
    go = dist.broadcast_object()
    if isinstance(go, tuple):  # rank 0 failed before measuring: what the runner broadcasts then
        raise dist.RankFailed(*go[0])
    if go is None:
        return None
    try:
        return go, go.price(request.model, windows, batch_size, {})
    except BaseException:
        if go.spill() is not None:
            shutil.rmtree(go.spill(), ignore_errors=True)
        raise


class MomentPasses:
    """The input moments of every linear layer, group by group: ``(modules, folds, moments)`` per group, each
    measured when the caller asks for it (then priced and spilled before the next). A model held in memory whose
    moments all fit (:meth:`plan`) is measured in one pass over the windows, one group; any other, and every
    onloaded one, a decoder layer at a time in one layer-sequential pass
    (:func:`~compressor.engine.layerwise.layer_moments`: one layer's weights and moments resident). ``folds``:
    each half's moments for cross-fitted prices (``(even, odd)``: :func:`fold_moments`; onloaded, the two halves
    as two splits of the one pass, the same bits), else None; ``moments`` then :func:`mean_moments` of them."""

    def __init__(self, model, windows: torch.Tensor, batch_size: int, precision: StatisticsPrecision,
                 crossfit: bool, groups: list[list[str]] | None | str = "plan", parallel: bool = False) -> None:
        """``groups``: what :meth:`plan` returned on rank 0 (None: layer by layer), or ``"plan"``: plan here."""
        self.model, self.windows, self.batch_size, self.precision = model, windows, batch_size, precision
        self.crossfit, self.parallel = crossfit, parallel
        self.groups = self.plan(model, crossfit) if groups == "plan" else None if is_offloaded(model) else groups
        self.layered = self.groups is None
        layers = None if self.groups is not None else find_blocks(model, arch_for(model, structural=False)[1])[1]
        self.count = len(self.groups) if self.groups is not None else len(layers) + 1
        self.seconds = 0.0
        self.tokens: dict[str, int] = {}
        """Tokens each linear read (a routed expert, those the router sent it); filled as each group or layer is
        measured (not by cross-fitted groups)."""

    @staticmethod
    def plan(model, crossfit: bool) -> list[list[str]] | None:
        """``[every linear]`` when a model held in memory can hold all their moments at once (one pass over the
        whole model: SmolLM2-135M's 0.4 GB), else None: a decoder layer at a time in one layer-sequential pass,
        as an onloaded model always is. Groups of layers that fit, each a pass of its own, ran the first layers
        once per group: Qwen2.5-1.5B's cross-fitted moments (29 GB) took six groups on a 24 GB machine, about
        3.7 forward passes over every window where the layer-sequential pass takes one — the same sums. With two
        groups (its GGUF moments, 9.8 GB) the walk is not faster (145 s against 138 s at 4,096 tokens, alone) but
        holds one layer's moments, not a third of the free memory."""
        if is_offloaded(model):
            return None
        groups = moment_groups(model, linear_names(model), copies=3 if crossfit else 1)
        return groups if len(groups) == 1 else None

    def __iter__(self):
        if self.layered:
            passes = layer_moments(self.model, self.windows, batch_size=self.batch_size, parallel=self.parallel,
                                   folds=self.crossfit, tokens=self.tokens)
            while True:
                t0 = time.perf_counter()
                with self.precision.context(self.model):  # the layer runs when the next item is asked for
                    item = next(passes, None)
                    if item is not None and self.crossfit:
                        item = item[0], item[1], mean_moments(*item[1], self.windows.shape[0])
                    elif item is not None:
                        item = item[0], None, item[1]
                self.seconds += time.perf_counter() - t0
                if item is None:
                    return
                yield item
        for group in self.groups:
            t0 = time.perf_counter()
            with self.precision.context(self.model):
                folds, moments = whole_moments(self.model, self.windows, group, self.batch_size, self.crossfit,
                                               tokens=self.tokens, parallel=self.parallel)
            self.seconds += time.perf_counter() - t0
            yield group, folds, moments


class FactorFiles:
    """Writes each GPTQ factor :class:`~compressor.fitting.gridround.SharedFactors` keeps to its own file in
    ``folder`` and maps it back (:func:`~compressor.fitting.gridround.spill_factor`)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self._count, self._lock = folder, 0, threading.Lock()

    def __call__(self, f: Factor) -> Factor:
        with self._lock:
            self._count += 1
            path = self.folder / f"factor-{self._count}.npy"
        return spill_factor(f, path)


def _for_rounding(moments: dict[str, torch.Tensor], factors: SharedFactors, path: Path) -> dict:
    """What the plan's rounding reads of each module in ``moments``: the GPTQ factor pricing kept of its Ĥ (taken
    over from ``factors``; modules that share Ĥ share it), else its Ĥ written to ``path`` and mapped back."""
    out: dict = {}
    made: dict[int, object] = {}
    for name, h in moments.items():
        if id(h) not in made:
            made[id(h)] = factors.take(h)
        if made[id(h)] is not None:
            out[name] = made[id(h)]
    rest = {name: h for name, h in moments.items() if name not in out}
    if rest:
        out.update(_spilled(rest, path))
    return out


def _spilled(moments: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """``moments`` written to ``path`` and mapped back (shared matrices stay shared): pages read when the rounding
    needs them, and dropped by the system under memory pressure, not held by the run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(moments, path)
    return torch.load(path, mmap=True, weights_only=True)


def whole_moments(model, windows: torch.Tensor, names: list[str], batch_size: int, crossfit: bool,
                  tokens: dict | None = None, parallel: bool = False) -> tuple[tuple[dict, dict] | None, dict]:
    """``(folds, Ĥ)`` of ``names`` over all ``windows``: with ``crossfit``, each half's moments
    (:func:`fold_moments`) and their mean (:func:`mean_moments`), else None and one pass over every window
    (``tokens`` filled). Pricing and a rounding that measures the moments again (prices from the cache, or none
    kept) both take Ĥ from here: the mean of the halves and one pass over all windows are the same matrix in
    another order of sums, and a bit of difference moves GPTQ's codes (a W4A16 file changed with the cache)."""
    if crossfit:
        folds = fold_moments(model, windows, names, batch_size, parallel)
        return folds, mean_moments(*folds, windows.shape[0])
    return None, input_moments(model, windows, names, batch_size=batch_size, tokens=tokens, parallel=parallel)


def fold_moments(model, windows: torch.Tensor, names: list[str], batch_size: int, parallel: bool = False):
    """The input moments of ``names`` over the even and over the odd calibration windows: two halves of the
    text, each unseen by a fit to the other."""
    return tuple(input_moments(model, windows[k::2], names, batch_size=batch_size, parallel=parallel)
                 for k in (0, 1))


def mean_moments(even: dict, odd: dict, n_windows: int) -> dict:
    """Ĥ over all windows from its two halves' (each a mean over its windows' tokens), shared matrices kept
    shared."""
    n_even = (n_windows + 1) // 2
    a, b = n_even / n_windows, (n_windows - n_even) / n_windows
    made: dict[int, torch.Tensor] = {}
    for name, h in even.items():
        if id(h) not in made:
            made[id(h)] = a * h + b * odd[name]
    return {name: made[id(h)] for name, h in even.items()}
