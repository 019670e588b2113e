"""Integer weight grids as compressed-tensors stores them and vLLM serves them, and rounding onto them.

A scheme (:class:`IntScheme`) is what a ``config_groups`` entry of a compressed-tensors checkpoint says
about a weight: ``num_bits``-bit signed integers, symmetric, one scale per ``group_size`` consecutive
inputs of a row (or per row). The presets mirror the library's own (``W4A16``, ``W8A16``: int, symmetric,
group 128, in compressed-tensors 0.20) plus ``W4A16_G32``; ``None`` means "left in the float dtype".

Rounding follows the library's rules exactly, so the codes computed here are the codes its
``pack-quantized`` compressor stores:

* scale = absmax of the group / ((qmax − qmin) / 2) (``calculate_qparams`` with the memoryless min-max
  observer llm-compressor uses for weights: absmax / 7.5 for int4, / 127.5 for int8), rounded to the
  dtype the scales are stored in, an all-zero group given the dtype's eps;
* code = clamp(round_half_even(w / scale), qmin, qmax); the value is code · scale.

:func:`rtn` rounds each weight to its nearest code. :func:`gptq` re-chooses the codes column by column
and moves each column's rounding error onto the columns not yet rounded through the layer's input second
moment Ĥ (GPTQ, Frantar et al. 2022; lazy batch updates through the Cholesky factor of the damped Ĥ⁻¹,
shared with :mod:`compressor.fitting.gridround`). A group's scale is fixed from the updated weights when
its first column is reached, so no ``g_idx`` is needed in the file.

    s = SCHEMES["W4A16"]
    r = gptq(W, H, s)                                  # r.weight: the values the file decodes to
    err = output_error(W, r.weight, H)                 # Σ_rows ΔW Ĥ ΔWᵀ
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from compressor.core.presets import CT_SCHEMES
from compressor.fitting.gridround import BLOCK, DAMP, factor_for, output_error

__all__ = ["FAMILIES", "IntScheme", "Rounded", "SCHEMES", "UNQUANTIZED", "get_scheme", "gptq", "output_error", "rtn",
           "scales_of", "weight_bytes"]

#: Names that mean "leave this layer in the float dtype" (``None`` does too).
UNQUANTIZED = ("none", "unquantized")

#: Bytes of ``weight_shape``: the compressor stores the original ``[out, in]`` as an int64 tensor.
_SHAPE_BYTES = 2 * 8


@dataclass(frozen=True)
class IntScheme:
    """A signed integer weight grid as a compressed-tensors ``QuantizationArgs`` describes it."""

    name: str
    """The name recipes and the ``ct_schemes`` map use (``W4A16``…)."""
    num_bits: int
    """Bits per code, 2 to 8 (what ``pack-quantized`` packs into int32 words)."""
    group_size: int | None
    """Inputs sharing one scale; None: one scale per output row (``strategy: channel``)."""
    symmetric: bool = True
    """Only symmetric grids (no zero point) are written; vLLM's W4A16/W8A16 kernels take those."""

    def __post_init__(self):
        if not isinstance(self.num_bits, int) or not 2 <= self.num_bits <= 8:
            raise ValueError(f"IntScheme {self.name!r}: num_bits must be an int from 2 to 8, got {self.num_bits!r}")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise ValueError(f"IntScheme {self.name!r}: group_size must be a positive int or None (one scale per "
                             f"row), got {self.group_size!r}")
        if not self.symmetric:
            raise ValueError(f"IntScheme {self.name!r}: symmetric must be True; asymmetric grids (zero points) are "
                             "not written")

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    def fits(self, in_features: int) -> bool:
        """Whether rows of ``in_features`` inputs split into whole groups."""
        return self.group_size is None or in_features % self.group_size == 0

    def groups(self, in_features: int) -> int:
        """Scales per row."""
        if not self.fits(in_features):
            raise ValueError(f"{self.name}: group {self.group_size} does not divide rows of {in_features} inputs")
        return 1 if self.group_size is None else in_features // self.group_size

    def nbytes(self, out_features: int, in_features: int, scale_dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of the tensors ``pack-quantized`` stores for an ``[out, in]`` weight: ``weight_packed``
        (int32, ``ceil(in · bits / 32)`` words per row), ``weight_scale`` (``[out, groups]`` in
        ``scale_dtype``, the dtype the rest of the checkpoint is saved in) and ``weight_shape`` (two int64).
        A bias is stored apart, unquantized. The safetensors header (a JSON index) is not counted."""
        packed = out_features * math.ceil(in_features * self.num_bits / 32) * 4
        scales = out_features * self.groups(in_features) * _itemsize(scale_dtype)
        return packed + scales + _SHAPE_BYTES

    def bits_per_weight(self, out_features: int, in_features: int,
                        scale_dtype: torch.dtype = torch.bfloat16) -> float:
        """:meth:`nbytes` in bits per weight element."""
        return 8 * self.nbytes(out_features, in_features, scale_dtype) / (out_features * in_features)

    def to_args(self):
        """The library's ``QuantizationArgs`` for the weights (needs ``compressed-tensors``)."""
        from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType

        return QuantizationArgs(
            num_bits=self.num_bits, type=QuantizationType.INT, symmetric=self.symmetric,
            strategy=QuantizationStrategy.GROUP if self.group_size else QuantizationStrategy.CHANNEL,
            group_size=self.group_size, dynamic=False)

    def to_scheme(self, targets: list[str], format: str | None = "pack-quantized"):
        """The library's ``QuantizationScheme`` (weights only, activations left in 16 bits) for ``targets``."""
        from compressed_tensors.quantization import QuantizationScheme

        return QuantizationScheme(targets=list(targets), weights=self.to_args(), format=format)


#: The schemes a recipe may name. W4A16 and W8A16 are compressed-tensors' presets of those names
#: (tests/test_ctensors.py checks them against ``preset_name_to_scheme``); the others are the group sizes
#: vLLM's W4A16/W8A16 kernels also take (64, 32, one scale per row), for rows 128 does not divide (SmolLM2's
#: 576 inputs: llm-compressor's W4A16 refuses that model), for finer scales where they pay, and (one int4 scale
#: per row, 4.0 bits) for the bytes a size plan moves to the layers that need them.
SCHEMES: dict[str, IntScheme] = {name: IntScheme(name, bits, group) for name, (bits, group) in CT_SCHEMES.items()}
#: A size named after a scheme, on a model whose rows its group does not divide: the same bits with the
#: largest group that divides them, in this order (what llm-compressor's W4A16 would need a group_size for).
FAMILIES: dict[str, tuple[str, ...]] = {
    "W4A16": ("W4A16", "W4A16_G64", "W4A16_G32"), "W4A16_G64": ("W4A16_G64", "W4A16_G32"),
    "W4A16_G32": ("W4A16_G32",), "W4A16_CH": ("W4A16_CH",), "W8A16": ("W8A16", "W8A16_CH"),
    "W8A16_CH": ("W8A16_CH",)}


def get_scheme(name: str | IntScheme | None) -> IntScheme | None:
    """The scheme called ``name`` (an :class:`IntScheme` passes through); None for None, ``"none"`` or
    ``"unquantized"``. ``ValueError`` lists the names that exist."""
    if name is None or isinstance(name, IntScheme):
        return name
    if str(name).lower() in UNQUANTIZED:
        return None
    found = SCHEMES.get(str(name).upper())
    if found is None:
        raise ValueError(f"unknown integer weight scheme {name!r}; known: {', '.join(SCHEMES)}, or None / "
                         f"{' / '.join(repr(u) for u in UNQUANTIZED)} for a layer left in the float dtype")
    return found


def weight_bytes(scheme: IntScheme | str | None, out_features: int, in_features: int,
                 dtype: torch.dtype = torch.bfloat16) -> int:
    """Stored bytes of an ``[out, in]`` weight under ``scheme`` (None: unquantized, in ``dtype``)."""
    s = get_scheme(scheme)
    return out_features * in_features * _itemsize(dtype) if s is None else s.nbytes(out_features, in_features, dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Rounded(NamedTuple):
    """A weight rounded onto a scheme's grid."""

    weight: torch.Tensor
    """float32 ``[out, in]``: ``ints · scales``, the values the checkpoint decodes to (exact: a code of at
    most 8 bits times a scale of at most 16 significant bits fits float32)."""
    scales: torch.Tensor
    """``[out, groups]`` in the scale dtype: the stored ``weight_scale``."""
    ints: torch.Tensor
    """int8 ``[out, in]``: the codes, in ``[qmin, qmax]``."""


def decoded(r: Rounded, rows=slice(None)) -> torch.Tensor:
    """``ints · scales`` of ``rows`` (default all) in float32: the values the checkpoint decodes to, bit for bit."""
    ints, scales = r.ints[rows], r.scales[rows]
    per = ints.shape[1] // scales.shape[1]
    return ints.float() * scales.float().repeat_interleave(per, dim=1)


def _as_float32(weight) -> np.ndarray:
    w = weight.detach().cpu().float().numpy() if isinstance(weight, torch.Tensor) else np.asarray(weight, np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weight has non-finite values")
    return np.ascontiguousarray(w, dtype=np.float32)


def _check(scheme: IntScheme, n: int) -> IntScheme:
    s = get_scheme(scheme)
    if s is None:
        raise ValueError("an unquantized layer has no grid to round onto")
    if not s.fits(n):
        raise ValueError(f"{s.name}: group {s.group_size} does not divide rows of {n} inputs; pick a scheme whose "
                         "group divides the row, or leave the layer unquantized")
    return s


def scales_of(weight, scheme: IntScheme, scale_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[out, groups]`` scales in ``scale_dtype`` by compressed-tensors' rule (module docstring)."""
    w = _as_float32(weight)
    s = _check(scheme, w.shape[1])
    return _scales(w.reshape(w.shape[0], s.groups(w.shape[1]), -1), s, scale_dtype)


def _scales(groups: np.ndarray, scheme: IntScheme, scale_dtype: torch.dtype) -> torch.Tensor:
    """Scales of ``groups`` (``[..., group_size]`` float32, reduced over the last axis), in ``scale_dtype``."""
    absmax = torch.from_numpy(np.abs(groups).max(axis=-1))
    half_range = torch.tensor((scheme.qmax - scheme.qmin) / 2, dtype=torch.float32)
    s = (absmax / half_range).to(scale_dtype)
    return torch.where(s == 0, torch.tensor(torch.finfo(scale_dtype).eps, dtype=scale_dtype), s)


def _codes(w: np.ndarray, s: np.ndarray, scheme: IntScheme) -> np.ndarray:
    """The library's ``quantize``: clamp(round_half_even(w / s)); float32 division, as torch computes it."""
    return np.clip(np.round(w / s), scheme.qmin, scheme.qmax)


def rtn(weight, scheme: IntScheme | str, *, scale_dtype: torch.dtype = torch.bfloat16) -> Rounded:
    """Round-to-nearest onto ``scheme``'s grid with the library's scales: what llm-compressor's
    ``QuantizationModifier`` (no GPTQ) stores for a weight of these values.

    >>> r = rtn(torch.randn(8, 256), "W4A16")
    >>> r.ints.shape, r.scales.shape
    (torch.Size([8, 256]), torch.Size([8, 2]))
    """
    w = _as_float32(weight)
    s = _check(get_scheme(scheme), w.shape[1])
    rows, n = w.shape
    g = w.reshape(rows, s.groups(n), -1)
    scales = _scales(g, s, scale_dtype)
    sv = scales.float().numpy()[..., None]
    q = _codes(g, sv, s)
    return Rounded(torch.from_numpy((q * sv).reshape(rows, n).astype(np.float32)), scales,
                   torch.from_numpy(q.reshape(rows, n).astype(np.int8)))


def gptq(weight, h, scheme: IntScheme | str, *, damp: float = DAMP, block: int = BLOCK,
         scale_dtype: torch.dtype = torch.bfloat16, static_groups: bool = False,
         act_order: bool = False, decode: bool = True) -> Rounded:
    """GPTQ onto ``scheme``'s grid: ``weight`` ``[out, in]``, ``h`` its input second moment Ĥ ``[in, in]``
    (any positive multiple: the damping is relative) or a :func:`~compressor.fitting.gridround.factor` of it
    made with the same ``damp`` and ``act_order`` (one solve shared by every scheme a layer is tried in).

    Columns are rounded in order (``act_order``: in descending diag Ĥ, which needs ``static_groups``), each
    column's error spread over the later ones through the damped Ĥ's Cholesky factor (in GPTQ's nearest-plane
    form, :func:`~compressor.fitting.gridround.factor`), ``block`` columns between two lazy updates of the rest.
    A group's scales are fixed from the *updated* weights of the whole group when its first column is reached
    (with every earlier column's correction, so the result does not depend on ``block``); ``static_groups``:
    every scale from the original weights first,
    as llm-compressor does. A per-row scheme takes its scales from the original weights. An input column
    that never fires (Ĥ_jj = 0) neither gives nor takes corrections: it is rounded to nearest (GPTQ zeroes
    it; a column silent on the calibration text may fire on other text). With Ĥ = I the result is
    :func:`rtn`'s.

    Rows are rounded independently (scales are per row, the error moves along a row), so a tall weight goes
    :data:`ROW_CHUNK` elements at a time, held and worked in float32 one chunk at a time: an untied output
    head of 152k × 1,536 took six float32 copies of itself at once (the 8.15 GB peak of an onloaded
    Qwen2.5-1.5B plan). The chunks are fixed by the shape alone, so a layer gets the same codes however the
    model is held. ``decode=False``: :attr:`Rounded.weight` is None (the codes and scales are what a file
    stores; :func:`decoded` makes the weight when it is needed).

    >>> W = torch.randn(8, 256)
    >>> bool((gptq(W, torch.eye(256), "W4A16").ints == rtn(W, "W4A16").ints).all())
    True
    """
    shape = tuple(weight.shape)
    if len(shape) != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {shape}")
    rows, n = shape
    s = _check(get_scheme(scheme), n)
    if not block >= 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if act_order and not static_groups and s.group_size is not None:
        raise ValueError("act_order with grouped scales needs static_groups=True: scales fixed at a group's first "
                         "column of a permuted order would need a g_idx in the file")
    f = factor_for(h, n, damp=damp, act_order=act_order)
    gs = s.group_size or n
    ints = np.empty((rows, n), dtype=np.int8)
    scales = np.empty((rows, n // gs), dtype=np.float32)
    step = max(1, ROW_CHUNK // n)
    fixed = static_groups or s.group_size is None
    spread = f.r if fixed else _running_spread(f)
    for r in range(0, rows, step):
        ints[r:r + step], scales[r:r + step] = _gptq_rows(_as_float32(weight[r:r + step]), f.order, spread, s, gs,
                                                          block, scale_dtype, fixed)
    out = Rounded(None, torch.from_numpy(scales).to(scale_dtype), torch.from_numpy(ints))
    return out._replace(weight=decoded(out)) if decode else out


#: Elements (rows × inputs) of a weight :func:`gptq` rounds at once: its working arrays (the weights in
#: rounding order, the codes) are a few float32 copies of them, about 0.2 GB.
ROW_CHUNK = 1 << 24


def _running_spread(f) -> np.ndarray:
    """``−R̂⁻¹`` of the factor ``f`` (GPTQ's inverse factor, each row over its diagonal): what spreads the errors of
    the corrected weights onto the later columns, so that a group's weights as corrected so far are GPTQ's own
    running state — what a scale fitted to them needs. A triangular inverse, made once a weight, only for such
    scales; fixed scales read :attr:`~compressor.fitting.gridround.Factor.r` itself."""
    r = torch.from_numpy(f.r)
    return -torch.linalg.solve_triangular(r, torch.eye(r.shape[0]), upper=True, unitriangular=True).numpy()


def _gptq_rows(w: np.ndarray, o: np.ndarray, V: np.ndarray, s: IntScheme, gs: int, block: int,
               scale_dtype: torch.dtype, fixed: bool) -> tuple[np.ndarray, np.ndarray]:
    """:func:`gptq` of the float32 rows ``w`` rounded in the column order ``o``: int8 codes ``[rows, n]`` and
    float32 scales ``[rows, groups]`` (values of ``scale_dtype``). ``fixed``: every scale from the original
    weights, the errors measured on them and spread by ``V`` = R̂ (the nearest-plane form); else the errors of
    the corrected weights, spread by ``V`` = :func:`_running_spread`."""
    rows, n = w.shape
    groups = n // gs
    Wt = np.ascontiguousarray(w[:, o].T)  # [n, rows] in rounding order: a column is a contiguous row
    gidx = o // gs  # each position's group, in original column numbering
    S = np.empty((groups, rows), dtype=np.float32)
    if fixed:
        S[:] = _scales(w.reshape(rows, groups, gs), s, scale_dtype).float().numpy().T
    E = Wt.copy() if fixed else None  # the original weights, where the errors are measured on them
    Q = np.empty((n, rows), dtype=np.int8)
    err = np.empty((block, rows), dtype=np.float32)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        for j in range(i1, i2):
            if not fixed and j % gs == 0:
                # the whole group as updated so far: earlier batches' lazy updates are in Wt, this batch's
                # corrections (columns i1..j-1) are gathered here
                G = Wt[j:j + gs] + V[i1:j, j:j + gs].T @ err[:j - i1]
                S[gidx[j]] = _scales(G.T[None], s, scale_dtype).float().numpy()[0]
            w_j = Wt[j] + V[i1:j, j] @ err[:j - i1]
            sc = S[gidx[j]]
            q = _codes(w_j, sc, s)
            Q[j] = q
            err[j - i1] = (w_j if E is None else E[j]) - q * sc
        if i2 < n:
            Wt[i2:] += V[i1:i2, i2:].T @ err[:i2 - i1]
    return Q[np.argsort(o)].T, S.T
