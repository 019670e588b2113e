"""Where the FFN blocks live, per architecture: data, not code paths.

A row says where the list of transformer blocks is (the first path that exists
on the loaded model wins, so one row serves ``XModel`` and ``XForCausalLM``),
which sub-module's *input* is the FFN input (after the pre-FFN norm) and which
sub-module's *output* is the FFN output (before the residual add). When both
are the same module, that module is what :mod:`compressor.fitting.replace` swaps.

Adding an architecture is adding a row here and a tiny-model test in
``tests/test_archs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from compressor.core.errors import UnsupportedModelError


@dataclass(frozen=True)
class ArchSpec:
    blocks: tuple[str, ...]
    """Candidate dotted paths to the ``nn.ModuleList`` of blocks."""
    ffn_in: str = "mlp"
    """Module (relative to a block) whose first input is the FFN input."""
    ffn_out: str = "mlp"
    """Module (relative to a block) whose output is the FFN output."""
    compressible: bool = True
    """False for architectures we only profile (the FFN is not one module)."""
    ffn_up: tuple[str, ...] = ()
    """Projections (relative to the FFN module) that make its hidden units:
    ``(gate, up)`` for gated MLPs (``act(gate x) * up x``), ``(up,)`` for plain
    ones (``act(up x)``). Empty: hidden-unit kinds (prune, hybrid) unsupported."""
    ffn_down: str = ""
    """Projection (relative to the FFN module) whose input is the hidden units."""
    act_attrs: tuple[str, ...] = ("hidden_act",)
    """Config attributes naming the activation (first present wins)."""
    residual_direct: bool = True
    """True when the FFN output is added to the residual stream as is (no
    post-FFN norm): the residual teacher target is defined only then."""
    note: str = ""


_DECODER = ArchSpec(blocks=("model.layers", "layers"), ffn_up=("gate_proj", "up_proj"), ffn_down="down_proj")
_BERT = ArchSpec(
    blocks=("bert.encoder.layer", "roberta.encoder.layer", "encoder.layer"),
    ffn_in="intermediate",
    ffn_out="output.dense",
    compressible=False,
    note="post-norm encoder: the FFN is split across `intermediate` and `output.dense`",
)

ARCHITECTURES: dict[str, ArchSpec] = {
    "gpt2": ArchSpec(blocks=("transformer.h", "h"), ffn_up=("c_fc",), ffn_down="c_proj",
                     act_attrs=("activation_function",)),
    "gpt_neox": ArchSpec(blocks=("gpt_neox.layers", "layers"), ffn_up=("dense_h_to_4h",), ffn_down="dense_4h_to_h"),
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "qwen3": _DECODER,
    "gemma3_text": ArchSpec(
        blocks=("model.layers", "layers"), ffn_up=("gate_proj", "up_proj"), ffn_down="down_proj",
        act_attrs=("hidden_activation", "hidden_act"), residual_direct=False,
        note="the FFN output passes a post-FFN RMSNorm before the residual add",
    ),
    "bert": _BERT,
    "roberta": _BERT,
}

# Configs that route tokens to experts: one affine map per block is the wrong
# model for them, and their `mlp` is a router plus a module list.
_MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _is_moe(config) -> bool:
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if any((getattr(cfg, key, None) or 0) > 1 for key in _MOE_CONFIG_KEYS):
            return True
        if "moe" in str(getattr(cfg, "model_type", "")):
            return True
    return False


def arch_for(model: nn.Module) -> tuple[str, ArchSpec]:
    """Return ``(model_type, spec)`` for a loaded Hugging Face model, or raise."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no `config.model_type`; pass a Hugging Face transformers model"
        )
    if _is_moe(config):
        raise UnsupportedModelError(
            f"model type {model_type!r} is a mixture-of-experts model: not supported "
            "(one affine map per FFN block does not describe routed experts)"
        )
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported. Supported types: "
            f"{', '.join(sorted(ARCHITECTURES))}. To add one, add a row to "
            "compressor/archs.py::ARCHITECTURES saying where its blocks and FFN are."
        )
    return model_type, ARCHITECTURES[model_type]


def find_blocks(model: nn.Module, spec: ArchSpec) -> tuple[str, nn.ModuleList]:
    """Resolve the block list; raise listing the paths tried."""
    for path in spec.blocks:
        try:
            blocks = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(blocks, nn.ModuleList):
            return path, blocks
    raise UnsupportedModelError(
        f"could not find the transformer blocks of {type(model).__name__}: tried {list(spec.blocks)}. "
        "Load the model with AutoModel/AutoModelForCausalLM, or fix the row in compressor/archs.py."
    )
