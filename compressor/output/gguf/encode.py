"""Tensor bytes: float32 values in a GGML type, and llama.cpp's own quantizer over a whole file.

Float types are converted with numpy (BF16 with gguf-py); quantized ones with ggml's
``ggml_quantize_chunk`` through :mod:`compressor.core.ggml`. ``q8_0``/``q4_k_m`` files are written in
F16 first, then quantized by ``llama_model_quantize`` (its per-tensor mix rules), whose native logging
is captured (:class:`_CapturedOutput`).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import numpy as np
import torch

from compressor.core import ggml
from compressor.core.errors import InputError
from compressor.core.presets import LLAMA_CPP_PRESETS
from compressor.output.gguf.naming import _gguf

logger = logging.getLogger(__name__)

#: quant → gguf-py's LlamaFileType name written in ``general.file_type``.
_FTYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
           "q4_k_m": "MOSTLY_Q4_K_M", "plan": "GUESSED"}
#: llama.cpp's presets a size can be named by (``output.size: Q3_K_M``) → gguf-py's LlamaFileType name.
PRESETS = {name: preset.file_type for name, preset in LLAMA_CPP_PRESETS.items()}


class GGUFWidthError(InputError):
    """An FFN width is not a multiple of the quantization block of its down projection (exit 2)."""


def encode(data: np.ndarray, qtype, imatrix: np.ndarray | None = None) -> np.ndarray:
    """float32 ``data`` in GGML type ``qtype``: numpy for float types, ggml's own quantizer
    (from llama-cpp-python's libggml; ``imatrix``: column weights) for quantized ones."""
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == Q.F32:
        return data
    if qtype == Q.F16:
        return data.astype(np.float16)
    if qtype == Q.BF16:
        return gguf.quants.quantize(data, Q.BF16)
    return ggml_quantize(data, qtype, imatrix)


def ggml_quantize(data: np.ndarray, qtype, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize rows with ggml's ``ggml_quantize_chunk`` (the code llama.cpp quantizes with)."""
    rows, n = data.reshape(-1, data.shape[-1]).shape
    block = ggml.BLOCKS[ggml.GGMLType(int(qtype))][0]
    if n % block:
        raise GGUFWidthError(f"row length {n} is not a multiple of {block} ({qtype.name})")
    if imatrix is None and ggml.requires_imatrix(ggml.GGMLType(int(qtype))):
        raise ValueError(f"GGML type {qtype.name} needs an importance matrix; use quant q4_k_m or q8_0")
    return ggml.quantize(data.reshape(rows, n), ggml.GGMLType(int(qtype)), imatrix)


class _CapturedOutput:
    """Send what native code prints on file descriptors 1 and 2 into :attr:`text` (llama.cpp logs
    every tensor it quantizes, and its Python log switch does not reach the quantizer); logged at
    DEBUG, and quoted when the call it wraps fails."""

    def __enter__(self):
        import sys
        import tempfile

        sys.stdout.flush()
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile()
        self.saved = [os.dup(1), os.dup(2)]
        for fd in (1, 2):
            os.dup2(self.file.fileno(), fd)
        return self

    def __exit__(self, *exc):
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)
        self.file.seek(0)
        self.text = self.file.read().decode("utf-8", "replace")
        self.file.close()
        logger.debug("llama.cpp output:\n%s", self.text)

    def tail(self, lines: int = 8) -> str:
        return "\n".join(self.text.strip().splitlines()[-lines:])


def quantize_file(src: Path, dst: Path, ftype: str, kept_f16: list[int] = (), imatrix=None,
                  imatrix_file: str | None = None) -> None:
    """``llama_model_quantize`` from ``src`` to ``dst`` at gguf-py's ``LlamaFileType`` name ``ftype``
    (llama.cpp's own per-tensor mix for that preset). ``imatrix``: an
    :class:`~compressor.output.gguf.imatrix.ImportanceMatrix`, handed over as ``llama-quantize --imatrix
    imatrix_file`` hands the file's (its values, and the ``quantize.imatrix.*`` keys it records); None: none."""
    import llama_cpp

    from compressor.output.gguf.imatrix import IMATRIX_FILE, CArrays

    gguf = _gguf()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(getattr(gguf.LlamaFileType, ftype))
    params.nthread = max(1, torch.get_num_threads())
    f16 = int(gguf.GGMLQuantizationType.F16)
    keep = [llama_cpp.llama_model_tensor_override(rf"^blk\.{i}\.ffn_down\.weight$".encode(), f16)
            for i in kept_f16]
    if keep:
        arr = (llama_cpp.llama_model_tensor_override * (len(keep) + 1))(*keep)  # last entry: NULL pattern
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    arrays = None
    if imatrix is not None:  # held until the quantizer returns: it reads the arrays' memory
        arrays = CArrays(imatrix.values(), imatrix.metadata(imatrix_file or IMATRIX_FILE))
        arrays.set_on(params)
    with _CapturedOutput() as out:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed ({rc}) turning {src.name} into {ftype}"
                           f"{' with an importance matrix' if arrays is not None else ''}:\n{out.tail()}")
