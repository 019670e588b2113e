"""Replacement FFN modules and the classes that rebuild a compressed checkpoint.

This file is **self-contained** (it imports only torch and transformers): it is
copied verbatim, plus a two-line footer naming the base classes, into every
saved checkpoint as ``modeling_compressor.py``, so that

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

works where compressor is not installed. compressor itself imports the same
classes from here, so there is one definition of what a replaced block is.

A compressed config is the base config plus a ``compression`` section whose
``blocks`` list names, for each replaced block, the dotted ``module`` path, its
``replacement`` kind (``affine`` or ``low_rank``), ``in_features``,
``out_features`` and ``rank``. The compressed model class builds the base
architecture, swaps those modules for empty replacements of the right shape,
then ``from_pretrained`` loads their weights from the safetensors file.
"""

from __future__ import annotations

import torch
from torch import nn

COMPRESSION_FORMAT = "compressor.affine-ffn/v1"
REPLACEMENT_KINDS = ("affine", "low_rank")


class AffineFFN(nn.Module):
    """``y = W x + b``: the exact least-squares stand-in for an FFN block."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=True)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # Blocks call their FFN with the normed hidden states first; extra
        # arguments some architectures pass are irrelevant to an affine map.
        return self.proj(hidden_states)


class LowRankAffineFFN(nn.Module):
    """``y = U (V x) + b`` with rank ``r``: the reduced-rank least-squares map."""

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=True)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.up(self.down(hidden_states))


def build_replacement(entry: dict) -> nn.Module:
    """An empty replacement module for one ``compression.blocks`` entry."""
    kind = entry.get("replacement")
    if kind == "affine":
        return AffineFFN(entry["in_features"], entry["out_features"])
    if kind == "low_rank":
        return LowRankAffineFFN(entry["in_features"], entry["out_features"], entry["rank"])
    raise ValueError(f"unknown replacement kind {kind!r} in the compression config; expected one of {REPLACEMENT_KINDS}")


def apply_compression(model: nn.Module, compression: dict | None) -> None:
    """Swap every replaced block listed in ``compression`` for its empty replacement."""
    if not compression:
        return
    fmt = compression.get("format")
    if fmt != COMPRESSION_FORMAT:
        raise ValueError(
            f"compression format {fmt!r} is not {COMPRESSION_FORMAT!r}: this checkpoint was written by an "
            "incompatible compressor version"
        )
    for entry in compression.get("blocks", []):
        if entry.get("replacement") in (None, "none"):
            continue
        old = model.get_submodule(entry["module"])
        new = build_replacement(entry)
        ref = next(old.parameters(), None)
        if ref is not None:
            new = new.to(device=ref.device, dtype=ref.dtype)
        model.set_submodule(entry["module"], new)


def make_compressed_classes(base_config: str, base_model: str):
    """Subclass ``transformers.<base_config>`` / ``<base_model>`` into a
    config with ``model_type = "compressed_<base type>"`` and a model whose
    constructor applies the config's ``compression`` section."""
    import transformers

    config_base = getattr(transformers, base_config)
    model_base = getattr(transformers, base_model)
    model_type = "compressed_" + config_base.model_type
    config_cls = type("Compressed" + base_config, (config_base,), {"model_type": model_type, "__module__": __name__})

    def __init__(self, config, *args, **kwargs):
        model_base.__init__(self, config, *args, **kwargs)
        apply_compression(self, getattr(config, "compression", None))

    model_cls = type(
        "Compressed" + base_model,
        (model_base,),
        {"config_class": config_cls, "__init__": __init__, "__module__": __name__},
    )
    _inherit_weight_renaming(model_type, model_cls.__name__, config_base.model_type, base_model)
    return config_cls, model_cls


def _inherit_weight_renaming(model_type: str, class_name: str, base_type: str, base_class: str) -> None:
    """transformers >= 5 renames some checkpoint keys on load and reverses it on
    save (GPT-NeoX: ``embed_out`` ↔ ``lm_head``), but skips that for classes
    defined outside transformers unless they are registered. Register the base
    architecture's renaming for the compressed class so the same file loads."""
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:  # transformers 4.x: no renaming on load, nothing to inherit
        return
    mapping = get_checkpoint_conversion_mapping(base_class) or get_checkpoint_conversion_mapping(base_type)
    if mapping:
        for key in (class_name, model_type):
            register_checkpoint_conversion_mapping(key, mapping, overwrite=True)
