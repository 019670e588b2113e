"""Error-compensating rounding (GPTQ) onto ggml's own grids, bit-compatible with an unmodified llama.cpp.

ggml's quantizer (:func:`compressor.core.ggml.quantize`) fixes every block's scales and mins. This module
keeps those bytes and re-chooses each element's integer code column by column, moving each column's
rounding error onto the columns not yet rounded through the layer's input second moment Ĥ (GPTQ, Frantar
et al. 2022, with its lazy batch updates; see IST-DASLab ``gptq.py::fasterquant``). Only code bits
change, so the file is one llama.cpp reads as it is, every scale byte as ggml wrote it.

The grid is read off gguf-py's reference decoder, never written per type (:func:`~.ggmlgrid.layout`: which
bits are each element's code, and its levels ``base + step · T[code]``). Types whose elements own no grid
(IQ1_*, IQ2_*, IQ3_*: an element owns its sign, its magnitude is a codebook index shared with others) are
compensated block by block instead (:func:`blockwise_quantize`): ggml quantizes each 256-element block once
the blocks before it have carried their error onto it, so every block is ggml's own bytes.

Exactness: the model's levels are gguf-py's (and ggml's C) float32 decoding bit for bit on weights of any
ordinary spread (tested for every type at ggml's codes and at random ones). Where a block's min dwarfs
its step (over ~2^7 times: Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) the decoder's own float32 sum rounds, and the
model can be a few ulps off (≤ 2e-6 relative): a near-tie can then pick the other level, but the bytes
are always decoded by the decoder itself.

    raw = gptq_quantize(W, H, GGMLType.Q4_K, imatrix)      # needs llama-cpp-python and gguf
    err = output_error(W, dequantize(raw, GGMLType.Q4_K, W.shape), H)
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from compressor.core import ggml
from compressor.core.ggml import BLOCKS, GGMLType
from compressor.core.threads import side_by_side
from compressor.fitting.ggmlgrid import Layout, layout, supports  # noqa: F401  (supports: re-exported)

logger = logging.getLogger(__name__)

#: GPTQ's damping: this fraction of the mean of diag Ĥ is added to its diagonal before it is inverted.
DAMP = 0.01

#: Columns rounded between two lazy updates of the rest (GPTQ's ``blocksize``).
BLOCK = 128

#: Columns a block-wise rounding quantizes at once (:func:`blockwise_quantize`): ggml's super-block, the unit of
#: every type whose elements do not own their levels (IQ1_*, IQ2_*, IQ3_*).
BLOCKWISE = 256


@dataclass(frozen=True, eq=False)
class Factor:
    """What GPTQ needs of Ĥ, for every type a tensor is tried in (:func:`factor`)."""

    order: np.ndarray
    """The columns in the order they are rounded."""
    r: np.ndarray
    """float32 unit upper triangular ``R̂`` with ``Ĥ_oo + damp·mean(diag Ĥ)·I = R̂ D R̂ᵀ`` (``D`` diagonal, ``o`` =
    :attr:`order`): Ĥ's Cholesky factor from the last column up, each column divided by its diagonal."""
    damp: float
    act_order: bool
    blockwise: "Factor | None" = None
    """The same Ĥ's factor in :data:`BLOCKWISE` units (:func:`blockwise_factor`) for the types rounded block by
    block (:func:`rounds_blockwise`), where asked for (``factor(..., blockwise=True)``); None: not made."""
    d: np.ndarray | None = None
    """``D`` (float32 ``[n]``), kept on a block-wise factor only: the block's conditioned column weights are read
    off it (:func:`conditioned_weights`)."""

    @property
    def nbytes(self) -> int:
        """Bytes held: ``R̂`` and, where made, the block-wise factor's."""
        return self.r.nbytes + (0 if self.blockwise is None else self.blockwise.nbytes)


def factor(h: np.ndarray | torch.Tensor, *, damp: float = DAMP, act_order: bool = True,
           dtype: torch.dtype | None = None, blockwise: bool = False) -> Factor:
    """Ĥ's damped Cholesky factor in rounding order, in the form GPTQ's column loop reads (:attr:`Factor.r`;
    dead columns, Ĥ_jj = 0, set to 1 first as GPTQ does: nothing reaches them or leaves them, so they are rounded
    to nearest). ``act_order``: columns in descending diag Ĥ (GPTQ's act-order).

    GPTQ is usually written with the Cholesky factor ``U`` of Ĥ's inverse (``Ĥ⁻¹ = UᵀU``): column ``j``'s error
    ``(w̃_j − q_j)/U_jj`` moves onto each later column ``k`` times ``U_jk``. With ``R = U⁻¹``, Ĥ's own Cholesky
    factor from the last column up (``Ĥ = RRᵀ``, ``R`` upper), the same corrected weights are
    ``w̃_k = w_k + Σ_{j<k} (R_jk / R_kk)(w_j − q_j)``: each column's value moves by the rounding errors of the
    columns before it, measured on the original weights — Babai's nearest-plane rounding, which GPTQ is (Chen et
    al. 2025). The same codes, without an inverse.

    The Cholesky is float32, as GPTQ implementations take it, and float64 where float32 finds the damped Ĥ not
    positive definite. On Qwen2.5-Coder-1.5B's own Ĥ (four down projections, an attention output, an FFN input;
    damped condition numbers 2 × 10⁴ to 1.6 × 10⁵) GPTQ's output error through the float32 factor was within
    0.09 % of the float64 factor's, either way, in Q4_K, IQ4_XS and Q3_K. An 8,960-wide factor: 5.7 s with an
    inverse (11.6 s in float64), 3–4 s as a float64 Cholesky, about 2 s in float32 (its Cholesky 1.5 s); its
    working set two float32 matrices, not two float64 ones (``tools/size/bench_gptq_factor.py``). ``dtype``: the
    Cholesky's, only (a comparison); None: float32, else float64. ``blockwise``: with the factor in whole
    blocks of :data:`BLOCKWISE` columns beside it (:attr:`Factor.blockwise`, where ``n`` is a multiple of it)."""
    made = _factor(h, None, damp, act_order, dtype)
    if blockwise and made.r.shape[0] % BLOCKWISE == 0:
        made = replace(made, blockwise=blockwise_factor(h, damp=damp, act_order=act_order, dtype=dtype))
    return made


def blockwise_factor(h: np.ndarray | torch.Tensor, *, damp: float = DAMP, act_order: bool = True,
                     dtype: torch.dtype | None = None) -> Factor:
    """:func:`factor` with the columns in whole blocks of :data:`BLOCKWISE` (ggml's 256-element blocks), each in
    its own order, the blocks in descending ``Σ diag Ĥ`` (``act_order``; else in place), with ``D``
    (:attr:`Factor.d`): what :func:`blockwise_quantize` reads. A block-wise rounding quantizes a block at once,
    so its columns must be consecutive in the rounding order."""
    return _factor(h, BLOCKWISE, damp, act_order, dtype)


def _factor(h, unit: int | None, damp: float, act_order: bool, dtype: torch.dtype | None) -> Factor:
    """:func:`factor` (``unit`` None) or :func:`blockwise_factor` (``unit`` columns per block)."""
    H = torch.as_tensor(_as_numpy(h))
    if H.ndim != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"h must be a square [n, n] matrix, got shape {tuple(H.shape)}")
    if not damp >= 0:
        raise ValueError(f"damp must be >= 0, got {damp}")
    if not torch.isfinite(H).all():
        raise ValueError("h has non-finite entries: the activations it was summed over were not finite (a second "
                         "moment of finite inputs is needed)")
    n = H.shape[0]
    if unit is None:
        order = torch.argsort(torch.diagonal(H), descending=True, stable=True) if act_order else torch.arange(n)
    else:
        if n % unit:
            raise ValueError(f"h is [{n}, {n}]: {n} columns are not whole blocks of {unit}")
        mass = torch.diagonal(H).double().view(-1, unit).sum(1)
        blocks = torch.argsort(mass, descending=True, stable=True) if act_order else torch.arange(n // unit)
        order = (blocks[:, None] * unit + torch.arange(unit)[None]).reshape(-1)
    # With J the reversal, J·H·J = M·Mᵀ (M lower) gives H = R·Rᵀ for the upper R = J·M·J.
    M = None
    for cholesky_dtype in (torch.float32, torch.float64) if dtype is None else (dtype,):
        M = _reversed_cholesky(H, order, damp, cholesky_dtype)
        if M is not None:
            break
    if M is None:
        raise ValueError(f"the damped h is not positive definite at damp={damp} (not a second moment, which damping "
                         f"makes positive definite): a caller of factor() can pass a larger damp (e.g. "
                         f"{max(damp * 10, 0.01):g}); a recipe has no such setting, so from a size run this is a bug "
                         "in the measured moments: please report it with the model and recipe")
    diag = torch.diagonal(M).clone()
    M /= diag  # each column by its diagonal: R̂ = J·M·J column by column over R_kk
    R = M.float()
    del M
    d = None if unit is None else (diag.double() ** 2).flip(0).float().numpy()
    return Factor(order.numpy(), R.flip(0, 1).numpy(), float(damp), bool(act_order), d=d)


def _reversed_cholesky(H: torch.Tensor, order: torch.Tensor, damp: float, dtype: torch.dtype) -> torch.Tensor | None:
    """The lower Cholesky factor, in ``dtype``, of ``J·H_oo·J`` damped (``o`` = ``order``, ``J`` the reversal), or None
    where it is not positive definite in ``dtype``. J·H·J is taken in the reordering itself, one row gather and one
    column gather, each source dropped as soon as it is gathered."""
    rev = order.flip(0)
    A = H[rev]
    A = A[:, rev].to(dtype)
    diag = torch.diagonal(A)  # reversed rounding order
    dead = ~(diag > 0)
    diag[dead] = 1.0
    diag += damp * float(diag.double().mean())
    M, info = torch.linalg.cholesky_ex(A)
    return None if int(info) else M


class SharedFactors:
    """:func:`factor` of each Ĥ that tensors ask for, made once by whichever thread needs it first (q/k/v and
    gate/up read one input: one solve for each set), dropped when its last expected tensor has it, or kept for
    a later round of asks within ``keep_bytes`` (pricing's factors for the chosen plan's rounding: off-grid
    SmolLM2-135M, 121 solves, 3.7 s of a 14 s rounding), and beyond it by ``spill`` where given (a function that
    writes a factor to disk and returns it mapped back: :func:`spill_factor`). Ĥ is told apart by identity: the
    moments of modules that read one input are one tensor object; an Ĥ not :meth:`expect`-ed is solved on
    demand, not kept. A :class:`Factor` asked for is its own factor."""

    def __init__(self, matrices: Iterable = (), *, keep_bytes: int = 0, damp: float = DAMP,
                 act_order: bool = True, spill: Callable[[Factor], Factor] | None = None) -> None:
        self.damp, self.act_order = damp, act_order
        self.keep_bytes, self.kept_bytes = keep_bytes, 0
        self.spill = spill
        self._lock = threading.Lock()
        self._entries: dict[int, _Shared] = {}
        self.expect(matrices)

    def expect(self, matrices: Iterable) -> None:
        """Each of ``matrices`` will be asked for once more (a matrix once per asking tensor)."""
        with self._lock:
            for h in matrices:
                if isinstance(h, Factor):
                    continue
                entry = self._entries.get(id(h))
                if entry is None or entry.h is not h:
                    entry = self._entries[id(h)] = _Shared(h)
                entry.users += 1

    def get(self, h, blockwise: bool = False) -> Factor:
        """Ĥ's factor; ``blockwise``: with its block-wise factor beside it (:func:`factor`), made here where the
        factor made before had none."""
        if isinstance(h, Factor):
            return h
        with self._lock:
            entry = self._entries.get(id(h))
            if entry is not None and entry.h is not h:
                entry = None
            if entry is not None:
                entry.users -= 1
        if entry is None:
            return factor(h, damp=self.damp, act_order=self.act_order, blockwise=blockwise)
        with entry.lock:
            if entry.factor is None:
                entry.factor = factor(h, damp=self.damp, act_order=self.act_order, blockwise=blockwise)
            elif blockwise and entry.factor.blockwise is None and entry.factor.r.shape[0] % BLOCKWISE == 0:
                had = entry.factor
                entry.factor = replace(had, blockwise=blockwise_factor(h, damp=self.damp, act_order=self.act_order))
                if entry.kept and not entry.spilled:
                    with self._lock:
                        self.kept_bytes += entry.factor.nbytes - had.nbytes
            made = entry.factor
        with self._lock:
            if entry.users > 0 or entry.kept:
                return made
            if self.kept_bytes + made.nbytes <= self.keep_bytes:
                entry.kept, self.kept_bytes = True, self.kept_bytes + made.nbytes
                return made
            if self.spill is None:
                self._entries.pop(id(h), None)
                return made
            entry.kept = entry.spilled = True  # no other thread drops it while it is written
        try:
            entry.factor = self.spill(made)
        except OSError as exc:  # a full disk: the rounding solves this one and the rest again
            logger.warning("GPTQ factors are no longer kept on disk (%s); the rounding solves them again", exc)
            with self._lock:
                self._entries.pop(id(h), None)
                self.spill = None
        return made

    def take(self, h) -> Factor | None:
        """The kept factor of ``h``, handed over and forgotten here (with Ĥ, which the entry held); None where
        none was kept."""
        with self._lock:
            entry = self._entries.get(id(h))
            if entry is None or entry.h is not h or not entry.kept or entry.factor is None:
                return None
            del self._entries[id(h)]
            if not entry.spilled:
                self.kept_bytes -= entry.factor.nbytes
            return entry.factor

    def settle(self) -> None:
        """Drop every entry not kept: a tensor expected but never asking (none of its types was compensated)
        would otherwise hold its Ĥ (and any factor made) until the end of the run, a layer's moments per
        group of layers."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if not e.kept]:
                del self._entries[key]


class _Shared:
    """One Ĥ's place in :class:`SharedFactors` (holding Ĥ keeps its identity from being reused)."""

    def __init__(self, h) -> None:
        self.h, self.users, self.lock, self.factor, self.kept = h, 0, threading.Lock(), None, False
        self.spilled = False


def spill_factor(f: Factor, path: Path) -> Factor:
    """``f`` written to ``path`` (``.npy``, its order beside it, its block-wise factor as ``….blocks.npy``) and
    mapped back copy-on-write: its pages are file pages, read when GPTQ reads them and dropped under memory
    pressure, not the run's memory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    order = path.with_name(path.stem + ".order.npy")
    for arr, where in ((f.r, path), (f.order, order)):
        with open(where, "wb") as fh:
            np.save(fh, np.ascontiguousarray(arr))
    blocks = None if f.blockwise is None else spill_factor(f.blockwise, path.with_name(path.stem + ".blocks.npy"))
    return Factor(np.load(order), np.load(path, mmap_mode="c"), f.damp, f.act_order, blocks, f.d)


def factor_for(h, n: int, *, damp: float, act_order: bool) -> Factor:
    """``h`` as a :class:`Factor` for rows of ``n`` inputs: made here from Ĥ, or checked when given (one solve
    shared by every type or scheme a layer is tried in must have been made with the same settings)."""
    f = h if isinstance(h, Factor) else factor(h, damp=damp, act_order=act_order)
    if f.r.shape != (n, n):
        raise ValueError(f"h must be [{n}, {n}] for rows of {n} inputs, got {f.r.shape}")
    if (f.damp, f.act_order) != (float(damp), bool(act_order)):
        raise ValueError(f"the factor was made with damp={f.damp}, act_order={f.act_order}; this call asks for "
                         f"damp={damp}, act_order={act_order}")
    return f


def _as_numpy(x: np.ndarray | torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def gptq_quantize(weight: np.ndarray | torch.Tensor, h: np.ndarray | torch.Tensor | Factor, qtype: GGMLType,
                  imatrix: np.ndarray | None, *, damp: float = DAMP, block: int = BLOCK,
                  act_order: bool = True) -> np.ndarray:
    """Raw bytes ``[rows, row_bytes]`` of ``weight`` (``[rows, n]``, rows quantized independently) in
    ``qtype``: ggml's scales for ``imatrix`` (``n`` column weights, e.g. diag Ĥ; None: unweighted), every
    code re-chosen by GPTQ under ``h`` (Ĥ, ``[n, n]``, or its :func:`factor`, made with the same ``damp``
    and ``act_order``, to share one solve among the types a tensor is tried in). ``act_order``: columns
    in descending diag Ĥ. Bit-compatible with llama.cpp: only code bits differ from ggml's bytes.

    >>> raw = gptq_quantize(W, H, GGMLType.Q4_0, np.diag(H))   # doctest: +SKIP
    """
    return gptq_quantize_many(weight, h, [qtype], imatrix, damp=damp, block=block, act_order=act_order)[0]


def gptq_quantize_many(weight: np.ndarray | torch.Tensor, h: np.ndarray | torch.Tensor | Factor,
                       qtypes: list[GGMLType], imatrix: np.ndarray | None, *, damp: float = DAMP,
                       block: int = BLOCK, act_order: bool = True,
                       quantized: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """:func:`gptq_quantize` of one ``weight`` in each of ``qtypes``: the types' rows go through GPTQ's column
    loop side by side (one pass, a few array operations per column for all of them), since pricing a tensor
    tries it in up to nine types and the loop's per-column overhead, not its arithmetic, is what a row of a
    few hundred elements costs. Each type's bytes are what it gets alone up to the order in which BLAS sums
    the wider products: a near-tie can round the other way (SmolLM2-135M, one of 34 tensor-types checked:
    24 bytes of an FFN up projection's Q5_1). The same ``qtypes`` give the same bytes, run to run.
    ``quantized``: ggml's bytes of ``weight`` in each type with ``imatrix`` (:func:`compressor.core.ggml.quantize`),
    where the caller has them: their scales are kept, not searched again (ggml's search for IQ4_XS's or Q4_K's
    scales with an importance matrix costs more than GPTQ's loop over a row of 1,536)."""
    types = [GGMLType(t) for t in qtypes]
    W = np.ascontiguousarray(_as_numpy(weight), dtype=np.float32)
    if W.ndim != 2:
        raise ValueError(f"weight must be 2-D [rows, n], got shape {W.shape}")
    rows, n = W.shape
    for t in types:
        if not t.quantized:
            layout(t)  # raises: a float type stores values, not codes on a grid
        if n % BLOCKS[t][0]:
            raise ValueError(f"rows of {n} elements are not a whole number of {t.name} blocks of {BLOCKS[t][0]}: "
                             f"pick a type whose block divides {n}")
    # a type whose elements do not own their levels is rounded block by block, each type alone (its bytes are
    # the same whatever is rounded beside it); every other type in one column loop
    blockwise = [i for i, t in enumerate(types) if rounds_blockwise(t)]
    if blockwise:
        per_column = [i for i in range(len(types)) if i not in blockwise]
        out: list = [None] * len(types)
        fb = h if isinstance(h, Factor) else blockwise_factor(h, damp=damp, act_order=act_order)  # one solve
        for i in blockwise:
            out[i] = blockwise_quantize(W, fb, types[i], imatrix, damp=damp, act_order=act_order)
        if per_column:
            got = gptq_quantize_many(W, h, [types[i] for i in per_column], imatrix, damp=damp, block=block,
                                     act_order=act_order,
                                     quantized=None if quantized is None else [quantized[i] for i in per_column])
            for i, raw in zip(per_column, got):
                out[i] = raw
        return out
    lays = [layout(t) for t in types]
    if not np.isfinite(W).all():
        raise ValueError("weight has non-finite values")
    if not block >= 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if not types:
        return []
    if quantized is not None and (len(quantized) != len(types) or any(q.shape[0] != rows for q in quantized)):
        raise ValueError(f"quantized must hold ggml's bytes of all {rows} rows in each of the {len(types)} types")
    f = factor_for(h, n, damp=damp, act_order=act_order)
    # rows are rounded independently (ggml's scales are per row, GPTQ's error moves along a row): a large
    # tensor goes in chunks of rows, its bytes the same, its memory bounded (an output head of 152k rows of
    # 1,536 held ~10 GB of grids and codes at once and was killed on a 24 GB machine)
    step_rows = max(1, CHUNK_ELEMENTS // (n * len(types)))
    # the chunks side by side (an output head of 49,152 rows was the last tensor a plan rounded, alone)
    parts = list(side_by_side(
        lambda r: _gptq_rows(W[r:r + step_rows], f, types, lays, imatrix, block,
                             None if quantized is None else [q[r:r + step_rows] for q in quantized]),
        range(0, rows, step_rows)))
    return [np.concatenate([p[i] for p in parts]) if len(parts) > 1 else parts[0][i] for i in range(len(types))]


def rounds_blockwise(qtype: GGMLType | str) -> bool:
    """Whether ``qtype`` (a type or its name) is rounded block by block (:func:`blockwise_quantize`): a type of
    ggml's 256-element blocks whose elements do not own their levels (IQ1_*, IQ2_*, IQ3_*: shared codebook
    indices; :func:`~.ggmlgrid.layout` refuses them). False for any other name (another format's scheme)."""
    t = GGMLType.__members__.get(qtype) if isinstance(qtype, str) else GGMLType(qtype)
    if t is None or not t.quantized or BLOCKS[t][0] != BLOCKWISE:
        return False
    try:
        layout(t)
    except ValueError:
        return True
    return False


#: Column weights ggml's quantizer is given for each block in :func:`blockwise_quantize`: ``conditioned``, the
#: diagonal of the block's own error form (:func:`conditioned_weights`), or ``imatrix``, the importance matrix
#: (diag Ĥ). On SmolLM2-135M's down projections the two were within 1.5 % of each other's output error in every
#: type, ``conditioned`` ahead in 6 of 7 held out (``tools/size/results/blockwise_iquant_smollm2.json``).
BLOCK_WEIGHTS = "conditioned"


def conditioned_weights(f: Factor, p: int) -> np.ndarray:
    """float32 ``[BLOCKWISE]``: block ``p``'s column weights (in the rounding order) of a block-wise factor ``f``,
    the diagonal of ``R_bb R_bbᵀ`` — Ĥ's Schur complement on the block given every column rounded after it, the
    form its error is priced under once the later columns absorb what they can (Ĥ's own diagonal counts that
    share too)."""
    s = slice(p * BLOCKWISE, (p + 1) * BLOCKWISE)
    Rb = f.r[s, s].astype(np.float64)
    return ((Rb * Rb) @ f.d[s].astype(np.float64)).astype(np.float32)


def blockwise_quantize(weight: np.ndarray | torch.Tensor, h: np.ndarray | torch.Tensor | Factor, qtype: GGMLType,
                       imatrix: np.ndarray | None, *, damp: float = DAMP, act_order: bool = True,
                       weights: str | None = None) -> np.ndarray:
    """Raw bytes ``[rows, row_bytes]`` of ``weight`` in ``qtype`` by error-compensating rounding in whole blocks:
    each 256-column block of every row is quantized by ggml (:func:`compressor.core.ggml.quantize`) as it stands
    once the blocks before it have moved their error onto it, and its own error moves onto the blocks not yet
    quantized through Ĥ's factor (:func:`blockwise_factor`; ``h``: Ĥ or a :func:`factor` made with
    ``blockwise=True``). For the types whose elements share codebook indices (:func:`rounds_blockwise`) but any
    256-block type works. Bit-compatible with llama.cpp: every block is ggml's own bytes.

    With ``H = R Rᵀ`` (``R`` upper, in the rounding order) the error ``ΔW Ĥ ΔWᵀ`` is ``‖ΔW R‖²``; block ``b``'s
    part ``‖(Q_b − W̃_b) R_bb‖²`` with ``W̃_b = W_b + C_b R̂_bb⁻¹``, ``C_b = Σ_{e before b} (W_e − Q_e) R̂_eb``
    (Babai's nearest plane in blocks, GPTQ's lazy batch with the block as the unit). ggml minimises a diagonal
    form, so it is handed :data:`BLOCK_WEIGHTS` (``weights``): the diagonal of ``R_bb R_bbᵀ`` or ``imatrix``.

    >>> raw = blockwise_quantize(W, H, GGMLType.IQ2_XS, np.diag(H))   # doctest: +SKIP
    """
    t = GGMLType(qtype)
    weights = BLOCK_WEIGHTS if weights is None else weights
    if weights not in ("conditioned", "imatrix"):
        raise ValueError(f"weights must be 'conditioned' or 'imatrix', got {weights!r}")
    W = np.ascontiguousarray(_as_numpy(weight), dtype=np.float32)
    if W.ndim != 2:
        raise ValueError(f"weight must be 2-D [rows, n], got shape {W.shape}")
    rows, n = W.shape
    if not t.quantized or BLOCKS[t][0] != BLOCKWISE or n % BLOCKWISE:
        raise ValueError(f"{t.name} in rows of {n}: block-wise rounding takes types of {BLOCKWISE}-element blocks "
                         f"and rows that are a whole number of them")
    if not np.isfinite(W).all():
        raise ValueError("weight has non-finite values")
    if imatrix is not None and np.asarray(imatrix).reshape(-1).shape[0] != n:
        raise ValueError(f"imatrix has {np.asarray(imatrix).size} weights for rows of {n}")
    f = _blockwise_for(h, n, damp, act_order)
    if weights == "imatrix" and imatrix is not None:
        col = np.asarray(imatrix, dtype=np.float32).reshape(-1)[f.order]
        per_block = [col[p * BLOCKWISE:(p + 1) * BLOCKWISE] for p in range(n // BLOCKWISE)]
    elif weights == "imatrix" and not ggml.requires_imatrix(t):
        per_block = [None] * (n // BLOCKWISE)
    else:  # conditioned, or a type ggml refuses to quantize unweighted
        per_block = [conditioned_weights(f, p) for p in range(n // BLOCKWISE)]
    # rows are independent; chunks of a size set by n alone, so a type's bytes never depend on what runs beside it
    step_rows = max(1, CHUNK_ELEMENTS // n)
    parts = list(side_by_side(lambda r: _blockwise_rows(W[r:r + step_rows], f, t, per_block),
                              range(0, rows, step_rows)))
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def _blockwise_for(h, n: int, damp: float, act_order: bool) -> Factor:
    """The block-wise factor of ``h`` (made here from Ĥ, or the one a :class:`Factor` carries), checked."""
    if not isinstance(h, Factor):
        f = blockwise_factor(h, damp=damp, act_order=act_order)
    elif h.d is not None:  # a block-wise factor itself
        f = h
    elif h.blockwise is None:
        raise ValueError("the factor was made without its block-wise factor, which block-wise rounding needs: make "
                         "it with factor(h, blockwise=True) or SharedFactors.get(h, blockwise=True)")
    else:
        f = h.blockwise
    factor_for(f, n, damp=damp, act_order=act_order)
    return f


def _blockwise_rows(W: np.ndarray, f: Factor, t: GGMLType, per_block: list) -> np.ndarray:
    """:func:`blockwise_quantize` of the rows ``W`` through block-wise factor ``f``, ggml given ``per_block``'s
    weights for each block in the rounding order."""
    rows, n = W.shape
    nbytes = BLOCKS[t][1]
    Wo = W[:, f.order]
    C = np.zeros_like(Wo)  # Σ (W_e − Q_e) R̂_e· over the blocks done: the corrections, before R̂_bb⁻¹
    out = np.empty((rows, n // BLOCKWISE * nbytes), dtype=np.uint8)
    for p in range(n // BLOCKWISE):
        s = slice(p * BLOCKWISE, (p + 1) * BLOCKWISE)
        target = Wo[:, s]
        if p:  # X R̂_bb = C_b: the block's share of the corrections once its own columns are taken out
            rb = torch.from_numpy(np.ascontiguousarray(f.r[s, s], dtype=np.float64))
            x = torch.linalg.solve_triangular(rb, torch.from_numpy(C[:, s].astype(np.float64)), upper=True,
                                              left=False, unitriangular=True)
            target = target + x.numpy().astype(np.float32)
        raw = ggml.quantize(np.ascontiguousarray(target), t, per_block[p])
        at = int(f.order[p * BLOCKWISE]) // BLOCKWISE  # the block's place in the row
        out[:, at * nbytes:(at + 1) * nbytes] = raw
        if s.stop < n:
            err = Wo[:, s] - ggml.dequantize(raw, t, BLOCKWISE)
            C[:, s.stop:] += err @ f.r[s, s.stop:]
    return out


#: Elements (rows × inputs × types) :func:`gptq_quantize_many` rounds at once: about 40 bytes of working
#: arrays each (the weights, grids, codes and indices), so at most about 0.2 GB per thread.
CHUNK_ELEMENTS = 1 << 22


def _gptq_rows(W: np.ndarray, f: Factor, types: list[GGMLType], lays: list[Layout], imatrix, block: int,
               quantized: list[np.ndarray] | None = None):
    """:func:`gptq_quantize_many` of the rows ``W``: raw bytes per type (``quantized``: ggml's, given)."""
    rows, n = W.shape
    o = f.order
    total = rows * len(types)
    B = np.empty((n, total), dtype=np.float32)
    S = np.empty((n, total), dtype=np.float32)
    raws = []
    for i, (t, lay) in enumerate(zip(types, lays)):
        raw = ggml.quantize(W, t, imatrix) if quantized is None else quantized[i]
        base, step = lay.grid(raw, n)
        B[:, i * rows:(i + 1) * rows] = base[:, o].T
        S[:, i * rows:(i + 1) * rows] = step[:, o].T
        del base, step
        raws.append(raw)
    codes = _round_many(np.tile(W[:, o].T, (1, len(types))), B, S, [lay.table for lay in lays], f.r, block)
    del B, S
    out = []
    for i, (raw, lay) in enumerate(zip(raws, lays)):
        c = np.empty((n, rows), dtype=np.uint8)
        c[o] = codes[:, i * rows:(i + 1) * rows]
        out.append(lay.pack(raw, c.T))
    return out


def _round_many(W: np.ndarray, base: np.ndarray, step: np.ndarray, tables: list[np.ndarray], R: np.ndarray,
                block: int) -> np.ndarray:
    """GPTQ's lazy-batch loop on transposed ``[n, rows]`` float32 arrays (a column is a contiguous row) whose
    rows are ``len(tables)`` equal slices, slice ``i`` on grids of table ``tables[i]``: codes ``[n, rows]``,
    each the nearest level of its element's grid to the error-compensated weight ``w̃_k = w_k + Σ_{j<k} R̂_jk
    (w_j − q_j)`` (``R``: :attr:`Factor.r`). ``W`` is overwritten.

    Within a batch each column gathers the corrections of the batch's earlier columns (one GEMV with the batch's
    diagonal block of R̂); after it, the batch's errors move onto every later column (one GEMM). Slices whose
    tables are alike share one search per column: an affine type's table is ``0, 1, …, 2^k − 1``, a prefix of
    the widest one, so a search in the widest capped at ``2^k − 1`` is the search in its own. numpy, not torch:
    torch's threaded rank-1 updates stall on a busy 2-core machine."""
    n, total = W.shape
    rows = total // len(tables)
    groups = _table_groups(tables, rows)
    B, S = base.astype(np.float32, copy=False), step.astype(np.float32, copy=False)
    with np.errstate(divide="ignore"):
        inv = np.where(S != 0, 1 / S, 0).astype(np.float32)  # step 0: every code gives base; any will do
    W0 = W.copy()  # the original weights: each error is measured on them
    idx = np.empty((n, total), dtype=np.uint8)  # positions in a table of at most 2⁸ levels
    lev = np.empty(total, dtype=np.float32)
    err = np.empty((block, total), dtype=np.float32)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        Rt = np.ascontiguousarray(R[i1:i2, i1:i2].T)  # row j − i1: R̂_{i1…j−1, j}
        for j in range(i1, i2):
            w = W[j] + Rt[j - i1, :j - i1] @ err[:j - i1]
            x = (w - B[j]) * inv[j]
            k = idx[j]
            for sl, levels, mids, cap in groups:
                if cap is not None:  # affine levels 0 … 2^k − 1: the nearest is ⌈x − ½⌉ (a tie down, as a search)
                    kf = np.ceil(x[sl] - 0.5)
                    np.clip(kf, 0, cap, out=kf)
                    k[sl] = kf
                    lev[sl] = kf
                    continue
                kk = np.searchsorted(mids, x[sl])
                k[sl] = kk
                lev[sl] = levels[kk]
            err[j - i1] = W0[j] - (B[j] + S[j] * lev)
        if i2 < n:
            W[i2:] += R[i1:i2, i2:].T @ err[:i2 - i1]
    out = np.empty((n, total), dtype=np.uint8)
    for sl, order in _orders(tables, rows):
        out[:, sl] = order[idx[:, sl]]
    return out


def _table_groups(tables: list[np.ndarray], rows: int):
    """``(columns, sorted levels, midpoints, cap or None)`` per set of alike tables: every affine table (``0 … 2^k
    − 1``) in one group searched on the widest, each capped at its own top code; any other table with the
    slices of tables equal to it."""
    affine = [i for i, t in enumerate(tables) if np.array_equal(t, np.arange(len(t)))]
    groups = []
    if affine:
        cols = np.concatenate([np.arange(i * rows, (i + 1) * rows) for i in affine])
        levels = np.arange(max(len(tables[i]) for i in affine), dtype=np.float32)
        cap = np.concatenate([np.full(rows, len(tables[i]) - 1) for i in affine])
        groups.append((_slice(cols), levels, (levels[1:] + levels[:-1]) / 2, cap))
    rest = [i for i in range(len(tables)) if i not in affine]
    while rest:
        same = [i for i in rest if np.array_equal(tables[i], tables[rest[0]])]
        rest = [i for i in rest if i not in same]
        levels = np.sort(tables[same[0]]).astype(np.float32)
        cols = np.concatenate([np.arange(i * rows, (i + 1) * rows) for i in same])
        groups.append((_slice(cols), levels, (levels[1:] + levels[:-1]) / 2, None))
    return groups


def _orders(tables: list[np.ndarray], rows: int):
    """Each slice's columns and the map from its sorted level's index to the code (the table's argsort)."""
    return [(slice(i * rows, (i + 1) * rows), np.argsort(t, kind="stable")) for i, t in enumerate(tables)]


def _slice(cols: np.ndarray):
    """``cols`` as a slice when they are consecutive (a view, not a copy), else as they are."""
    if cols.size and np.array_equal(cols, np.arange(cols[0], cols[0] + cols.size)):
        return slice(int(cols[0]), int(cols[0] + cols.size))
    return cols


def dequantize(raw: np.ndarray, qtype: GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of raw bytes of ``qtype``, as ``shape`` (gguf-py's decoder, what llama.cpp computes)."""
    return ggml.dequantize(raw, GGMLType(qtype), int(shape[-1])).reshape(shape)


def output_error(weight: np.ndarray | torch.Tensor, approx: np.ndarray | torch.Tensor,
                 h: np.ndarray | torch.Tensor) -> float:
    """``Σ_rows (ΔW Ĥ ΔWᵀ)_rr`` with ``ΔW = approx − weight``: the summed squared output error for inputs
    of second moment ``h``, in float64."""
    d = _as_numpy(approx).astype(np.float64) - _as_numpy(weight).astype(np.float64)
    return float(((d @ _as_numpy(h).astype(np.float64)) * d).sum())
