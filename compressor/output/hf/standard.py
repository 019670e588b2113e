"""The ``hf-standard`` writer: the base model's own class with a smaller ``intermediate_size``.

``output.architecture: standard`` prunes every FFN block to one width
(:mod:`compressor.policy.compress`), so the compressed model *is* the base
architecture with fewer hidden units. This writer saves it as such: a
Hugging Face folder whose ``config.json`` names the base class
(``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``GPT2LMHeadModel``…) with the new
width, no ``auto_map`` and no modeling file, so plain transformers, vLLM, TGI,
MLX and llama.cpp's own converter take it as it is. The pipeline uses it in
place of ``hf`` when the recipe asks for the standard architecture
(:meth:`compressor.recipe.schema.OutputConfig.writers`).

A pruned block (:class:`~compressor.core.modeling.HiddenUnitFFN`) maps onto the
base MLP one to one: its fused ``up`` rows split back into the gate and up
projections (``ffn_up`` of the architecture table), its ``out`` is the down
projection. The re-solved intercept (``out.bias``) goes into the down
projection's bias where the class has one — natively (GPT-2, GPT-NeoX) or
switched on by ``mlp_bias`` (Llama: a bias on gate, up and down; the gate and
up biases are written as zeros). Elsewhere the policy solved the block without
an intercept, so the bias it drops is zero; a non-zero one is refused.

``config.json``'s ``compression`` section (``compressor.standard/v1``) records what was done; verification reloads
the folder with a plain ``AutoModelForCausalLM.from_pretrained`` and compares it with the in-memory model.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from pathlib import Path

import torch
from torch import nn

from compressor.core.archs import ARCHITECTURES, arch_for, find_blocks
from compressor.core.modeling import AffineFFN, HiddenUnitFFN, LowRankAffineFFN
from compressor.output.base import VerificationError, WriteRequest, Writer, Written
from compressor.output.hf.folder import (
    cast_state_dict, compare_reloaded, finish_folder, reference_logits,
)

logger = logging.getLogger(__name__)

STANDARD_FORMAT = "compressor.standard/v1"


def _width_attr(model_type: str) -> str:
    """The config attribute holding the FFN width: the row's ``width_attr`` (``intermediate_size`` if none)."""
    spec = ARCHITECTURES.get(model_type)
    return spec.width_attr if spec is not None else "intermediate_size"


def _conv1d(mod: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` stores its weight ``[in, out]``, the transpose of ``nn.Linear``'s."""
    return type(mod).__name__ == "Conv1D"


def _width(ffn: nn.Module, spec) -> int:
    if isinstance(ffn, HiddenUnitFFN):
        if ffn.bypass:
            raise ValueError("a hybrid block (kept units plus an affine bypass) has no place in the base class's MLP; "
                             "output.architecture: standard needs replacement.kind: prune")
        if not ffn.units:
            raise ValueError("a block pruned to 0 units cannot be written as a standard MLP")
        return ffn.units
    if isinstance(ffn, (AffineFFN, LowRankAffineFFN)):
        raise ValueError(f"a {type(ffn).__name__} block is no subset of the MLP's hidden units; "
                         "output.architecture: standard needs replacement.kind: prune")
    down = ffn.get_submodule(spec.ffn_down)
    return down.weight.shape[0] if _conv1d(down) else down.weight.shape[1]


def standard_model(model: nn.Module) -> nn.Module:
    """``model`` (every block pruned to one width, or original) rebuilt as its base class with that
    ``intermediate_size``; its weights equal the pruned model's. Raises ``ValueError`` when the
    widths differ or a block is not a pruned MLP."""
    model_type, spec = arch_for(model)
    path, blocks = find_blocks(model, spec)
    ffns = {f"{path}.{i}.{spec.ffn_out}": b.get_submodule(spec.ffn_out) for i, b in enumerate(blocks)}
    widths = {p: _width(f, spec) for p, f in ffns.items()}
    if len(set(widths.values())) != 1:
        raise ValueError(f"output.architecture: standard needs one FFN width in every block; got "
                         f"{sorted(set(widths.values()))}")
    width = next(iter(widths.values()))
    cfg = copy.deepcopy(model.config)
    setattr(cfg, spec.width_attr, width)
    pruned = {p: f for p, f in ffns.items() if isinstance(f, HiddenUnitFFN)}
    if any(bool(f.out.bias.any()) for f in pruned.values()) and hasattr(cfg, "mlp_bias"):
        cfg.mlp_bias = True  # Llama: gate, up and down get a bias; the down bias carries the intercept
    with _no_init():  # every weight is overwritten below
        std = type(model)(cfg)
    std = std.to(dtype=next(model.parameters()).dtype).eval()
    state = {k: v for k, v in model.state_dict().items() if not any(k.startswith(p + ".") for p in pruned)}
    for p, ffn in pruned.items():
        state.update(_mlp_state(p, ffn, std.get_submodule(p), spec))
    std.load_state_dict(state, strict=True)
    std.tie_weights()
    return std


def _no_init():
    """Skip the random initialisation of a model whose weights are all loaded next (when transformers can)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _mlp_state(prefix: str, ffn: HiddenUnitFFN, target: nn.Module, spec) -> dict[str, torch.Tensor]:
    """The base MLP's tensors for one pruned block (gate/up rows split back, down = ``out``)."""
    out: dict[str, torch.Tensor] = {}
    k = ffn.units
    weights = ffn.up.weight.detach().split(k)
    biases = ffn.up.bias.detach().split(k) if ffn.up.bias is not None else (None,) * len(weights)
    pairs = [(name, w, b) for name, w, b in zip(spec.ffn_up, weights, biases)]
    pairs.append((spec.ffn_down, ffn.out.weight.detach(), ffn.out.bias.detach()))
    for name, w, b in pairs:
        mod = target.get_submodule(name)
        out[f"{prefix}.{name}.weight"] = w.T.contiguous() if _conv1d(mod) else w
        if getattr(mod, "bias", None) is not None:
            out[f"{prefix}.{name}.bias"] = b if b is not None else torch.zeros_like(mod.bias)
        elif b is not None and bool(b.any()):
            raise ValueError(f"{prefix}.{name}: the fit has a bias (intercept) but {type(target).__name__} has none; "
                             "the policy should have solved this block without an intercept")
    return out


class StandardWriter(Writer):
    """``hf-standard``: the base class with one smaller ``intermediate_size`` (``output.architecture:
    standard``); loads with plain ``AutoModelForCausalLM.from_pretrained(folder)`` anywhere."""

    format = "hf-standard"
    description = ("Hugging Face folder of the base model's own class with a smaller intermediate_size "
                   "(output.architecture: standard; kind prune); no custom code")

    def unsupported(self, model_type: str, kind: str) -> str | None:
        spec = ARCHITECTURES.get(model_type)
        if spec is None or not spec.compressible or not spec.ffn_up:
            return (f"output.architecture: standard: {model_type} has no MLP hidden units compressor can prune; "
                    "use output.architecture: custom")
        if kind not in ("prune", "none"):
            return (f"output.architecture: standard saves the base class's MLP with fewer units: only kind prune is "
                    f"representable, not {kind}; use kind: prune or output.architecture: custom")
        return None

    def write(self, request: WriteRequest, folder: Path, plan=None) -> Written:
        model, dtype = request.model, request.dtype
        std = standard_model(model)
        width_attr = _width_attr(model.config.model_type)
        width = getattr(std.config, width_attr)
        state = cast_state_dict(std, dtype) if dtype is not None else None
        std.save_pretrained(folder, safe_serialization=True, state_dict=state)
        bias = bool(getattr(std.config, "mlp_bias", False))
        del state, std
        cfg_path, cfg = finish_folder(folder, request.tokenizer, dtype)
        cfg.pop("auto_map", None)
        cfg["compression"] = {**request.compression, "format": STANDARD_FORMAT, "architecture": "standard",
                              "width_attribute": width_attr, "width": width, "mlp_bias": bias}
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for name, text in request.extra_files.items():
            (folder / name).write_text(_plain_card(text, type(model).__name__, width_attr, width)
                                       if name == "README.md" else text)
        return Written(folder, sorted(folder.iterdir()))

    def verify(self, request: WriteRequest, written: Written) -> dict:
        """Reload with plain transformers (the base class, no custom code) in the compute dtype and
        compare logits and perplexity with the in-memory model rounded the way it was saved."""
        from transformers import AutoModelForCausalLM

        model = request.model
        reference = reference_logits(request)  # before the reload: never three models in memory at once
        reloaded = AutoModelForCausalLM.from_pretrained(str(written.folder), dtype=model.dtype).eval()
        cls = f"{type(reloaded).__module__}.{type(reloaded).__name__}"
        if not type(reloaded).__module__.startswith("transformers.") or type(reloaded) is not type(model):
            raise VerificationError(f"the standard folder reloaded as {cls}, not the base class "
                                    f"{type(model).__name__}; the folder was not published")
        width_attr = _width_attr(model.config.model_type)
        return compare_reloaded(request, reloaded, "standard reload check", reference, **{
            "class": cls, width_attr: getattr(reloaded.config, width_attr),
            "mlp_bias": getattr(reloaded.config, "mlp_bias", None)})


def _plain_card(card: str, class_name: str, width_attr: str, width: int) -> str:
    """The model card with its Load section for a folder that needs no custom code."""
    note = (f"Saved as the base class `{class_name}` with `{width_attr}: {width}` in every layer "
            "(`output.architecture: standard`): no custom code, no `auto_map`; plain transformers, vLLM, TGI "
            "and MLX load it as it is.\n\n## Load\n")
    return plain_load_card(card, note)


def plain_load_card(card: str, note: str) -> str:
    """A model card whose Load section says ``note`` and loads with no flag and no compressor (a folder of the
    base class: no custom code)."""
    return (
        card.replace("## Load\n", note, 1)
        .replace(", trust_remote_code=True)", ")")
        .replace("\n# or, with compressor installed: `import compressor` after transformers and drop both flags", "")
    )
