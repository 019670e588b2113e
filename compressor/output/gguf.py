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
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from compressor.core.archs import ARCHITECTURES, ArchSpec, find_blocks
from compressor.core.errors import InputError
from compressor.core.modeling import AffineFFN, HiddenUnitFFN, LowRankAffineFFN
from compressor.output.base import VerificationError, WriteRequest, Writer, register_writer
from compressor.output.gated import GatedMLP, NotRepresentableError, as_gated
from compressor.recipe.schema import OutputConfig

logger = logging.getLogger(__name__)

FILE_NAME = "model.gguf"
QUANTS: tuple[str, ...] = typing.get_args(OutputConfig.model_fields["gguf_quant"].annotation)
UNQUANTIZABLE: tuple[str, ...] = typing.get_args(OutputConfig.model_fields["gguf_unquantizable"].annotation)
#: Relative perplexity tolerance of the llama.cpp check at unquantized types. Measured: see docs/gguf.md.
PPL_TOLERANCE = 5e-3
LLAMA_CPP_PIN = "llama-cpp-python==0.3.36"


@dataclass(frozen=True)
class ArchRow:
    """How one Hugging Face model type is written."""

    native: str
    """llama.cpp architecture when every layer has one width."""
    native_ffn_bias: bool
    """Whether ``native`` loads FFN biases."""
    per_layer: str = "deci"
    """llama.cpp architecture for per-layer widths (and FFN biases)."""


#: Hugging Face model type → how it is written; a new architecture is a row here and a test.
ARCHS: dict[str, ArchRow] = {
    "llama": ArchRow("llama", native_ffn_bias=True),
    "mistral": ArchRow("llama", native_ffn_bias=True),
    "qwen2": ArchRow("qwen2", native_ffn_bias=False),
}
#: llama.cpp architecture → RoPE row layout of attn_q/attn_k: "norm" (pairs interleaved; Hugging Face
#: rows are permuted) or "neox" (Hugging Face order).
ROPE_LAYOUT = {"llama": "norm", "deci": "norm", "qwen2": "neox"}
#: Why the architectures outside :data:`ARCHS` are refused, with the alternative.
REFUSED = {
    "qwen3": "llama.cpp's qwen3 builds every FFN at layer 0's width with no FFN bias, and its only "
             "per-layer-width Llama-like architecture (deci) has no q/k norm",
    "gemma3_text": "llama.cpp's gemma3 builds every FFN at layer 0's width with no FFN bias, and its FFN is "
                   "GELU-gated with a post-FFN norm, which deci does not have",
    "gpt2": "its FFN is a plain GELU MLP (no gate); llama.cpp's gpt2 has one width for all layers",
    "gpt_neox": "its FFN is a plain GELU MLP (no gate); llama.cpp's gptneox has one width for all layers",
}
_REPLACEMENTS = (AffineFFN, LowRankAffineFFN, HiddenUnitFFN)
_FFN_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(weight|bias)$")
_HF_ARCH = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2"}  # gguf-py tensor-name maps
#: Model types whose GGUF source the size planner re-quantizes tensor by tensor (widths unchanged, the
#: source's own architecture and metadata): gguf-py's tensor-name map for each.
REQUANTIZE_ARCH = {**_HF_ARCH, "gemma3_text": "GEMMA3", "gemma3": "GEMMA3", "qwen3": "QWEN3"}


class GGUFWidthError(InputError):
    """An FFN width is not a multiple of the quantization block of its down projection (exit 2)."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("the gguf format needs gguf-py: pip install 'compressor[gguf]'") from None
    return gguf


def arch_refusal(model_type: str) -> str | None:
    """Why a ``model_type`` cannot be written as GGUF, with the alternative (None when it can)."""
    return None if model_type in ARCHS else _refusal(model_type)


def runtime_missing() -> str | None:
    """Why gguf-py or llama-cpp-python cannot be used (None when both can)."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        return "the gguf format needs gguf-py: pip install 'compressor[gguf]' (or bash tools/setup.sh)"
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken build fails its import with anything
        return (f"the gguf format verifies its file in llama.cpp, but llama-cpp-python is not importable ({e}). "
                f"Install it with `bash tools/setup.sh` (builds {LLAMA_CPP_PIN} from source; cmake and a C++ "
                "compiler needed), or leave gguf out of output.formats")
    return None


def check_options(options: dict) -> str | None:
    """Why the writer options are invalid (None when valid)."""
    quant = options.get("quant", "source")
    if quant not in QUANTS:
        return f"gguf quant {quant!r} is not one of {', '.join(QUANTS)}"
    how = options.get("unquantizable", "error")
    if how not in UNQUANTIZABLE:
        return f"gguf unquantizable {how!r} is not one of {', '.join(UNQUANTIZABLE)}"
    return None


# --------------------------------------------------------------------------------------------------
# Planning: architecture, widths, tensor types
# --------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What will be written: the llama.cpp architecture, every layer's gated FFN and the tensor types."""

    model_type: str
    arch: str
    ffns: list[GatedMLP]
    replaced: list[bool]
    quant: str
    """source | bf16 | f16 | f32 | q8_0 | q4_k_m (``source`` only for a GGUF source)."""
    source_gguf: Path | None
    kept_f16: list[int] = field(default_factory=list)
    """Layers whose down projection stays F16 (``unquantizable: f16``)."""
    padded: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Layer → (fitted width, written width) for ``unquantizable: pad``."""
    size_plan: object = None
    """quant ``plan``: the size planner's choice (:class:`compressor.policy.quantplan.SizePlan`): a GGML type
    and an importance matrix per tensor."""

    @property
    def widths(self) -> list[int]:
        return [g.width for g in self.ffns]


def resolve_quant(quant: str, request: WriteRequest) -> str:
    """``source`` stays ``source`` for a GGUF source; for a Hugging Face source it is the saved dtype."""
    if quant != "source" or request.source.gguf_file:
        return quant
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}.get(request.dtype, "f32")


def down_blocks(quant: str, n_layers: int, source_types: dict) -> list[int]:
    """Per layer, the multiple its width must be: the quantization block of its down projection, whose
    rows are as long as the width (1 for float types). ``source_types``: the source GGUF's tensor types."""
    gguf = _gguf()
    if quant == "source":
        f16 = gguf.GGMLQuantizationType.F16
        return [gguf.GGML_QUANT_SIZES[source_types.get(f"blk.{i}.ffn_down.weight", f16)][0] for i in range(n_layers)]
    return [{"q8_0": 32, "q4_k_m": 256}.get(quant, 1)] * n_layers  # plan: the planner offers fitting types


def width_error(quant: str, bad: list[tuple[int, int, int]]) -> GGUFWidthError:
    """The error for ``bad`` = [(layer, width, multiple)]: which layers, the multiple, the ways out."""
    listed = ", ".join(f"layer {i} width {w} (needs a multiple of {b})" for i, w, b in bad)
    return GGUFWidthError(
        f"gguf quant {quant!r}: GGML quantizes the down projection in blocks along its rows, whose length is the "
        f"layer's FFN width; {listed}. Choose widths in those multiples, or set the gguf option unquantizable to "
        "f16 (keep those down projections in F16) or pad (append dead units up to the multiple), or use quant "
        "f16/bf16")


def compression_widths(compression: dict, config: dict) -> dict[int, int]:
    """Layer → FFN width of every replaced block of a saved ``compression`` section (no model needed)."""
    hidden = int(config["hidden_size"])
    out = {}
    for entry in compression.get("blocks", []):
        kind, c = entry.get("kind") or entry.get("replacement"), entry.get("config") or entry
        if kind in (None, "none"):
            continue
        layer = int(re.findall(r"\d+", entry["module"])[-1])
        units = int(c.get("units") or 0)
        out[layer] = {"affine": hidden, "low_rank": int(c.get("rank") or 0), "prune": max(units, 1),
                      "hybrid": units + hidden}[kind]
    return out


def _arch(model: nn.Module) -> tuple[str, ArchSpec]:
    """The base model type (a reloaded compressor folder says ``compressed_<type>``) and its row."""
    model_type = str(getattr(model.config, "model_type", "")).removeprefix("compressed_")
    if model_type not in ARCHS or model_type not in ARCHITECTURES:
        raise NotRepresentableError(_refusal(model_type))
    return model_type, ARCHITECTURES[model_type]


def plan_for(request: WriteRequest, options: dict) -> Plan:
    """Convert every FFN to a gated MLP, fit the widths to the quantization and choose the architecture."""
    model = request.model
    model_type, spec = _arch(model)
    _, blocks = find_blocks(model, spec)
    hidden = model.config.hidden_size
    modules = [b.get_submodule(spec.ffn_out) for b in blocks]
    ffns = [as_gated(m, spec.ffn_up, spec.ffn_down, in_features=hidden) for m in modules]
    replaced = [isinstance(m, _REPLACEMENTS) for m in modules]
    size_plan = options.get("size_plan")
    quant = "plan" if size_plan is not None else resolve_quant(options.get("quant", "source"), request)
    src = Path(request.source.path) / request.source.gguf_file if quant == "source" else None
    plan = Plan(model_type, "", ffns, replaced, quant, src, size_plan=size_plan)
    types = source_tensor_types(src) if src is not None else {}
    how = options.get("unquantizable", "error")
    bad = []
    for i, (g, block) in enumerate(zip(ffns, down_blocks(quant, len(ffns), types))):
        if not replaced[i] or g.width % block == 0:
            continue
        if how == "pad":
            plan.ffns[i] = g.padded(block)
            plan.padded[i] = (g.width, plan.ffns[i].width)
        elif how == "f16":
            plan.kept_f16.append(i)
        else:
            bad.append((i, g.width, block))
    if bad:
        raise width_error(options.get("quant", "source"), bad)
    if plan.padded:
        logger.warning("gguf: padded FFN widths with dead units to the quantization block: %s",
                       ", ".join(f"layer {i} {a}→{b}" for i, (a, b) in plan.padded.items()))
    if plan.kept_f16:
        logger.warning("gguf: down projections kept in F16 (width not a multiple of the block): layers %s",
                       plan.kept_f16)
    row = ARCHS[model_type]
    needs_bias = any(any(g.has_bias.values()) for g in plan.ffns)
    equal = len(set(plan.widths)) == 1
    plan.arch = row.native if equal and (row.native_ffn_bias or not needs_bias) else row.per_layer
    return plan


def _refusal(model_type: str) -> str:
    why = REFUSED.get(model_type, "no llama.cpp architecture for it is mapped here")
    return (f"model type {model_type!r} cannot be written as GGUF: {why}. Supported: {', '.join(sorted(ARCHS))}. "
            "Use output.formats: [hf] for this model")


# --------------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------------


def _tensor_types(reader) -> dict:
    return {t.name: t.tensor_type for t in reader.tensors}


def source_tensor_types(path: str | Path) -> dict:
    """Tensor name → GGML type of the GGUF at ``path``, read once per file version: the checks before
    loading, the width check and the plan all ask about the same source (a 1 GB file's table)."""
    p = Path(path)
    st = p.stat()
    return dict(_source_types(str(p.resolve()), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _source_types(path: str, size: int, mtime_ns: int) -> dict:
    return _tensor_types(_gguf().GGUFReader(path))


def source_down_block(path: str | Path) -> int:
    """The quantization block a width must be a multiple of to keep the source's FFN down-projection
    types (the lcm over layers; 1 for float types)."""
    gguf = _gguf()
    types = {t for name, t in source_tensor_types(path).items() if name.endswith("ffn_down.weight")}
    return math.lcm(1, *(gguf.GGML_QUANT_SIZES[t][0] for t in types))


def rope_permutation(n_rows: int, n_head: int) -> np.ndarray:
    """Row order taking attn_q/attn_k from the NeoX (Hugging Face) RoPE layout to the normal one:
    within each head, the first and second halves interleave."""
    half = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, 2, half).swapaxes(1, 2).reshape(-1)


@dataclass
class Tensor:
    name: str
    data: np.ndarray
    """float32 values, or raw bytes ``[rows, row_bytes]`` of ``raw_type``."""
    raw_type: object = None


def _permute_qk(name: str, data: np.ndarray, config) -> np.ndarray:
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    heads = n_head if ".attn_q." in name else n_kv
    return data[rope_permutation(data.shape[0], heads)]


def _needs_permute(name: str, from_layout: str, to_layout: str) -> bool:
    return from_layout != to_layout and (".attn_q." in name or ".attn_k." in name)


def model_tensors(model: nn.Module, plan: Plan) -> list[Tensor]:
    """Every tensor of the in-memory model except the FFNs, GGUF-named, float32."""
    gguf = _gguf()
    model_type, spec = _arch(model)
    path, blocks = find_blocks(model, spec)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, _HF_ARCH[model_type]), len(blocks))
    ffn_prefixes = tuple(f"{path}.{i}.{spec.ffn_out}." for i in range(len(blocks)))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out = []
    for hf_name, t in model.state_dict().items():
        if hf_name.startswith(ffn_prefixes):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise NotRepresentableError(f"no GGUF tensor name for {hf_name!r} of a {model_type} model")
        if name == "output.weight" and tied:
            continue  # llama.cpp falls back to token_embd
        data = t.detach().float().cpu().numpy()
        if _needs_permute(name, "neox", ROPE_LAYOUT[plan.arch]):
            data = _permute_qk(name, data, model.config)
        out.append(Tensor(name, data))
    return out


def source_tensors(reader, plan: Plan, config) -> list[Tensor]:
    """The source GGUF's tensors as raw bytes, except the FFNs of replaced layers."""
    src_arch = _field(reader, "general.architecture")
    out = []
    for t in reader.tensors:
        m = _FFN_TENSOR.match(t.name)
        if m and plan.replaced[int(m.group(1))]:
            continue
        data = np.asarray(t.data)
        if _needs_permute(t.name, ROPE_LAYOUT.get(src_arch, "norm"), ROPE_LAYOUT[plan.arch]):
            data = _permute_qk(t.name, data, config)
        out.append(Tensor(t.name, data, t.tensor_type))
    return out


def ffn_tensors(plan: Plan, layers) -> list[Tensor]:
    out = []
    for i in layers:
        g = plan.ffns[i]
        for role, w, b in (("gate", g.gate_w, g.gate_b), ("up", g.up_w, g.up_b), ("down", g.down_w, g.down_b)):
            out.append(Tensor(f"blk.{i}.ffn_{role}.weight", w.detach().float().cpu().numpy()))
            if g.has_bias[f"{role}_b"]:
                out.append(Tensor(f"blk.{i}.ffn_{role}.bias", b.detach().float().cpu().numpy()))
    return out


def _target_type(t: Tensor, plan: Plan, source_types: dict):
    """The GGML type tensor ``t`` (float32 values) is written in."""
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    if t.data.ndim == 1:
        return Q.F32
    if (m := _FFN_TENSOR.match(t.name)) and m.group(2) == "down" and int(m.group(1)) in plan.kept_f16:
        return Q.F16
    if plan.quant == "source":
        return source_types.get(t.name, Q.F16)
    if plan.quant == "plan":
        return getattr(Q, plan.size_plan.types[t.name]) if t.name in plan.size_plan.types else Q.F16
    # q8_0 / q4_k_m: F16 first, llama.cpp's quantizer after
    return {"f32": Q.F32, "bf16": Q.BF16}.get(plan.quant, Q.F16)


def _stored_bytes(t: Tensor, plan: Plan, source_types: dict, stored: dict):
    """``(GGML type, bytes)`` of a fit snapped onto the file's grid (:mod:`compressor.fitting.snap`), when the
    plan stores ``t`` in that type and the bytes hold ``t``'s shape; else None (quantized here)."""
    if t.name not in stored:
        return None
    name, raw = stored[t.name]
    qtype = _target_type(t, plan, source_types)
    raw = raw.numpy() if hasattr(raw, "numpy") else np.asarray(raw)
    from compressor.core import ggml

    if qtype.name != name or raw.shape != (t.data.shape[0], ggml.bytes_per_row(ggml.GGMLType[name], t.data.shape[1])):
        return None
    return qtype, np.ascontiguousarray(raw, dtype=np.uint8)


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
    from compressor.core import ggml

    rows, n = data.reshape(-1, data.shape[-1]).shape
    block = ggml.BLOCKS[ggml.GGMLType(int(qtype))][0]
    if n % block:
        raise GGUFWidthError(f"row length {n} is not a multiple of {block} ({qtype.name})")
    if imatrix is None and ggml.requires_imatrix(ggml.GGMLType(int(qtype))):
        raise ValueError(f"GGML type {qtype.name} needs an importance matrix; use quant q4_k_m or q8_0")
    return ggml.quantize(data.reshape(rows, n), ggml.GGMLType(int(qtype)), imatrix)


# --------------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------------


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def copy_source_metadata(writer, reader, arch: str, skip: set[str]) -> None:
    """Every key of the source GGUF (tokenizer and chat template included), the architecture's keys
    renamed to ``arch``; ``skip`` (after renaming) is left for the caller to write."""
    gguf = _gguf()
    src_arch = _field(reader, "general.architecture")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        name = arch + key[len(src_arch):] if key.startswith(src_arch + ".") else key
        if name in skip:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), vtype, sub_type=sub)


def hf_hparams(writer, config) -> list[Tensor]:
    """The architecture keys from a Hugging Face config; returns extra tensors (RoPE factors)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = (rope.get("rope_type") or rope.get("type") or "default").lower()
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope_type == "default":
        return []
    if rope_type == "linear":
        writer.add_rope_scaling_type(_gguf().RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        return []
    if rope_type == "llama3":
        return [Tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))]
    raise NotRepresentableError(f"RoPE scaling {rope_type!r} is not written by the gguf writer (default, linear, "
                                "llama3 are); start from a GGUF of the model instead")


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3's RoPE scaling (transformers' ``_compute_llama3_parameters``)."""
    base, factor = float(rope["rope_theta"]), float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))
    return out.astype(np.float32)


#: tokenizer.json pre-tokenizer (normalised) → llama.cpp's ``tokenizer.ggml.pre``.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", True)): "smollm",
    (("Split", _LLAMA3_SPLIT), ("ByteLevel", False)): "llama-bpe",
    (("Split", _QWEN2_SPLIT), ("ByteLevel", False)): "qwen2",
}


def _pre_signature(pre: dict | None) -> tuple:
    items = (pre or {}).get("pretokenizers") if (pre or {}).get("type") == "Sequence" else [pre or {}]
    sig = []
    for p in items:
        kind = p.get("type")
        if kind == "ByteLevel":
            if p.get("add_prefix_space"):
                sig.append(("ByteLevel+prefix",))
            else:
                sig.append((kind, bool(p.get("use_regex", True))))
        elif kind == "Digits":
            sig.append((kind, bool(p.get("individual_digits"))))
        elif kind == "Split":
            pattern = p.get("pattern") or {}
            sig.append((kind, pattern.get("Regex", pattern.get("String"))))
        else:
            sig.append((kind,))
    return tuple(sig)


def tokenizer_problem(tokenizer) -> str | None:
    """Why a Hugging Face tokenizer cannot be written as GGUF metadata (None when it can)."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    alternative = ("start from a GGUF of the model (its tokenizer metadata is copied), or convert the "
                   "original with llama.cpp's convert_hf_to_gguf.py for the tokenizer")
    if backend is None:
        return (f"the gguf writer builds byte-level BPE tokenizers only; {type(tokenizer).__name__} is not one: "
                f"{alternative}")
    spec = json.loads(backend.to_str())
    if (spec.get("model") or {}).get("type") != "BPE":
        return f"the tokenizer model is {(spec.get('model') or {}).get('type')!r}, not BPE: {alternative}"
    sig = _pre_signature(spec.get("pre_tokenizer"))
    if sig not in PRE_TOKENIZERS:
        return (f"the tokenizer's pre-tokenizer {sig} is not one the gguf writer maps to llama.cpp "
                f"({', '.join(sorted(PRE_TOKENIZERS.values()))}): {alternative}")
    return None


def hf_tokenizer_metadata(writer, tokenizer, vocab_size: int) -> None:
    """``tokenizer.ggml.*`` and the chat template for a byte-level BPE tokenizer (llama.cpp's
    ``gpt2`` tokenizer model), as llama.cpp's converter writes them."""
    import json

    gguf = _gguf()
    if (problem := tokenizer_problem(tokenizer)) is not None:
        raise NotRepresentableError(problem)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise NotRepresentableError(f"the tokenizer has ids up to {max(vocab.values())}, the model {vocab_size} rows")
    by_id = {i: tok for tok, i in vocab.items()}
    added = {t.content: t for t in tokenizer.added_tokens_decoder.values()}
    tokens, types = [], []
    for i in range(vocab_size):
        tok = by_id.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif tok in added:
            tokens.append(tok)
            types.append(gguf.TokenType.CONTROL if added[tok].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(tok)
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZERS[_pre_signature(spec.get("pre_tokenizer"))])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for attr, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("unk_token_id", writer.add_unk_token_id), ("pad_token_id", writer.add_pad_token_id)):
        if (value := getattr(tokenizer, attr, None)) is not None:
            add(int(value))
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer("a").input_ids
    writer.add_add_bos_token(bool(bos is not None and ids and ids[0] == bos))
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        writer.add_chat_template(tokenizer.chat_template)


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------

_FTYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
           "q4_k_m": "MOSTLY_Q4_K_M", "plan": "GUESSED"}
#: llama.cpp's presets a size can be named by (``output.size: Q3_K_M``) → gguf-py's LlamaFileType name.
PRESETS = {"Q8_0": "MOSTLY_Q8_0", "Q6_K": "MOSTLY_Q6_K", "Q5_K_M": "MOSTLY_Q5_K_M", "Q5_K_S": "MOSTLY_Q5_K_S",
           "Q4_K_M": "MOSTLY_Q4_K_M", "Q4_K_S": "MOSTLY_Q4_K_S", "Q3_K_L": "MOSTLY_Q3_K_L", "Q3_K_M": "MOSTLY_Q3_K_M",
           "Q3_K_S": "MOSTLY_Q3_K_S", "Q2_K": "MOSTLY_Q2_K", "Q4_0": "MOSTLY_Q4_0", "Q5_0": "MOSTLY_Q5_0"}


def _sort_key(name: str):
    m = re.match(r"blk\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)), name)
    return (0, 0, name) if name.startswith(("token_embd", "rope")) else (2, 0, name)


def requantizes(request: WriteRequest, options: dict) -> bool:
    """Whether the file is the GGUF source re-quantized tensor by tensor — a size plan, or ``from_source``
    F16, of a model whose blocks are all unchanged: any architecture llama.cpp loads, in its own layout."""
    if not request.source.gguf_file:
        return False
    if options.get("size_plan") is None and not (options.get("quant") == "f16" and options.get("from_source")):
        return False
    return not any(isinstance(m, _REPLACEMENTS) for m in request.model.modules())


def write_requantized(source: Path, path: Path, types: dict[str, str], imatrix: dict[str, np.ndarray] | None = None,
                      default: str = "F16") -> None:
    """The GGUF at ``source`` with every tensor of two or more dimensions dequantized (gguf-py) and written
    in ``types[name]`` (else ``default``) by ggml's quantizer with ``imatrix[name]`` as column weights; 1-D
    tensors in F32; metadata (tokenizer, chat template) copied. The source's own architecture and layout:
    the tensors are read as llama.cpp stores them, so nothing is renamed or permuted."""
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(source)
    arch = _field(reader, "general.architecture")
    writer = gguf.GGUFWriter(str(path), arch)
    copy_source_metadata(writer, reader, arch, {"general.file_type", "general.quantization_version"})
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16 if not types else gguf.LlamaFileType.GUESSED))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for t in reader.tensors:
        data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if data.ndim < 2 or int(np.prod(data.shape[:-1])) == 1:
            writer.add_tensor(t.name, data, raw_dtype=Q.F32)
            continue
        qtype = getattr(Q, types.get(t.name, default))
        weights = (imatrix or {}).get(t.name)
        writer.add_tensor(t.name, encode(data.reshape(-1, data.shape[-1]), qtype, weights).reshape(
            *data.shape[:-1], -1) if qtype not in (Q.F32, Q.F16) else encode(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(request: WriteRequest, path: Path, options: dict) -> Plan | None:
    """Write ``request.model`` to ``path``; returns the plan written (None for a re-quantized source)."""
    gguf = _gguf()
    if requantizes(request, options):
        src = Path(request.source.path) / request.source.gguf_file
        size_plan = options.get("size_plan")
        write_requantized(src, path, dict(size_plan.types) if size_plan is not None else {},
                          size_plan.imatrix if size_plan is not None else None)
        return None
    plan = plan_for(request, options)
    model, config, source = request.model, request.model.config, request.source
    n = len(plan.ffns)
    meta = gguf.GGUFReader(Path(source.path) / source.gguf_file) if source.gguf_file else None
    final_quant = plan.quant in ("q8_0", "q4_k_m")
    tmp = path.with_name(path.name + ".f16.tmp") if final_quant else path
    writer = gguf.GGUFWriter(str(tmp), plan.arch)
    tensors: list[Tensor] = []
    if meta is not None:  # a GGUF source: its metadata, tokenizer and chat template as they are
        copy_source_metadata(writer, meta, plan.arch, {f"{plan.arch}.feed_forward_length", "general.file_type",
                                                       "general.quantization_version"})
    else:
        if request.tokenizer is None:
            raise NotRepresentableError("the gguf format needs the tokenizer; none was loaded")
        writer.add_name(Path(source.path).name or "compressed")
        tensors += hf_hparams(writer, config)
        hf_tokenizer_metadata(writer, request.tokenizer, config.vocab_size)
    writer.add_feed_forward_length(plan.widths if plan.arch == "deci" else plan.widths[0])
    if plan.quant == "source":  # only for a GGUF source: its tensors as they are, new FFNs in its types
        writer.add_file_type(int(_field(meta, "general.file_type") or 0))
        tensors += source_tensors(meta, plan, config) + ffn_tensors(plan, [i for i in range(n) if plan.replaced[i]])
        types = _tensor_types(meta)
    else:
        writer.add_file_type(int(getattr(gguf.LlamaFileType, _FTYPES["f16" if final_quant else plan.quant])))
        tensors += model_tensors(model, plan) + ffn_tensors(plan, range(n))
        if meta is not None:  # tensors that are not model weights (Llama 3's rope_freqs)
            have = {t.name for t in tensors}
            tensors += [t for t in source_tensors(meta, plan, config) if t.name not in have
                        and not _FFN_TENSOR.match(t.name) and t.raw_type == gguf.GGMLQuantizationType.F32]
        types = {}
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    stored = options.get("stored") or {}
    for t in sorted(tensors, key=lambda t: _sort_key(t.name)):
        if t.raw_type is not None:
            writer.add_tensor(t.name, t.data, raw_dtype=t.raw_type)
        elif (raw := _stored_bytes(t, plan, types, stored)) is not None:
            writer.add_tensor(t.name, raw[1], raw_dtype=raw[0])
        else:
            qtype = _target_type(t, plan, types)
            imatrix = plan.size_plan.imatrix.get(t.name) if plan.quant == "plan" else None
            writer.add_tensor(t.name, encode(t.data, qtype, imatrix), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if final_quant:
        try:
            llama_quantize(tmp, path, plan)
        finally:
            tmp.unlink(missing_ok=True)
    return plan


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


def llama_quantize(src: Path, dst: Path, plan: Plan) -> None:
    """llama.cpp's own quantizer (its per-tensor mix for the file type); down projections of
    ``plan.kept_f16`` stay F16."""
    quantize_file(src, dst, _FTYPES[plan.quant], plan.kept_f16)


def quantize_file(src: Path, dst: Path, ftype: str, kept_f16: list[int] = ()) -> None:
    """``llama_model_quantize`` from ``src`` to ``dst`` at gguf-py's ``LlamaFileType`` name ``ftype``
    (llama.cpp's own per-tensor mix for that preset, no importance matrix)."""
    import llama_cpp

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
    with _CapturedOutput() as out:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed ({rc}) turning {src.name} into {ftype}:\n{out.tail()}")


# --------------------------------------------------------------------------------------------------
# Verification in llama.cpp
# --------------------------------------------------------------------------------------------------


def llama_cpp_perplexity(path: Path, tokens: torch.Tensor, seq_len: int, stride: int) -> tuple[float, int]:
    """Perplexity of the GGUF at ``path`` in llama.cpp on ``tokens``, windowed exactly as
    :func:`compressor.evaluation.evaluate.perplexity` windows (only tokens the previous window did
    not score count). Returns (perplexity, scored tokens)."""
    sums, counts = llama_cpp_window_nll(path, tokens, seq_len, stride)
    return math.exp(sum(sums) / sum(counts)), int(sum(counts))


def llama_cpp_window_nll(path: Path, tokens: torch.Tensor, seq_len: int, stride: int) -> tuple[list[float], list[int]]:
    """Per window (as :func:`llama_cpp_perplexity` windows): the summed NLL of its scored tokens in
    llama.cpp, and how many it scored — what a paired comparison with another model needs."""
    import llama_cpp

    from compressor.evaluation.evaluate import _windows

    tokens = tokens.flatten().tolist()
    with _CapturedOutput() as out:
        try:
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=seq_len, n_batch=seq_len, n_ubatch=seq_len,
                                  logits_all=True, n_threads=max(1, torch.get_num_threads()), verbose=False)
        except ValueError as e:
            failure = e
        else:
            failure = None
    if failure is not None:
        raise VerificationError(f"llama.cpp does not load {path.name} ({failure}):\n{out.tail()}")
    try:
        sums, counts = [], []
        for begin, end, scored in _windows(len(tokens), seq_len, stride):
            ids = tokens[begin:end]
            llm.reset()
            llm.eval(ids)
            logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
            logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            nll = logz - logits[np.arange(len(ids) - 1), ids[1:]]
            k = min(scored, len(ids) - 1)
            sums.append(float(nll[-k:].sum()))
            counts.append(k)
    finally:
        llm.close()
    return sums, counts


def gguf_summary(path: Path) -> dict:
    """Architecture, widths and tensor types read back from a written GGUF."""
    gguf = _gguf()
    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    ff = reader.fields[f"{arch}.feed_forward_length"].contents()
    types = _tensor_types(reader)
    ftype = int(_field(reader, "general.file_type") or 0)
    try:
        ftype_name = gguf.LlamaFileType(ftype).name
    except ValueError:
        ftype_name = str(ftype)
    down = {int(m.group(1)): types[name].name for name in types if (m := _FFN_TENSOR.match(name)) and
            m.group(2) == "down" and m.group(3) == "weight"}
    return {"architecture": arch, "ffn_widths": ff if isinstance(ff, list) else [ff] * len(down),
            "file_type": ftype_name, "ffn_down_types": [down[i] for i in sorted(down)]}


@register_writer
class GGUFWriter(Writer):
    """``gguf``: ``model.gguf`` for llama.cpp and Ollama (Llama-family and Qwen2 models), verified by
    running it in llama.cpp. Options (``request.options``): ``quant`` (:data:`QUANTS`),
    ``unquantizable`` (:data:`UNQUANTIZABLE`)."""

    format = "gguf"
    description = "one GGUF file for llama.cpp/Ollama (llama, mistral, qwen2), checked in llama.cpp"

    def unsupported(self, model_type: str, kind: str) -> str | None:
        return arch_refusal(model_type) or runtime_missing()

    def check_options(self, options: dict) -> str | None:
        return check_options(options)

    def check_tokenizer(self, tokenizer, source) -> str | None:
        """Asked before the model loads: a GGUF source's tokenizer is copied; a Hugging Face one must be
        a byte-level BPE."""
        return None if source.gguf_file else tokenizer_problem(tokenizer)

    def check_widths(self, compression: dict, config: dict, source, options: dict) -> str | None:
        """Why the widths of a ``compression`` section cannot take the quantization (None when they can):
        for ``unquantizable: error``, asked as soon as the widths are known, before anything is written."""
        if options.get("unquantizable", "error") != "error":
            return None
        quant = options.get("quant", "source")
        types = {}
        if quant == "source":
            if not source.gguf_file:
                return None  # the saved float dtype: any width
            types = source_tensor_types(Path(source.path) / source.gguf_file)
        blocks = down_blocks(quant, int(config["num_hidden_layers"]), types)
        bad = [(i, w, blocks[i]) for i, w in sorted(compression_widths(compression, config).items()) if w % blocks[i]]
        return str(width_error(quant, bad)) if bad else None

    def write(self, request: WriteRequest, folder: Path) -> list[Path]:
        options = _options(request)
        if (problem := check_options(options)) is not None:
            raise ValueError(problem)
        path = Path(folder) / options.get("file", FILE_NAME)
        plan = write_gguf(request, path, options)
        how = f"{plan.arch}, {plan.quant}" if plan is not None else "the source re-quantized by the size plan"
        logger.info("gguf: wrote %s (%s, %.1f MB)", path.name, how, path.stat().st_size / 1e6)
        return [path]

    def verify(self, request: WriteRequest, folder: Path) -> dict:
        """Perplexity in llama.cpp on the probe text. At f32/f16/bf16: within :data:`PPL_TOLERANCE` of
        the in-memory model's. At the source's own quantization (a GGUF source): no worse than the source
        file itself in llama.cpp, on the same windows, by more than the gate's budget. At another
        quantized type (no original at that type to compare with): finite, and recorded."""
        import llama_cpp

        options = _options(request)
        path = Path(folder) / options.get("file", FILE_NAME)
        quant = "plan" if options.get("size_plan") is not None else resolve_quant(options.get("quant", "source"), request)
        if quant == "plan":
            return planned_check(path, request, options)
        same_quant = None
        if quant == "source" and request.ppl_limit_ratio is not None:
            # measured once: the gate domains' first is the probe (write_request), so it gives the probe's too
            same_quant = source_quant_check(path, request, options)
            first = same_quant["domains"][0]
            ppl, n = first["perplexity"], first["scored_tokens"]
        else:
            ppl, n = llama_cpp_perplexity(path, request.probe_tokens, request.probe_seq_len, request.probe_stride)
        expected = request.expected_ppl
        rel = abs(ppl - expected) / expected if expected else None
        exact = quant in ("f32", "f16", "bf16")
        if not math.isfinite(ppl) or (exact and (rel is None or rel > PPL_TOLERANCE)):
            raise VerificationError(
                f"llama.cpp check failed: {path.name} ({gguf_summary(path)['architecture']}, {quant}) has perplexity "
                f"{ppl:.5f} in llama.cpp, the in-memory model {expected:.5f} (relative tolerance {PPL_TOLERANCE:g}); "
                "nothing was published")
        check = {"runtime": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, **gguf_summary(path),
                 "quant": quant, "perplexity": ppl, "expected_perplexity": expected, "scored_tokens": n,
                 "relative_ppl_diff": rel, "relative_ppl_tolerance": PPL_TOLERANCE if exact else None,
                 "file_bytes": path.stat().st_size}
        if exact:
            check.update(compared_with="the in-memory model", passed=True)
        elif same_quant is not None:
            check.update(compared_with="the source GGUF at the same quantization, in llama.cpp, on every gate domain "
                         "(the gate's rule: upper confidence bound, paired by window)", **same_quant)
        else:
            # No original exists at this quantization to hold the file against: what is checked is that
            # llama.cpp runs it (finite perplexity); the change quantizing added is recorded, not judged.
            check.update(compared_with=None, checked="llama.cpp runs it (finite perplexity); not compared",
                         quantization_change=ppl / expected - 1.0 if expected else None)
        return check


def planned_check(path: Path, request: WriteRequest, options: dict) -> dict:
    """A size-planned file in llama.cpp: its perplexity on every gate domain (``options['gate_domains']``,
    else the probe) against the in-memory original's there (there is no float original of a mixed file to
    match), the size against the budget, and llama.cpp's preset of that size (``options['preset']``,
    made from the same F16) on the same windows. Raises :class:`VerificationError` over the byte budget;
    the perplexity gate is the caller's (:func:`compressor.pipeline.stages.size_gate`)."""
    import llama_cpp

    size_plan, budget = options["size_plan"], int(options.get("size_budget") or 0)
    domains = [{"reference_ppl": request.expected_ppl, **d} for d in _gate_domains(request, options)]
    preset = options.get("preset")
    measured = []
    for d in domains:
        sums, counts = llama_cpp_window_nll(path, d["tokens"], d["seq_len"], d["stride"])
        ppl, n = math.exp(sum(sums) / sum(counts)), int(sum(counts))
        ref = d["reference_ppl"]
        row = {"name": d["name"], "perplexity": ppl, "scored_tokens": n, "reference_perplexity": ref,
               "relative_change": ppl / ref - 1.0 if ref else None, "window_nll": sums, "window_tokens": counts}
        if preset:
            p_ppl, _ = llama_cpp_perplexity(Path(preset["path"]), d["tokens"], d["seq_len"], d["stride"])
            row["preset_perplexity"], row["preset_relative_change"] = p_ppl, p_ppl / ref - 1.0 if ref else None
        measured.append(row)
    first = measured[0]
    check = {"runtime": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, **gguf_summary(path),
             "quant": "plan", "perplexity": first["perplexity"], "scored_tokens": first["scored_tokens"],
             "reference_perplexity": first["reference_perplexity"], "relative_change": first["relative_change"],
             "predicted_relative_change": math.expm1(size_plan.predicted_nll_increase), "domains": measured,
             "file_bytes": path.stat().st_size, "budget_bytes": budget or None,
             "passed": all(math.isfinite(d["perplexity"]) for d in measured)
             and (not budget or path.stat().st_size <= budget)}
    if preset:
        check["preset"] = {"name": preset["name"], "file_bytes": preset["file_bytes"],
                           "perplexity": first["preset_perplexity"], "relative_change": first["preset_relative_change"],
                           "made_by": "llama.cpp llama_model_quantize from the same F16, no importance matrix"}
    if not check["passed"]:
        raise VerificationError(
            f"llama.cpp check failed: {path.name} is {check['file_bytes']:,} bytes against the budget of "
            f"{budget:,} (perplexity {first['perplexity']:.4f}); nothing was published")
    return check


class GGUFGateMissed(VerificationError):
    """A GGUF at its source's quantization is over the gate in llama.cpp: nothing is published (the pipeline
    reports it as the gate's failure, exit 3; ``check`` is what was measured)."""

    def __init__(self, message: str, check: dict) -> None:
        super().__init__(message)
        self.check = check


def _gate_domains(request: WriteRequest, options: dict) -> list[dict]:
    """Every gate domain to measure on (``options['gate_domains']``), else the verification probe."""
    return options.get("gate_domains") or [
        {"name": "probe", "tokens": request.probe_tokens, "seq_len": request.probe_seq_len,
         "stride": request.probe_stride}]


def source_quant_check(path: Path, request: WriteRequest, options: dict) -> dict:
    """The output against the source GGUF, both in llama.cpp at the source's quantization, on every gate domain:
    the gate's own rule (:func:`~compressor.evaluation.evaluate.gate_check`) — the upper confidence bound of the
    change (``options['confidence']``, one-sided), paired by window, within the budget
    (:attr:`WriteRequest.ppl_limit_ratio`) on every domain. Raises :class:`GGUFGateMissed` when it is not."""
    from types import SimpleNamespace

    from compressor.evaluation.evaluate import DEFAULT_CONFIDENCE, gate_check, window_evaluation

    source = Path(request.source.path) / request.source.gguf_file
    base, cand, rows = {}, {}, []
    for d in _gate_domains(request, options):
        ref = llama_cpp_window_nll(source, d["tokens"], d["seq_len"], d["stride"])
        out = llama_cpp_window_nll(path, d["tokens"], d["seq_len"], d["stride"])
        kw = {"name": d["name"], "seq_len": d["seq_len"], "stride": d["stride"]}
        base[d["name"]] = window_evaluation(*ref, **kw)
        cand[d["name"]] = window_evaluation(*out, teacher=ref, **kw)
        rows.append(d["name"])
    rule = SimpleNamespace(metric="ppl", confidence=options.get("confidence", DEFAULT_CONFIDENCE),
                           ppl_budget=request.ppl_limit_ratio - 1.0, budget_mode="relative")
    ok, why, per = gate_check(base, cand, rule)
    domains = [{"name": n, "perplexity": cand[n].ppl, "source_perplexity": base[n].ppl, "windows": cand[n].windows,
                "scored_tokens": cand[n].tokens, **{k: per[n][k] for k in (
                    "relative_delta", "relative_delta_upper", "limit", "passed", "paired", "confidence")}}
               for n in rows]
    first = domains[0]
    out = {"source_perplexity": first["source_perplexity"], "source_relative_change": first["relative_delta"],
           "domains": domains, "confidence": rule.confidence, "budget": rule.ppl_budget, "passed": ok}
    if not ok:
        changes = "; ".join(f"{d['name']} {100 * d['relative_delta']:+.2f} % ({d['confidence']:.0%} bound "
                            f"{100 * d['relative_delta_upper']:+.2f} %)" for d in domains)
        raise GGUFGateMissed(
            f"llama.cpp check failed: {path.name} against the source GGUF at the same quantization: {changes}; "
            f"{why}. Nothing was published; lower policy.ppl_budget to leave room for the runtime, or set "
            "output.gguf_quant: q8_0 or f16", out)
    return out


def _options(request: WriteRequest) -> dict:
    """The gguf options: ``request.options['gguf']`` if given as a section, else the flat keys."""
    opts = dict(request.options or {})
    return dict(opts.get("gguf", opts))
