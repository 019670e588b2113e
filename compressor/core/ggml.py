"""GGML tensor types: sizes, and quantizing with ggml's own code.

Quantization calls ``ggml_quantize_chunk`` from the libggml that
llama-cpp-python ships (the function llama.cpp's quantizer calls), optionally
with an importance matrix: one non-negative weight per input column, which the
quantizer uses to weight each element's rounding error (llama.cpp's
``llama-imatrix`` passes the mean squared activation of that column).
Dequantization uses gguf-py's numpy reference. Both are imported on first use,
so this module costs nothing to import.

>>> bytes_per_row(GGMLType.Q4_0, 64) if has_gguf() else 36      # two blocks of 18 bytes
36
"""

from __future__ import annotations

import ctypes
import functools
from enum import IntEnum

import numpy as np


class GGMLType(IntEnum):
    """The GGML types the size planner considers (values are ggml's ``enum ggml_type``)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    IQ1_M = 29
    BF16 = 30

    @classmethod
    def known(cls, value: int) -> "GGMLType | None":
        """The type of ggml's enum value ``value``, or None for one the planner does not consider."""
        try:
            return cls(int(value))
        except ValueError:
            return None

    @property
    def quantized(self) -> bool:
        """Whether the type stores blocks of scaled integers (not a float type)."""
        return self not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


#: (elements per block, bytes per block), as ggml defines them (gguf-py's GGML_QUANT_SIZES).
BLOCKS: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20), GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34), GGMLType.IQ4_NL: (32, 18),
    GGMLType.Q2_K: (256, 84), GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144), GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210), GGMLType.IQ4_XS: (256, 136), GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ3_XXS: (256, 98), GGMLType.IQ2_S: (256, 82), GGMLType.IQ2_XS: (256, 74), GGMLType.IQ2_XXS: (256, 66),
    GGMLType.IQ1_M: (256, 56), GGMLType.IQ1_S: (256, 50),
}


def has_gguf() -> bool:
    try:
        import gguf  # noqa: F401
    except ImportError:
        return False
    return True


def bits_per_weight(t: GGMLType) -> float:
    block, nbytes = BLOCKS[GGMLType(t)]
    return 8.0 * nbytes / block


def fits(t: GGMLType, n_per_row: int) -> bool:
    """Whether rows of ``n_per_row`` elements are a whole number of ``t``'s blocks."""
    return n_per_row % BLOCKS[GGMLType(t)][0] == 0


def bytes_per_row(t: GGMLType, n_per_row: int) -> int:
    block, nbytes = BLOCKS[GGMLType(t)]
    if n_per_row % block:
        raise ValueError(f"row length {n_per_row} is not a multiple of {block} ({GGMLType(t).name})")
    return n_per_row // block * nbytes


@functools.lru_cache(maxsize=1)
def _lib():
    import llama_cpp._ggml as ggml_lib

    lib = ggml_lib.libggml
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    return lib


def requires_imatrix(t: GGMLType) -> bool:
    return bool(_lib().ggml_quantize_requires_imatrix(int(t)))


def quantize(data: np.ndarray, t: GGMLType, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Rows of float32 ``data`` (``[..., n]``) in type ``t`` as raw bytes ``[rows, row_bytes]``, by ggml's
    ``ggml_quantize_chunk``; ``imatrix``: ``n`` non-negative column weights (None: unweighted)."""
    t = GGMLType(t)
    src = np.ascontiguousarray(data, dtype=np.float32)
    rows, n = src.reshape(-1, src.shape[-1]).shape
    row_bytes = bytes_per_row(t, n)
    weights = None
    if imatrix is not None:
        weights = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        if weights.shape[0] != n:
            raise ValueError(f"imatrix has {weights.shape[0]} weights for rows of {n}")
        if not np.all(np.isfinite(weights)) or (weights < 0).any():
            raise ValueError("imatrix weights must be finite and non-negative")
    elif requires_imatrix(t):
        raise ValueError(f"GGML type {t.name} needs an importance matrix")
    out = np.empty((rows, row_bytes), dtype=np.uint8)
    written = _lib().ggml_quantize_chunk(int(t), src.ctypes.data, out.ctypes.data, 0, rows, n,
                                         None if weights is None else weights.ctypes.data)
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


def dequantize(raw: np.ndarray, t: GGMLType, n_per_row: int) -> np.ndarray:
    """float32 ``[rows, n_per_row]`` from raw bytes of type ``t`` (gguf-py's reference decoder)."""
    import gguf.quants

    t = GGMLType(t)
    if t == GGMLType.F32:
        return np.asarray(raw, dtype=np.float32).reshape(-1, n_per_row)
    if t == GGMLType.F16:
        return np.asarray(raw, dtype=np.float16).astype(np.float32).reshape(-1, n_per_row)
    out = gguf.quants.dequantize(np.asarray(raw, dtype=np.uint8), gguf.GGMLQuantizationType(int(t)))
    return np.asarray(out, dtype=np.float32).reshape(-1, n_per_row)


def roundtrip(data: np.ndarray, t: GGMLType, imatrix: np.ndarray | None = None) -> np.ndarray:
    """``dequantize(quantize(data))``: what the runtime computes with in place of ``data``."""
    data = np.asarray(data, dtype=np.float32)
    n = data.shape[-1]
    if t == GGMLType.F32:
        return data.reshape(-1, n).copy()
    if t == GGMLType.F16:
        return data.astype(np.float16).astype(np.float32).reshape(-1, n)
    if t == GGMLType.BF16:
        import torch

        return torch.from_numpy(data.reshape(-1, n)).to(torch.bfloat16).float().numpy()
    return dequantize(quantize(data, t, imatrix), t, n)
