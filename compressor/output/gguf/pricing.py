"""A GGUF tensor's options: every GGML type its rows fit, with exact bytes and predicted cost.

:func:`price` turns a :class:`~compressor.sizing.sites.Site` into options (one per GGML type its rows fit),
each quantized by ggml's own quantizer (:mod:`compressor.core.ggml`) with the importance matrix ``diag(Ĥ)``
(the column weights llama.cpp's ``llama-imatrix`` collects, here from the run's own calibration text) or
none when that prices lower (:func:`variants`), and rounded to nearest or by error-compensating rounding
through Ĥ (GPTQ onto ggml's scales, :mod:`compressor.fitting.gridround`). The cost of each is the closed form
of :mod:`compressor.sizing.sites`.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from compressor.core.ggml import (BLOCKS, GGMLType, bits_per_weight, bytes_per_row, dequantize, fits, quantize,
                                  requires_imatrix, roundtrip)
from compressor.core.progress import progress
from compressor.core.threads import side_by_side
from compressor.policy.options import Option
from compressor.sizing.plan import Choice, Rounded
from compressor.sizing.sites import Site

logger = logging.getLogger(__name__)


#: Types offered by default: every type ggml quantizes that llama.cpp's CPU backend runs, down to IQ1_S's
#: 1.56 bits (not the ternary TQ1_0/TQ2_0, made for BitNet's trained ternary weights). ggml builds the search
#: tables of IQ1_S/IQ1_M, IQ2_XXS, IQ2_XS and IQ2_S once per process, the first time it quantizes one (measured
#: on one core: 10, 2, 4 and 9 s), then takes 0.3–2 s per million weights with an importance matrix (IQ2_XS the
#: slowest; Q4_K 0.2): pricing quantizes a tensor's sampled rows only (:func:`~compressor.sizing.sites.
#: sample_rows`), and a tensor whose rows no 256-element type fits never meets them.
DEFAULT_TYPES: tuple[GGMLType, ...] = (
    GGMLType.IQ1_S, GGMLType.IQ1_M, GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.IQ3_XXS,
    GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ3_S, GGMLType.IQ4_XS, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
    GGMLType.Q4_0, GGMLType.IQ4_NL, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.F16,
)

#: Types llama.cpp's quantizer refuses to write without an importance matrix (its ``tensor_requires_imatrix``;
#: ggml itself insists only for IQ1_S and IQ2_XXS/XS): priced with the run's importance matrix only, never
#: unweighted — llama.cpp calls those roundings garbage, and each is one more of ggml's slowest searches.
WEIGHTED_ONLY = frozenset({GGMLType.IQ1_S, GGMLType.IQ1_M, GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S,
                           GGMLType.IQ3_XXS})


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
    re-quantize onto Q4_K with almost no loss unweighted). F16/F32 take none; the lowest i-quants need one
    (:data:`WEIGHTED_ONLY`)."""
    if BLOCKS[t][0] == 1:
        return [None]
    return [site.imatrix] if t in WEIGHTED_ONLY or requires_imatrix(t) else [site.imatrix, None]


#: Rows (the largest loss weights) on which :func:`price` chooses how each type is rounded: ggml's rounding with
#: the importance matrix or without it, and whether the tensor already sits on the type's grid (nothing left
#: for error-compensating rounding to do). Only the chosen rounding is then priced over all the priced rows.
PROBE_ROWS = 32



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
    weighted = Weighted(full, site.imatrix)
    compensate = _compensator(site, factors, weighted, blockwise=any(
        compensates(t) and _rounds_blockwise(t) for t in offered(types, n))) if rounding == "gptq" else None
    kinds = offered(types, n)
    nearest: dict[GGMLType, tuple[float, np.ndarray | None]] = {}

    def rounded(rows: torch.Tensor, t: GGMLType, m, at: torch.Tensor | None = None) -> torch.Tensor:
        """ggml's nearest rounding of ``rows`` (the priced rows at ``at``) in ``t`` with column weights ``m``."""
        if m is not None and m is site.imatrix:
            return torch.from_numpy(weighted.values(t, at))
        return torch.from_numpy(roundtrip(rows.numpy(), t, m))

    # every type's cost on the probe (one product for all): it chooses the rounding, and which types are dominated;
    # a type a k-quant supersedes only unweighted, which tells whether the tensor sits on its grid (else it goes)
    tried = [(t, m) for t in kinds for m in (variants(site, t) if SUPERSEDED.get(t) not in kinds else [None])]
    on_rows = site.costs([rounded(part, t, m, probe) - part for t, m in tried], at=probe)
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
    nearest_cost = dict(zip(rest, site.costs([rounded(full, t, nearest[t][1]) - full for t in rest])))
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
    """Whether error-compensating rounding is offered in ``t``: a quantized type of fewer than
    :data:`COMPENSATED_BELOW_BPW` bits per weight whose grid is per element (GPTQ column by column), or whose
    elements share codebook indices (IQ1_*, IQ2_*, IQ3_*: ggml's blocks quantized one at a time, each block's
    error carried into the rest, :func:`~compressor.fitting.gridround.blockwise_quantize`). (A tensor that
    ggml's rounding already leaves exact, a source's own grid, is not tried either: nothing is left to
    compensate.)"""
    from compressor.fitting import gridround

    return BLOCKS[t][0] > 1 and bits_per_weight(t) < COMPENSATED_BELOW_BPW and (
        gridround.supports(t) is None or gridround.rounds_blockwise(t))


def _rounds_blockwise(t: GGMLType) -> bool:
    from compressor.fitting import gridround

    return gridround.rounds_blockwise(t)


class Weighted:
    """ggml's bytes of a site's priced rows in each type with its importance matrix, quantized once and shared:
    the probe's nearest rounding, GPTQ's scales on the probe and on every priced row, for each half's fit
    (ggml quantizes rows independently, so the probe's bytes are rows of these). ggml's scale search with an
    importance matrix was the planner's largest single cost: on the off-grid Qwen2.5-Coder-1.5B, 27 % of its
    busy thread time (sampled; pricing and the plan's rounding together), each type's search run up to four times
    over a tensor's priced rows in pricing."""

    def __init__(self, rows: torch.Tensor, imatrix: np.ndarray | None) -> None:
        self.rows, self.imatrix = rows, imatrix
        self._raw: dict[GGMLType, np.ndarray] = {}

    def raw(self, t: GGMLType, at: torch.Tensor | None = None) -> np.ndarray:
        """Bytes ``[rows, row_bytes]`` in ``t`` of the priced rows (those at positions ``at``)."""
        if t not in self._raw:
            self._raw[t] = quantize(self.rows.numpy(), t, self.imatrix)
        return self._raw[t] if at is None else self._raw[t][at.numpy()]

    def values(self, t: GGMLType, at: torch.Tensor | None = None) -> np.ndarray:
        """float32 values of :meth:`raw`: what the runtime computes with."""
        return dequantize(self.raw(t, at), t, self.rows.shape[1])


def _compensator(site: Site, factors=None, weighted: Weighted | None = None,
                 blockwise: bool = False) -> Callable[..., list[float]] | None:
    """``(types, at=None) ->`` the predicted cost of the priced rows (those at positions ``at``) rounded by
    GPTQ onto each type's importance-weighted scales, all types in one pass of GPTQ's column loop, the types
    rounded block by block each alone (:func:`~compressor.fitting.gridround.gptq_quantize_many`; one factor of
    each fitted Ĥ shared by every type, :meth:`Site.fit_pairs`, with its block-wise factor where ``blockwise``:
    a type rounded block by block is offered); None for a site with no Ĥ (an untied embedding: a lookup)."""
    from compressor.fitting import gridround

    if site.h is None:
        return None
    full = site.priced_weight()
    if blockwise:  # Site.fit_factors, each factor with its block-wise one beside it
        pairs = [(gridround.factor(fit, blockwise=True) if factors is None else factors.get(fit, blockwise=True),
                  priced) for fit, priced in site.fit_pairs()]
    else:
        pairs = site.fit_factors(factors)

    def cost(types: list[GGMLType], at: torch.Tensor | None = None, raws: dict | None = None) -> list[float]:
        """``raws``: filled with each type's bytes (of the last pair's fit)."""
        w = full if at is None else full[at]
        scales = None if weighted is None else [weighted.raw(t, at) for t in types]
        sums = [0.0] * len(types)
        for fac, h in pairs:
            got = gridround.gptq_quantize_many(w.numpy(), fac, types, site.imatrix, quantized=scales)
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
