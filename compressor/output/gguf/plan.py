"""What will be written: the llama.cpp architecture, every layer's gated FFN and width, the tensor types.

The architecture comes from the model type's row in :data:`compressor.core.archs.ARCHITECTURES`:
``gguf_native`` when every layer has one width (and, if a block has FFN biases, that architecture
loads them), else ``gguf_per_layer`` (``deci``); a row without ``gguf_native`` is refused with its
``gguf_refusal``. Widths must be whole blocks of their down projection's quantization (see the
package docstring), else padded, kept in F16, or refused with :func:`width_error`.
"""

from __future__ import annotations

import logging
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from compressor.core.archs import ARCHITECTURES, NO_GGUF, ArchSpec, find_blocks
from compressor.core.modeling import AffineFFN, HiddenUnitFFN, LowRankAffineFFN
from compressor.output.base import WriteRequest
from compressor.output.gated import GatedMLP, NotRepresentableError, as_gated
from compressor.output.gguf.encode import GGUFWidthError
from compressor.output.gguf.naming import _gguf
from compressor.output.gguf.read import source_tensor_types
from compressor.recipe.schema import GGML_BLOCK, OutputConfig

logger = logging.getLogger(__name__)

QUANTS: tuple[str, ...] = typing.get_args(OutputConfig.model_fields["gguf_quant"].annotation)
UNQUANTIZABLE: tuple[str, ...] = typing.get_args(OutputConfig.model_fields["gguf_unquantizable"].annotation)
_REPLACEMENTS = (AffineFFN, LowRankAffineFFN, HiddenUnitFFN)


@dataclass
class Plan:
    """What will be written: the llama.cpp architecture, every layer's gated FFN and the tensor types."""

    model_type: str
    arch: str
    ffns: list[GatedMLP]
    replaced: list[bool]
    quant: str
    """source | bf16 | f16 | f32 | q8_0 | q4_k_m (``source`` only for a GGUF source): :attr:`Uniform.quant`."""
    source_gguf: Path | None
    kept_f16: list[int] = field(default_factory=list)
    """Layers whose down projection stays F16 (``unquantizable: f16``)."""
    padded: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Layer → (fitted width, written width) for ``unquantizable: pad``."""
    @property
    def widths(self) -> list[int]:
        return [g.width for g in self.ffns]

    @property
    def unchanged(self) -> bool:
        """No block replaced: the FFNs are the model's own tensors, written by name like every other tensor
        (read one at a time when written), not converted to gated MLPs in memory."""
        return not any(self.replaced)


@dataclass
class UnchangedFFN:
    """An FFN the run did not replace: its width and which biases it has, read off its modules' shapes (an
    onloaded layer's weights are not read)."""

    width: int
    has_bias: dict[str, bool]


@dataclass(frozen=True)
class Uniform:
    """The file written from the model in one quantization (the writer's ``quant`` option, resolved: a
    preset is a plan too): every FFN a gated MLP of its width, llama.cpp's own quantizer for ``q8_0`` /
    ``q4_k_m``. Checked in llama.cpp against the in-memory model (exact types), the source GGUF (``source``) or
    for finite perplexity."""

    quant: str
    measured = False
    """Whether the file is measured on the gate's domains rather than held to an original
    (:attr:`Requantized.measured`)."""


@dataclass(frozen=True)
class Requantized:
    """A GGUF file re-quantized tensor by tensor in its own architecture and layout (nothing renamed or
    permuted): a size's plan (:meth:`compressor.output.gguf.target.GGUFTarget.file_plan`), or the F16 of a GGUF
    source. Each tensor of two or more dimensions in ``types[name]`` (else ``default``; None: as ``source``
    stores it), quantized by ggml with ``imatrix[name]`` as column weights, or ``stored[name]``'s bytes when
    given in that type (error-compensating rounding, in the file's row order)."""

    source: Path
    types: dict = field(default_factory=dict)
    imatrix: dict = field(default_factory=dict)
    default: str | None = "F16"
    stored: dict = field(default_factory=dict)

    @property
    def quant(self) -> str:
        return "plan" if self.types else "f16"

    @property
    def measured(self) -> bool:
        """A mix of types (a plan) has no float original to match: it is measured on the gate's domains, and the
        size stage judges it; the F16 of the source is held to the model."""
        return bool(self.types)


def writer_plan(request: WriteRequest, options: dict) -> Uniform | Requantized:
    """The plan the writer's own options give (when no size hands it one): the model in one quantization, or
    with ``from_source`` (the size budget's F16) an unchanged GGUF source re-read in F16."""
    quant = resolve_quant(options.get("quant", "source"), request)
    if quant == "f16" and options.get("from_source") and request.source.gguf_file and not any(
            isinstance(m, _REPLACEMENTS) for m in request.model.modules()):
        return Requantized(Path(request.source.path) / request.source.gguf_file)
    return Uniform(quant)


def writable() -> list[str]:
    """The model types the gguf writer writes (rows with a ``gguf_native``), sorted."""
    return sorted(t for t, spec in ARCHITECTURES.items() if spec.gguf_native)


def arch_refusal(model_type: str) -> str | None:
    """Why a ``model_type`` cannot be written as GGUF, with the alternative (None when it can)."""
    return None if model_type in writable() else _refusal(model_type)


def _refusal(model_type: str) -> str:
    spec = ARCHITECTURES.get(model_type)
    why = spec.gguf_refusal if spec is not None else NO_GGUF
    return (f"model type {model_type!r} cannot be written as GGUF: {why}. Supported: {', '.join(writable())}. "
            "Use output.formats: [hf] for this model")


def check_options(options: dict) -> str | None:
    """Why the writer options are invalid (None when valid)."""
    quant = options.get("quant", "source")
    if quant not in QUANTS:
        return f"gguf quant {quant!r} is not one of {', '.join(QUANTS)}"
    how = options.get("unquantizable", "error")
    if how not in UNQUANTIZABLE:
        return f"gguf unquantizable {how!r} is not one of {', '.join(UNQUANTIZABLE)}"
    m, block = options.get("width_multiple"), GGML_BLOCK.get(quant, 1)
    if m is not None and how == "error" and m % block:
        return (f"output.width_multiple: {m} is not a multiple of {block}, the quantization block of gguf_quant "
                f"{quant}: those widths cannot be quantized; use {math.lcm(m, block)}, leave it null (automatic), "
                "or set gguf_unquantizable")
    return None


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
    return [GGML_BLOCK.get(quant, 1)] * n_layers


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
    spec = ARCHITECTURES.get(model_type)
    if spec is None or spec.gguf_native is None:
        raise NotRepresentableError(_refusal(model_type))
    return model_type, spec


def plan_for(request: WriteRequest, options: dict, quant: str | None = None) -> Plan:
    """Convert every FFN to a gated MLP, fit the widths to ``quant`` (:attr:`Uniform.quant`; default the
    options') and choose the architecture."""
    quant = quant if quant is not None else resolve_quant(options.get("quant", "source"), request)
    model = request.model
    model_type, spec = _arch(model)
    _, blocks = find_blocks(model, spec)
    hidden = model.config.hidden_size
    modules = [b.get_submodule(spec.ffn_out) for b in blocks]
    replaced = [isinstance(m, _REPLACEMENTS) for m in modules]
    ffns = ([as_gated(m, spec.ffn_up, spec.ffn_down, in_features=hidden) for m in modules] if any(replaced) else
            [_unchanged(m, spec) for m in modules])
    src = Path(request.source.path) / request.source.gguf_file if quant == "source" else None
    plan = Plan(model_type, "", ffns, replaced, quant, src)
    _fit_widths(plan, source_tensor_types(src) if src is not None else {}, options)
    needs_bias = any(any(g.has_bias.values()) for g in plan.ffns)
    equal = len(set(plan.widths)) == 1
    plan.arch = (spec.gguf_native if equal and (spec.gguf_native_ffn_bias or not needs_bias)
                 else spec.gguf_per_layer)
    return plan


def _unchanged(module: nn.Module, spec: ArchSpec) -> UnchangedFFN:
    ups = [module.get_submodule(n) for n in spec.ffn_up]
    down = module.get_submodule(spec.ffn_down)
    bias = [getattr(m, "bias", None) is not None for m in ups]
    return UnchangedFFN(int(down.weight.shape[-1]), {"gate_b": bias[0], "up_b": bias[-1],
                                                     "down_b": getattr(down, "bias", None) is not None})


def _fit_widths(plan: Plan, types: dict, options: dict) -> None:
    """Each replaced layer's width against its down projection's block: padded (``unquantizable: pad``),
    kept in F16 (``f16``), or a :func:`width_error` naming every layer that does not fit (``error``)."""
    how = options.get("unquantizable", "error")
    bad = []
    for i, (g, block) in enumerate(zip(list(plan.ffns), down_blocks(plan.quant, len(plan.ffns), types))):
        if not plan.replaced[i] or g.width % block == 0:
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


def file_arch(request: WriteRequest) -> str:
    """The llama.cpp architecture a size plan's file is written in (widths unchanged): a GGUF source's own
    (re-quantized in its layout), else the model type's native one."""
    if request.source.gguf_file:
        from compressor.output.gguf.naming import _field

        return str(_field(_gguf().GGUFReader(Path(request.source.path) / request.source.gguf_file),
                          "general.architecture"))
    return _arch(request.model)[1].gguf_native
