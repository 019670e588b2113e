"""The ``gguf`` writer: one ``model.gguf`` that an unmodified llama.cpp runs.

Every FFN (replaced or not) is written as a gated MLP with biases
(:mod:`compressor.output.gated`), of the width its replacement needs. What
llama.cpp can load decides the architecture written (verified against the
llama.cpp vendored by llama-cpp-python 0.3.36, ``src/models/*.cpp``):

* ``llama`` loads optional ``ffn_gate/up/down`` biases but creates every
  layer's FFN with layer 0's width (``hparams.n_ff()``), so it is written only
  when all widths are equal;
* ``qwen2`` creates every FFN at layer 0's width and loads no FFN bias (an
  extra tensor fails the load), so it is written only for an unchanged model;
* ``deci`` (Nemotron-NAS) creates each layer's FFN at ``n_ff(il)`` from the
  ``feed_forward_length`` array, loads optional FFN and q/k/v biases, and runs
  the Llama graph (RMSNorm, SiLU-gated FFN, "normal" RoPE). Llama-family models
  with unequal widths become ``deci``; so do Qwen2 models, whose q/k rows (and
  biases) are permuted from the NeoX RoPE layout to the normal one, as
  llama.cpp's converter does for Llama. A deci layer with width 0 also skips
  its attention residual, so no width is ever 0 (a constant FFN is one dead unit).

Tensors and metadata of a GGUF source are copied as they are (same
quantization) unless ``quant`` asks for another type; for a Hugging Face
source the tokenizer metadata is built from a byte-level BPE ``tokenizer.json``
(the common case; others are refused with the alternative).

Quantization (``quant``): ``source`` — a GGUF source's own types, tensor by
tensor (unchanged tensors copied byte for byte, new FFN tensors quantized by
ggml to the type the source used for that tensor); a Hugging Face source's
dtype. ``bf16``/``f16`` — written directly. ``q8_0``/``q4_k_m`` — written in
F16, then quantized by llama.cpp's own quantizer (``llama_model_quantize``,
its per-tensor mix rules). GGML quantizes in blocks along a row; the down
projection's rows are the layer's width, so a width that is not a multiple of
the block (32, or 256 for k-quants) is an error naming the layers, unless
``unquantizable`` is ``f16`` (those down projections stay F16, reported) or
``pad`` (dead units pad the width up: exact, but bytes and compute for nothing).

Verification runs the file in llama.cpp (llama-cpp-python) and compares its
perplexity on the probe text with the in-memory model's.

Modules, by concern: :mod:`.plan` (architecture, widths, types), :mod:`.naming` (tensor names, RoPE
layout), :mod:`.tensors` (the tensor list of a plan), :mod:`.metadata` (keys, tokenizer), :mod:`.encode`
(GGML types, llama.cpp's quantizer), :mod:`.write` (the file), :mod:`.read` (reading back, perplexity in
llama.cpp), :mod:`.check` (the checks against a budget or the source). Which model types are written, and
as what, is each type's row in :data:`compressor.core.archs.ARCHITECTURES` (``gguf_arch``,
``gguf_native``, ``gguf_native_ffn_bias``, ``gguf_per_layer``, ``gguf_refusal``).
"""

from __future__ import annotations

from compressor.output.gguf.check import GGUFGateMissed, planned_check, source_quant_check
from compressor.output.gguf.encode import PRESETS, GGUFWidthError, encode, ggml_quantize, quantize_file
from compressor.output.gguf.metadata import (
    PRE_TOKENIZERS, copy_source_metadata, hf_hparams, hf_tokenizer_metadata, llama3_rope_factors, tokenizer_problem,
)
from compressor.output.gguf.naming import REQUANTIZE_ARCH, ROPE_LAYOUT, Tensor, rope_permutation, to_file_rows
from compressor.output.gguf.plan import (
    QUANTS, UNQUANTIZABLE, Plan, Requantized, Uniform, arch_refusal, check_options, compression_widths, down_blocks,
    file_arch, plan_for, resolve_quant, width_error, writable, writer_plan,
)
from compressor.output.gguf.read import (  # _source_types: its cache is cleared by tests
    _source_types, gguf_summary, llama_cpp_perplexity, llama_cpp_window_nll, read_scores, source_down_block, source_tensor_types,
)
from compressor.output.gguf.target import GGUFTarget
from compressor.output.gguf.tensors import ffn_tensors, model_tensors, source_tensors
from compressor.output.gguf.write import llama_quantize, write_gguf, write_requantized
from compressor.output.gguf.writer import FILE_NAME, LLAMA_CPP_PIN, PPL_TOLERANCE, GGUFWriter, runtime_missing
from compressor.output.registry import Format, register_format

__all__ = [
    "FILE_NAME", "LLAMA_CPP_PIN", "PPL_TOLERANCE", "PRESETS", "PRE_TOKENIZERS", "QUANTS", "REQUANTIZE_ARCH",
    "ROPE_LAYOUT", "UNQUANTIZABLE", "GGUFGateMissed", "GGUFWidthError", "GGUFWriter", "Plan", "Tensor",
    "arch_refusal", "check_options", "compression_widths", "file_arch", "to_file_rows", "copy_source_metadata", "down_blocks", "encode",
    "ffn_tensors", "ggml_quantize", "gguf_summary", "hf_hparams", "hf_tokenizer_metadata", "llama3_rope_factors",
    "llama_cpp_perplexity", "llama_cpp_window_nll", "read_scores", "llama_quantize", "model_tensors", "plan_for",
    "planned_check", "quantize_file", "Requantized", "resolve_quant", "Uniform", "writer_plan", "rope_permutation", "runtime_missing",
    "source_down_block", "source_quant_check", "source_tensor_types", "source_tensors", "tokenizer_problem",
    "width_error", "writable", "write_gguf", "write_requantized", "_source_types",
]

register_format(Format("gguf", GGUFWriter, GGUFTarget))
