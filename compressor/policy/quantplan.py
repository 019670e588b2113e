"""The size planner: every weight matrix's GGML type, chosen under one byte budget.

plan → allocate: :func:`price` turns each 2-D weight into options (one per GGML
type its rows fit), each with its exact bytes and a predicted loss increase
computed in closed form (:mod:`compressor.engine.tensorstats`):

    cost(type) = ½ Σ_o F_o · (ΔW Ĥ ΔWᵀ)_oo,   ΔW = dequant(quant(W, imatrix)) − W

with ``quant`` ggml's own quantizer (:mod:`compressor.core.ggml`) given the
importance matrix ``diag(Ĥ)`` (the column weights llama.cpp's ``llama-imatrix``
collects, here from the run's own calibration text), or none when that prices
lower (:func:`variants`). The token
embedding is priced for both of its roles: a lookup (its error enters the
residual stream, weighted by each token's frequency and the loss gradient
there) and, when tied, the output head. :func:`plan` then allocates
(:func:`compressor.policy.options.allocate`): the least summed predicted cost
whose bytes fit the budget.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import nn

from compressor.core import onload
from compressor.core.ggml import BLOCKS, GGMLType, bits_per_weight, bytes_per_row, fits, requires_imatrix, roundtrip
from compressor.core.params import tied_head
from compressor.core.progress import progress
from compressor.core.threads import side_by_side
from compressor.engine.tensorstats import EMBEDDING, Fisher
from compressor.policy.options import Option, allocate, smallest, total_cost, total_size

logger = logging.getLogger(__name__)

#: Types offered by default: everything llama.cpp runs on CPU and GPU that ggml quantizes in well under a
#: second per million weights (the IQ2 family takes ~10 s and needs an importance matrix everywhere).
DEFAULT_TYPES: tuple[GGMLType, ...] = (
    GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ3_S, GGMLType.IQ4_XS, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
    GGMLType.Q4_0, GGMLType.IQ4_NL, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.F16,
)


@dataclass
class Site:
    """One weight matrix to plan: its GGUF name, rows ``[n_rows, n_per_row]`` and what prices it."""

    name: str
    module: str
    weight: torch.Tensor
    """float32 ``[n_rows, n_per_row]`` as the GGUF stores it (rows quantized independently)."""
    h: torch.Tensor | None
    """Ĥ over the row's elements (d_in × d_in), or None for the token embedding."""
    f: torch.Tensor
    """F per row (the loss gradient's mean square at that output)."""
    imatrix: np.ndarray
    extra: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """Per-row cost of a second role of the same ΔW (a tied embedding's lookup), given the row indices."""
    rows: torch.Tensor | None = None
    """Rows priced (None: all) and :attr:`row_weight`, their inverse inclusion probabilities: a sum over
    the priced rows, so weighted, estimates the sum over all rows without bias (:func:`sample_rows`)."""
    row_weight: torch.Tensor | None = None
    lookup_freq: torch.Tensor | None = None
    """An embedding's token frequencies (its lookup role), or None."""
    folds: tuple[torch.Tensor, torch.Tensor] | None = None
    """Ĥ of each half of the calibration windows (:attr:`h` is their mean), or None: what prices a rounding
    fitted to Ĥ (GPTQ) on tokens the fit did not see (:meth:`fit_pairs`)."""
    tokens: int | None = None
    """Calibration tokens that reached the weight, where fewer than all (a routed expert); None: all."""

    def row_costs(self, delta: torch.Tensor, h: torch.Tensor | None = None,
                  at: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted loss increase of each priced row's error ``delta`` ([len(rows), n]), under ``h`` (default
        :attr:`h`); ``at``: the positions among the priced rows that ``delta`` holds (default: all of them)."""
        idx = self.rows if self.rows is not None else torch.arange(self.weight.shape[0])
        if at is not None:
            idx = idx[at]
        out = torch.zeros(delta.shape[0], dtype=torch.float64)
        h = self.h if h is None else h
        if h is not None:
            out += 0.5 * self.f[idx].double() * ((delta @ h) * delta).sum(1).double()
        if self.extra is not None:
            out += self.extra(delta, idx)
        return out

    def cost(self, delta: torch.Tensor, h: torch.Tensor | None = None, at: torch.Tensor | None = None) -> float:
        """Predicted loss increase of an error ``delta`` of the priced rows (all rows, or the sample; ``at``:
        the positions among them that ``delta`` holds)."""
        per_row = self.row_costs(delta, h, at)
        if self.row_weight is None:
            return float(per_row.sum())
        return float((per_row * (self.row_weight if at is None else self.row_weight[at])).sum())

    def costs(self, deltas: list[torch.Tensor], h: torch.Tensor | None = None,
              at: torch.Tensor | None = None) -> list[float]:
        """:meth:`cost` of each of ``deltas`` (errors of the same rows), in one product with Ĥ."""
        if not deltas:
            return []
        pos = torch.arange(deltas[0].shape[0]) if at is None else at
        per_row = self.row_costs(torch.cat(deltas), h, pos.repeat(len(deltas))).view(len(deltas), -1)
        if self.row_weight is not None:
            per_row = per_row * (self.row_weight if at is None else self.row_weight[at])
        return per_row.sum(1).tolist()

    def fit_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(Ĥ a rounding is fitted to, Ĥ its error is priced under)``; a fitted option's price is the mean over
        the pairs. With :attr:`folds`, cross-fitted — fitted on each half, priced on the other: GPTQ priced on
        the Ĥ it was fitted to is optimistic, most where it has most freedom to hide error in directions the
        calibration did not excite (one scale per row; more inputs than tokens). Else ``[(h, h)]``."""
        if self.folds is None:
            return [(self.h, self.h)]
        a, b = self.folds
        return [(a, b), (b, a)]

    def fit_factors(self, shared=None) -> list[tuple[object, torch.Tensor]]:
        """:meth:`fit_pairs` with each fitted Ĥ as its GPTQ factor (act-order): made once per site, shared by
        every option :meth:`fitted_cost` prices; ``shared``: a :class:`~compressor.fitting.gridround.
        SharedFactors` that makes each once for the sites that share it."""
        from compressor.fitting.gridround import factor

        make = factor if shared is None else shared.get
        return [(make(fit), priced) for fit, priced in self.fit_pairs()]

    def fitted_cost(self, factors: list[tuple[object, torch.Tensor]], error: Callable[[object], torch.Tensor]) -> float:
        """Predicted cost of a rounding fitted to Ĥ: ``error(factor)`` is the priced rows' error when fitted
        through ``factor``, priced under the Ĥ paired with it (:meth:`fit_factors`); the mean over the pairs."""
        return sum(self.cost(error(fac), h) for fac, h in factors) / len(factors)

    def priced_weight(self) -> torch.Tensor:
        return self.weight if self.rows is None else self.weight[self.rows]

    def probe(self, k: int) -> torch.Tensor:
        """Positions among the priced rows of the ``k`` with the largest loss weight (F, and a token's
        frequency for an embedding): the rows whose errors weigh most in every option's price."""
        idx = self.rows if self.rows is not None else torch.arange(self.weight.shape[0])
        score = self.f.double()[idx]
        if self.lookup_freq is not None:
            score = score + self.lookup_freq[idx] * float(self.f.double().mean() + 1e-30) * self.weight.shape[0]
        return torch.topk(score, min(k, len(idx))).indices.sort().values


class Choice(NamedTuple):
    """What an option applies: a GGML type (or another format's scheme), its scales found by ggml with the
    importance matrix or without it, and each code rounded to nearest (ggml's own) or by error-compensating
    rounding through Ĥ (``compensated``: GPTQ onto those scales, :mod:`compressor.fitting.gridround`)."""

    type: object
    weighted: bool
    compensated: bool = False


@dataclass
class SizePlan:
    """What the size planner chose: a GGML type per GGUF tensor, and an importance matrix for those whose
    chosen type is cheaper quantized with one."""

    types: dict[str, str]
    imatrix: dict[str, np.ndarray] = field(repr=False)
    tensor_bytes: int
    budget_bytes: int
    predicted_nll_increase: float
    rows: list[dict] = field(default_factory=list, repr=False)
    """Per tensor: name, type, bytes, predicted cost, and the cost of every option offered."""
    compensated: set[str] = field(default_factory=set)
    """Tensors whose chosen option is error-compensating rounding (their bytes: :attr:`stored`)."""
    stored: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict, repr=False)
    """GGUF tensor name → (type name, raw bytes ``[rows, row_bytes]`` in the file's row order): what the writer
    stores as it is — the compensated tensors, rounded over all their rows once the plan is chosen."""
    base: object = None
    """The GGUF file the plan re-quantizes when it is not the source: llama.cpp's converter's F16 of a Hugging
    Face folder (:attr:`~compressor.pipeline.size.budget.Budget.base`); its other tensors are copied as they are."""

    def to_json(self) -> dict:
        counts: dict[str, int] = {}
        for t in self.types.values():
            counts[t] = counts.get(t, 0) + 1
        return {"tensor_bytes": self.tensor_bytes, "budget_tensor_bytes": self.budget_bytes,
                "predicted_nll_increase": self.predicted_nll_increase,
                "predicted_ppl_change": float(np.expm1(self.predicted_nll_increase)),
                "types_used": dict(sorted(counts.items())), "compensated_tensors": len(self.compensated),
                "tensors": self.rows}


def _embedding_lookup_cost(f_emb: torch.Tensor, freq: torch.Tensor):
    """Per-row cost of an embedding error ``ΔE`` (rows ``idx`` of [vocab, d]) as a lookup: ½ p_v Σ_o F_o ΔE_vo²."""
    def cost(delta: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return 0.5 * freq[idx] * (delta.double().pow(2) * f_emb).sum(1)
    return cost


#: Tensors with more elements than this are priced on a sample of their rows (:func:`sample_rows`), at least
#: :data:`MIN_PRICED_ROWS`: every type's scale search and GPTQ then cost about the same for every tensor, and
#: only the chosen type is rounded over all rows (:mod:`compressor.pipeline.size.rounding`). At SmolLM2's and
#: Qwen2.5's widths every tensor of more than 256 rows is priced on 256. Measured on the off-grid SmolLM2-135M
#: (Q4_K_M size, ``tools/results/size_frontier_offgrid_smollm2_planner_speed.json``): the same file quality as pricing up to 2²¹
#: elements over all rows, for a third of the pricing time.
MAX_PRICED_ELEMENTS = 1 << 16
MIN_PRICED_ROWS = 128


def priced_rows(width: int) -> int:
    """The most rows of ``width`` elements a tensor is priced on (more are sampled, :func:`sample_rows`)."""
    return max(MIN_PRICED_ROWS, MAX_PRICED_ELEMENTS // width)


def sample_rows(site: Site, limit: int | None = None, seed: int = 0) -> Site:
    """Price ``site`` on ``limit`` of its rows: the half with the largest loss weight (F, and a token's
    frequency for an embedding) always, the other half drawn uniformly from the rest and weighted by the
    inverse of their inclusion probability — an unbiased estimate of the sum over all rows, exact for the
    rows that matter most. Quantization is row by row, so a row's error is the same in the sample."""
    n, width = site.weight.shape
    if limit is None:
        limit = priced_rows(width)
    if n <= limit:
        return site
    score = site.f.double().clone()
    if site.extra is not None and site.lookup_freq is not None:
        score = score + site.lookup_freq * float(site.f.double().mean() + 1e-30) * n
    top = torch.topk(score, limit // 2).indices
    rest = torch.ones(n, dtype=torch.bool)
    rest[top] = False
    others = torch.nonzero(rest).flatten()
    g = torch.Generator().manual_seed(seed)
    drawn = others[torch.randperm(len(others), generator=g)[: limit - len(top)]]
    site.rows = torch.cat([top, drawn]).sort().values
    weight = torch.ones(n, dtype=torch.float64)
    weight[others] = len(others) / max(len(drawn), 1)
    site.row_weight = weight[site.rows]
    return site


def sites(model: nn.Module, fisher: Fisher, moments: dict[str, torch.Tensor],
          gguf_name: Callable[[str], str | None], modules: set[str] | None = None,
          folds: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
          tokens: dict[str, int] | None = None) -> list[Site]:
    """Every 2-D weight the file stores (of ``modules`` only, when given: the token embedding counts as
    the output head's module), with what prices it. ``gguf_name`` maps a Hugging Face parameter name to
    its planned tensor name (None: not planned, e.g. a tied output head, or what a format keeps as it is).
    ``folds``: the moments of each half of the windows (``moments`` their mean), for :attr:`Site.folds`."""
    out: list[Site] = []
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = tied_head(model)
    freq = (fisher.token_counts / max(fisher.tokens, 1)).double()
    # an embedding that scales its rows (Gemma's √d) passes that scale on to its error
    scale = float(torch.as_tensor(getattr(embed, "embed_scale", 1.0)).float())
    lookup = _embedding_lookup_cost(fisher.grad_sq[EMBEDDING] * scale ** 2, freq)
    names = {id(m): n for n, m in model.named_modules()}
    head_name = names.get(id(head)) if head is not None else None
    for module_name, module in model.named_modules():
        if modules is not None and module_name not in modules and not (module is embed and head_name in modules):
            continue
        if module is embed:
            name = gguf_name(f"{module_name}.weight")
            if name is None:  # a format that keeps the embedding as it is
                continue
            w = onload.weight(model, module_name)
            imat = (fisher.grad_sq[EMBEDDING] * float(freq.mean())).float()
            h = f = None
            if tied:
                hname = names[id(head)]
                h, f = moments[hname].float(), fisher.grad_sq[hname]
                imat = imat + float(f.mean()) * torch.diagonal(h)
            out.append(Site(name, module_name, w, h, f if f is not None else torch.zeros(w.shape[0]),
                            _imatrix(imat), extra=lookup, lookup_freq=freq,
                            folds=_folds(folds, names[id(head)]) if tied else None))
        elif isinstance(module, nn.Linear) and not (tied and module is head):
            name = gguf_name(f"{module_name}.weight")
            if name is None:
                continue
            w = onload.weight(model, module_name)
            seen = (tokens or {}).get(module_name)
            if module_name not in moments:  # a routed expert no calibration token reached: no statistics
                h, f, seen = torch.zeros(w.shape[1], w.shape[1]), torch.zeros(w.shape[0]), 0
            else:
                h, f = moments[module_name].float(), fisher.grad_sq.get(module_name, torch.zeros(w.shape[0]))
            out.append(Site(name, module_name, w, h, f, _imatrix(torch.diagonal(h)), folds=_folds(folds, module_name),
                            tokens=seen if seen is not None and seen < fisher.tokens else None))
    return [sample_rows(s) for s in out]


def _folds(folds, module_name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    return None if folds is None else (folds[0][module_name].float(), folds[1][module_name].float())


def _imatrix(w: torch.Tensor) -> np.ndarray:
    w = w.detach().double().clamp_min(0).numpy()
    top = float(w.max()) if w.size else 0.0
    # ggml weights each element's error by these; all-zero (a dead column set) would leave it unweighted
    return (w / top + 1e-8).astype(np.float32) if top > 0 else np.ones_like(w, dtype=np.float32)


#: 32-element types that a 256-element type of no more bits beats almost everywhere both fit (ggml's
#: k-quants and IQ4_XS store finer scales): where the rows take the k-quants they are not priced, to bound
#: the time, unless the tensor already sits on the type's grid (ggml's rounding leaves the probe rows exact:
#: a source on a 32-element grid, SmolLM2's Q4_1, is re-quantized onto it without loss).
SUPERSEDED = {GGMLType.Q4_0: GGMLType.IQ4_XS, GGMLType.IQ4_NL: GGMLType.IQ4_XS, GGMLType.Q4_1: GGMLType.Q4_K,
              GGMLType.Q5_0: GGMLType.Q5_K, GGMLType.Q5_1: GGMLType.Q5_K}


def offered(types: tuple[GGMLType, ...], n_per_row: int, every: bool = True,
            exact: set[GGMLType] = frozenset()) -> list[GGMLType]:
    """The types rows of ``n_per_row`` take; unless ``every``, less those a k-quant supersedes there (:data:`
    SUPERSEDED`) that are not in ``exact`` (types the tensor already sits on)."""
    fit = [t for t in types if fits(t, n_per_row)]
    return fit if every else [t for t in fit if t in exact or SUPERSEDED.get(t) not in fit]


def variants(site: Site, t: GGMLType) -> list[np.ndarray | None]:
    """The column weights ``t`` is priced with: the importance matrix, and none (a k-quant's scales fitted
    with an importance matrix can leave a source's own grid: Qwen2.5's and Gemma-3's Q4_K_M sources
    re-quantize onto Q4_K with almost no loss unweighted). F16/F32 take none; IQ types need one."""
    if BLOCKS[t][0] == 1:
        return [None]
    return [site.imatrix] if requires_imatrix(t) else [site.imatrix, None]


#: How codes may be rounded: ``gptq`` offers error-compensating rounding (GPTQ through Ĥ onto ggml's scales)
#: beside ggml's nearest rounding, each option priced with what it gets; ``nearest`` only ggml's own.
ROUNDINGS = ("gptq", "nearest")


#: Rows (the largest loss weights) on which :func:`price` chooses how each type is rounded: ggml's rounding with
#: the importance matrix or without it, and whether the tensor already sits on the type's grid (nothing left
#: for error-compensating rounding to do). Only the chosen rounding is then priced over all the priced rows.
PROBE_ROWS = 32


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


#: A type is not priced over all rows when another of no more bytes costs less than this share of it on the
#: probe rows (:func:`undominated`): an allocation never takes it, and pricing it was ggml's slowest searches
#: (IQ3_S, IQ4_NL and IQ4_XS take 5–15 times Q4_0's time for the same rows).
DOMINATED_SHARE = 0.8


def undominated(kinds: list[GGMLType], n_per_row: int, on_probe: dict[GGMLType, float]) -> list[GGMLType]:
    """``kinds`` less each type that another of fewer bytes per row clearly beats on the probe rows (its cost
    there under :data:`DOMINATED_SHARE` of this one's), or another of the same bytes beats at all (Q4_0 and
    IQ4_NL: whichever is dearer there would be taken only if the probe misjudged two close prices, for a small
    loss): the allocation, which takes the least cost within the bytes, would never choose it."""
    size = {t: bytes_per_row(t, n_per_row) for t in kinds}

    def beats(u: GGMLType, t: GGMLType) -> bool:
        if size[u] == size[t]:
            return on_probe[u] < on_probe[t]
        return size[u] < size[t] and on_probe[u] < DOMINATED_SHARE * on_probe[t]
    return [t for t in kinds if not any(u is not t and beats(u, t) for u in kinds)]


def price(site: Site, types: tuple[GGMLType, ...] = DEFAULT_TYPES, rounding: str = "gptq",
          kept: Rounded | None = None, factors=None) -> list[Option]:
    """One option per type whose blocks fit the rows: its bytes and predicted loss increase, priced with the
    rounding it will get, chosen on :data:`PROBE_ROWS` rows (:meth:`Site.probe`) as whichever costs least
    there: ggml's nearest rounding with or without the importance matrix (:func:`variants`), or, with
    ``rounding`` ``gptq`` for a site with Ĥ, error-compensating rounding onto ggml's importance-weighted scales
    (not tried where ggml's rounding leaves the probe exact: a source on the type's grid).
    On an off-grid SmolLM2-135M the error-compensating option priced lower than both nearest roundings for
    every tensor that has Ĥ, and the unweighted rounding won for 3 of 212 tensors in one type (Q5_1): pricing
    all three over every row spent most of the planner's time on options never chosen.
    Types another of no more bytes clearly beats on the probe are not offered (:func:`undominated`).
    ``kept``: where the bytes of a GPTQ rounding of every row (a tensor priced on all its rows, on the Ĥ the
    plan's rounding uses) are offered, for that rounding. ``factors``: the :class:`~compressor.fitting.
    gridround.SharedFactors` of the sites priced together."""
    n_rows, n = site.weight.shape
    full = site.priced_weight()
    probe = site.probe(PROBE_ROWS)
    part = full[probe]
    compensate = _compensator(site, factors) if rounding == "gptq" else None
    kinds = offered(types, n)
    nearest: dict[GGMLType, tuple[float, np.ndarray | None]] = {}
    # every type's cost on the probe (one product for all): it chooses the rounding, and which types are dominated;
    # a type a k-quant supersedes only unweighted, which tells whether the tensor sits on its grid (else it goes)
    tried = [(t, m) for t in kinds for m in (variants(site, t) if SUPERSEDED.get(t) not in kinds else [None])]
    on_rows = site.costs([torch.from_numpy(roundtrip(part.numpy(), t, m)) - part for t, m in tried], at=probe)
    for (t, m), c in zip(tried, on_rows):
        if t not in nearest or c < nearest[t][0]:
            nearest[t] = (c, m)
    kinds = offered(tuple(kinds), n, every=False, exact={t for t in kinds if nearest[t][0] <= 0})
    # error-compensating rounding where the source is not on the type's grid, kept where it wins on the probe
    tried_gptq = [t for t in kinds if compensate is not None and compensates(t) and nearest[t][0] > 0]
    on_probe = compensate(tried_gptq, probe) if tried_gptq else []
    gptq = [t for t, c in zip(tried_gptq, on_probe) if c < nearest[t][0]]
    kinds = undominated(kinds, n, {**{t: c for t, (c, _) in nearest.items()},
                                   **{t: c for t, c in zip(tried_gptq, on_probe) if t in gptq}})
    gptq = [t for t in gptq if t in kinds]
    raws: dict[GGMLType, np.ndarray] | None = {} if kept is not None and site.rows is None and site.folds is None \
        else None
    gptq_cost = dict(zip(gptq, compensate(gptq, raws=raws))) if gptq else {}
    for t, raw in (raws or {}).items():
        kept.offer((site.name, t.name), raw)
    rest = [t for t in kinds if t not in gptq_cost]
    nearest_cost = dict(zip(rest, site.costs([torch.from_numpy(roundtrip(full.numpy(), t, nearest[t][1])) - full
                                              for t in rest])))
    opts = []
    for t in kinds:
        size = n_rows * bytes_per_row(t, n)
        if t in gptq_cost:
            opts.append(Option(site.name, t.name, size, max(gptq_cost[t], 0.0), payload=Choice(t, True, True)))
        else:
            opts.append(Option(site.name, t.name, size, max(nearest_cost[t], 0.0),
                               payload=Choice(t, nearest[t][1] is not None, False)))
    return opts


#: Error-compensating rounding is priced for types of fewer bits per weight than this: at 6 bits and more
#: (Q6_K, Q8_0) ggml's own rounding error is already a small share of any plan's, and GPTQ would double the
#: pricing time for nothing the allocation can see.
COMPENSATED_BELOW_BPW = 6.0


def compensates(t: GGMLType) -> bool:
    """Whether error-compensating rounding is offered in ``t``: a quantized type whose grid is per element,
    of fewer than :data:`COMPENSATED_BELOW_BPW` bits per weight. (A tensor that ggml's rounding already
    leaves exact, a source's own grid, is not tried either: nothing is left to compensate.)"""
    from compressor.fitting import gridround

    return BLOCKS[t][0] > 1 and bits_per_weight(t) < COMPENSATED_BELOW_BPW and gridround.supports(t) is None


def _compensator(site: Site, factors=None) -> Callable[..., list[float]] | None:
    """``(types, at=None) ->`` the predicted cost of the priced rows (those at positions ``at``) rounded by
    GPTQ onto each type's importance-weighted scales, all types in one pass of GPTQ's column loop
    (:func:`~compressor.fitting.gridround.gptq_quantize_many`; one factor of each fitted Ĥ shared by every
    type, :meth:`Site.fit_pairs`); None for a site with no Ĥ (an untied embedding: a lookup)."""
    from compressor.fitting import gridround

    if site.h is None:
        return None
    full = site.priced_weight()
    pairs = site.fit_factors(factors)

    def cost(types: list[GGMLType], at: torch.Tensor | None = None, raws: dict | None = None) -> list[float]:
        """``raws``: filled with each type's bytes (of the last pair's fit)."""
        w = full if at is None else full[at]
        sums = [0.0] * len(types)
        for fac, h in pairs:
            got = gridround.gptq_quantize_many(w.numpy(), fac, types, site.imatrix)
            errors = [torch.from_numpy(gridround.dequantize(raw, t, tuple(w.shape))) - w for t, raw in zip(types, got)]
            sums = [a + b for a, b in zip(sums, site.costs(errors, h, at))]
            if raws is not None:
                raws.update(zip(types, got))
        return [x / len(pairs) for x in sums]
    return cost


def price_all(all_sites: list[Site], types: tuple[GGMLType, ...] = DEFAULT_TYPES,
              threads: int | None = None, rounding: str = "gptq",
              kept: Rounded | None = None) -> dict[str, list[Option]]:
    """:func:`price` for every site; ggml's quantizer releases the GIL, so sites run side by side on
    ``threads`` (default: one per core; :func:`~compressor.core.threads.side_by_side`)."""
    from compressor.fitting.gridround import SharedFactors

    factors = kept.factors if kept is not None and kept.factors is not None else SharedFactors()
    factors.expect(fit for s in all_sites if s.h is not None and rounding == "gptq" for fit, _ in s.fit_pairs())
    priced = list(progress(side_by_side(lambda s: price(s, types, rounding, kept, factors), all_sites, threads),
                           total=len(all_sites), desc="price: tensor types", unit="tensor"))
    factors.settle()
    return {s.name: opts for s, opts in zip(all_sites, priced)}


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
                 payload: Callable[[str, bool, bool], Choice] | None = None) -> tuple[dict[str, list[Option]], list[Priced]]:
    """The inverse of :func:`to_tensors`; ``payload(option name, weighted, compensated)`` makes an option's
    :class:`Choice` (default: a GGML type's)."""
    payload = payload or (lambda t, w, g: Choice(GGMLType[t], w, g))
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

