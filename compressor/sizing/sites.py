"""What prices a weight in any format: its :class:`Site` (the weight, its input moments Ĥ, the loss
gradient's second moment F at its output, its importance matrix), made for every weight a file stores
(:func:`sites`), and priced on a sample of its rows (:func:`sample_rows`) where it is large.

The predicted loss increase of any rounding ``ΔW`` of a site is computed in closed form
(:mod:`compressor.engine.tensorstats`)::

    cost = ½ Σ_o F_o · (ΔW Ĥ ΔWᵀ)_oo

The token embedding is priced for both of its roles: a lookup (its error enters the residual stream, weighted
by each token's frequency and the loss gradient there) and, when tied, the output head. What a format offers
for a site, and at what bytes, is the format's (:meth:`compressor.sizing.target.SizeTarget.price_all`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from compressor.core import onload
from compressor.core.params import tied_head
from compressor.engine.tensorstats import EMBEDDING, Fisher

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



def _embedding_lookup_cost(f_emb: torch.Tensor, freq: torch.Tensor):
    """Per-row cost of an embedding error ``ΔE`` (rows ``idx`` of [vocab, d]) as a lookup: ½ p_v Σ_o F_o ΔE_vo²."""
    def cost(delta: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return 0.5 * freq[idx] * (delta.double().pow(2) * f_emb).sum(1)
    return cost


#: Tensors with more elements than this are priced on a sample of their rows (:func:`sample_rows`), at least
#: :data:`MIN_PRICED_ROWS`: every type's scale search and GPTQ then cost about the same for every tensor, and
#: only the chosen type is rounded over all rows (:mod:`compressor.pipeline.size.rounding`). At SmolLM2's and
#: Qwen2.5's widths every tensor of more than 256 rows is priced on 256. Measured on the off-grid SmolLM2-135M
#: (Q4_K_M size, ``tools/size/results/size_frontier_offgrid_smollm2_planner_speed.json``): the same file quality
#: as pricing up to 2²¹ elements over all rows, for a third of the pricing time.
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
