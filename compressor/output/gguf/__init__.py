"""The ``gguf`` format: one ``model.gguf`` that an unmodified llama.cpp runs, and its size target.

Every FFN (replaced or not) is written as a gated MLP with biases (:mod:`compressor.output.gated`) in the
architecture llama.cpp can load at those widths (``llama``, ``qwen2`` or ``deci``: each model type's row in
:data:`compressor.core.archs.ARCHITECTURES`); a GGUF source's tensors and metadata are copied as they are unless
another type is asked for; a size plan re-quantizes the converter's F16 tensor by tensor. Verification runs the
file in llama.cpp. Which architecture, quantization and widths are written, and why: docs/gguf.md.

Modules, by concern: :mod:`.writer` (the writer), :mod:`.plan` (architecture, widths, types), :mod:`.naming`
(tensor names, RoPE layout), :mod:`.tensors` (the tensor list of a plan), :mod:`.metadata` (keys, tokenizer),
:mod:`.encode` (GGML types, llama.cpp's quantizer), :mod:`.write` (the file), :mod:`.read` (reading back,
perplexity in llama.cpp), :mod:`.check` (checks against a budget or the source); the size target
:mod:`.target` with :mod:`.budget` (the F16 and llama.cpp's presets), :mod:`.pricing` (every GGML type's
options), :mod:`.imatrix` (the importance matrix, llama.cpp's file), :mod:`.experts`, :mod:`.converter`
(llama.cpp's own ``convert_hf_to_gguf.py``). Import each name from its module; this package registers the format
and exports only what a caller outside it needs.
"""

from __future__ import annotations

import logging

from compressor.output.gguf.check import GGUFGateMissed
from compressor.output.gguf.encode import GGUFWidthError
from compressor.output.gguf.target import GGUFTarget
from compressor.output.gguf.writer import FILE_NAME, LLAMA_CPP_PIN, PPL_TOLERANCE, GGUFWriter, runtime_missing
from compressor.output.registry import Format, register_format

__all__ = ["FILE_NAME", "LLAMA_CPP_PIN", "PPL_TOLERANCE", "GGUFGateMissed", "GGUFTarget", "GGUFWidthError",
           "GGUFWriter", "runtime_missing"]

register_format(Format("gguf", GGUFWriter, GGUFTarget))

# gguf-py says "This GGUF file is for Little Endian only" and lists every file it writes: heard at DEBUG only
if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
    logging.getLogger("gguf").setLevel(logging.WARNING)
