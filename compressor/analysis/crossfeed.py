"""Part 4a: cross-feeding — is a block's linearity its FFN's own, or its inputs'?

For a set of blocks S and every pair (i, j) in S: the residual stream entering
block i's FFN (the input of i's pre-FFN norm), normalised with block j's *own*
pre-FFN norm and sent through block j's FFN; the exact affine fit of that map is
scored on held-out rows: R²_lin(j | inputs of i). Row j of the matrix is one
FFN across input sources; column i is one input source across FFNs. The
diagonal is ordinary R²_lin (on the rows used here).

It runs inside the main layer-sequential pass: while the engine walks layer i,
hooks on i's pre-FFN norm hand over the residual stream of each batch and every
FFN j in S is evaluated on it at once; the |S| statistics of source i are
solved when layer i is done and freed. Nothing is stored across layers.

Where the pre-FFN norm lives is data, the ``pre_ffn_norm`` of the model type's row
in :data:`compressor.core.archs.ARCHITECTURES`; ``None`` marks post-norm encoders,
whose FFN input is already normalised with the block's own LayerNorm (no
pre-norm to swap), so the part is left out for them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from compressor.core.archs import ARCHITECTURES
from compressor.core.onload import execution_device
from compressor.core.stats import Moments
from compressor.fitting.solve import score, solve_affine

#: model_type → the pre-FFN norm module, relative to a block (None: no pre-FFN norm): each row's
#: :attr:`~compressor.core.archs.ArchSpec.pre_ffn_norm`.
PRE_FFN_NORM: dict[str, str | None] = {t: spec.pre_ffn_norm for t, spec in ARCHITECTURES.items()}


def unsupported_reason(model_type: str, ffn_in: str, ffn_out: str) -> str | None:
    """Why cross-feeding cannot run on this architecture, or None."""
    if model_type not in PRE_FFN_NORM:
        return (f"no pre-FFN norm is known for model type {model_type!r} (add its row, with pre_ffn_norm, to "
                "ARCHITECTURES in compressor/core/archs.py)")
    if PRE_FFN_NORM[model_type] is None:
        return f"{model_type} is a post-norm encoder: its FFN input is already normalised by the block's own LayerNorm"
    if ffn_in != ffn_out:
        return "the FFN is not one module"
    return None


def choose_blocks(spec: tuple[int, ...] | int, n_blocks: int) -> list[int]:
    """A count → that many evenly spaced blocks (first and last included); indices → checked."""
    from compressor.core.errors import InputError

    if isinstance(spec, int):
        return sorted({int(round(v)) for v in np.linspace(0, n_blocks - 1, min(spec, n_blocks))})
    bad = [i for i in spec if not 0 <= i < n_blocks]
    if bad:
        raise InputError(f"crossfeed_blocks (--crossfeed-blocks): blocks {bad} out of range; the model has "
                         f"{n_blocks} blocks (0..{n_blocks - 1})")
    return sorted(set(spec))


class CrossFeedPart:
    """Hooks on the pre-FFN norms of the chosen blocks (removed on exit) and the statistics of one source at a time."""

    name = "crossfeed"

    def __init__(self, layers: nn.ModuleList, model_type: str, ffn: str, blocks: list[int], *,
                 fit_windows: int, heldout_windows: int, compute_dtype: torch.dtype = torch.float32) -> None:
        norm = PRE_FFN_NORM[model_type]
        self.blocks = blocks
        self.norms = {j: layers[j].get_submodule(norm) for j in blocks}
        self.ffns = {j: layers[j].get_submodule(ffn) for j in blocks}
        self.limit = {"fit": fit_windows, "heldout": heldout_windows}
        self.compute_dtype = compute_dtype
        self.matrix = np.full((len(blocks), len(blocks)), np.nan)
        self.rows = {"fit": 0, "heldout": 0}
        self._h: torch.Tensor | None = None
        self._stats: dict[int, dict[str, Moments]] = {}
        self._handles: list = []

    def __enter__(self) -> "CrossFeedPart":
        def grab(module, args, kwargs):
            self._h = args[0] if args else next(iter(kwargs.values()))

        for j in self.blocks:
            self._handles.append(self.norms[j].register_forward_pre_hook(grab, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._h = None

    @torch.no_grad()
    def observe(self, i: int, split: str, first: int, x: torch.Tensor, y: torch.Tensor) -> None:
        if i not in self.norms:
            return
        k = min(self.limit[split] - first, x.shape[0])
        if k <= 0:
            return
        h = self._h[:k]
        for j in self.blocks:
            if j == i:  # exactly what the engine measured: i's norm and FFN on i's stream
                xj, yj = x[:k], y[:k]
            else:
                dev = execution_device(self.ffns[j])
                xj = self.norms[j](h.to(dev))
                yj = self.ffns[j](xj)
                yj = yj[0] if isinstance(yj, tuple) else yj
            xj, yj = xj.reshape(-1, xj.shape[-1]), yj.reshape(-1, yj.shape[-1])
            st = self._stats.setdefault(j, {})
            m = st.get(split)
            if m is None:
                m = st[split] = Moments(xj.shape[1], yj.shape[1])
            m.update(xj, yj, self.compute_dtype)

    def finish(self, i: int) -> None:
        if i not in self.norms:
            return
        col = self.blocks.index(i)
        own = self._stats.get(i, {})
        self.rows = {split: m.n for split, m in own.items()}
        for j, st in self._stats.items():
            if "fit" not in st or "heldout" not in st:
                continue
            fit = solve_affine(st["fit"].to("cpu"))
            self.matrix[self.blocks.index(j), col] = score(st["heldout"].to("cpu"), fit.W, fit.b).r2
        self._stats.clear()
        self._h = None

    def result(self) -> dict:
        return {"blocks": self.blocks, "fit_rows": self.rows.get("fit", 0), "heldout_rows": self.rows.get("heldout", 0),
                "matrix": [[None if v != v else float(v) for v in row] for row in self.matrix],
                "axes": "matrix[row j][column i] = R²_lin(FFN of block j | inputs of block i)",
                **decompose(self.matrix)}


def decompose(M: np.ndarray) -> dict:
    """Two-way split of the matrix's variance: between FFNs (rows), between input sources (columns), the rest.

    Also: the diagonal against each row's off-diagonal mean (does an FFN keep its level on other inputs?)."""
    if not np.isfinite(M).all() or M.shape[0] < 2:
        return {"row_share": None, "column_share": None, "interaction_share": None, "row_means": None,
                "column_means": None, "diagonal": None, "offdiagonal_row_means": None}
    grand = M.mean()
    rows, cols = M.mean(1), M.mean(0)
    total = float(((M - grand) ** 2).sum())
    ss_r = float(M.shape[1] * ((rows - grand) ** 2).sum())
    ss_c = float(M.shape[0] * ((cols - grand) ** 2).sum())
    s = M.shape[0]
    off = (M.sum(1) - np.diag(M)) / (s - 1)
    share = (lambda v: v / total) if total > 0 else (lambda v: None)
    return {
        "row_share": share(ss_r), "column_share": share(ss_c),
        "interaction_share": share(total - ss_r - ss_c),
        "row_means": rows.tolist(), "column_means": cols.tolist(),
        "diagonal": np.diag(M).tolist(), "offdiagonal_row_means": off.tolist(),
    }


def reading(res: dict) -> str:
    """Plain-words reading of the matrix, from its numbers."""
    if res.get("row_share") is None:
        return "The cross-feeding matrix has missing entries; no reading."
    rs, cs = res["row_share"], res["column_share"]
    diag, off = np.array(res["diagonal"]), np.array(res["offdiagonal_row_means"])
    shift = float(np.median(np.abs(diag - off)))
    span_rows = max(res["row_means"]) - min(res["row_means"])
    span_cols = max(res["column_means"]) - min(res["column_means"])
    lead = (f"Of the variance of the {len(diag)}×{len(diag)} matrix, {rs:.0%} lies between FFNs (rows), "
            f"{cs:.0%} between input sources (columns) and {res['interaction_share']:.0%} in their interaction. "
            f"Row means span {span_rows:.3f} in R², column means {span_cols:.3f}; an FFN's R² on its own inputs "
            f"differs from its mean on the other blocks' inputs by a median of {shift:.3f}. ")
    if rs >= 2 * cs:
        verdict = ("Which FFN matters more than which inputs it is fed: most of the matrix's variation is between "
                   "FFNs, so linearity is mostly a property of the FFN weights; the input source moves R² less.")
    elif cs >= 2 * rs:
        verdict = ("The level follows the input source more than the FFN: fed another block's stream, an FFN takes on "
                   "that stream's linearity — here the inputs, not the weights, carry most of the profile.")
    else:
        verdict = ("Weights and inputs both matter by comparable amounts: neither alone explains the profile.")
    return lead + verdict
