"""Replacement FFN modules and the classes that rebuild a compressed checkpoint.

This file is **self-contained** (it imports only torch and transformers): it is
copied verbatim, plus a two-line footer naming the base classes, into every
saved checkpoint as ``modeling_compressor.py``, so that

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

works where compressor is not installed. compressor itself imports the same
classes from here, so there is one definition of what a replaced block is.

A compressed config is the base config plus a ``compression`` section whose
``blocks`` list names, for each replaced block, the dotted ``module`` path, its
``kind`` (``affine``, ``low_rank``, ``prune``, ``hybrid``), a per-kind entry
``format`` and the shape ``config`` of the replacement (format
``compressor.ffn/v2``; ``compressor.affine-ffn/v1`` entries, with a flat
``replacement``/``in_features``/``out_features``/``rank``, still load). The compressed model class builds the base
architecture, swaps those modules for empty replacements of the right shape,
then ``from_pretrained`` loads their weights from the safetensors file.
"""

from __future__ import annotations

import torch
from torch import nn

COMPRESSION_FORMAT = "compressor.ffn/v2"
# Every top-level format this tool has written; all of them keep loading.
KNOWN_FORMATS = ("compressor.affine-ffn/v1", COMPRESSION_FORMAT)


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


class HiddenUnitFFN(nn.Module):
    """``y = D_K h_K (+ A x) + b``: kept hidden units of the original FFN plus,
    with ``bypass``, an affine map of the input; the output matrix ``[D_K, A]``
    is one fitted ``nn.Linear`` over ``[h_K, x]``.

    ``h_K = act(gate_K x) * (up_K x)`` when ``gated`` (SwiGLU/GeGLU), else
    ``act(up_K x)``; the gate and up rows are fused into one ``up`` projection.
    """

    def __init__(self, in_features: int, out_features: int, units: int, act: str, gated: bool,
                 up_bias: bool, bypass: bool) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.units, self.gated, self.bypass = units, gated, bypass
        self.up = nn.Linear(in_features, (2 if gated else 1) * units, bias=up_bias) if units else None
        self.act = ACT2FN[act] if units else None
        self.out = nn.Linear(units + (in_features if bypass else 0), out_features, bias=True)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        x = hidden_states
        if self.up is None:
            return self.out(x if self.bypass else x[..., :0])
        u = self.up(x)
        if self.gated:
            g, u = u.split(self.units, dim=-1)
            h = self.act(g) * u
        else:
            h = self.act(u)
        return self.out(torch.cat([h, x], dim=-1) if self.bypass else h)


def _hidden(bypass: bool):
    def build(c: dict) -> nn.Module:
        return HiddenUnitFFN(
            c["in_features"], c["out_features"], c["units"], c["act"], c["gated"], c["up_bias"], bypass
        )
    return build


# kind → (entry formats it can read, builder from the entry's config)
REPLACEMENTS = {
    "affine": (("compressor.kind.affine/v1",), lambda c: AffineFFN(c["in_features"], c["out_features"])),
    "low_rank": (
        ("compressor.kind.low_rank/v1",),
        lambda c: LowRankAffineFFN(c["in_features"], c["out_features"], c["rank"]),
    ),
    "prune": (("compressor.kind.prune/v1",), _hidden(False)),
    "hybrid": (("compressor.kind.hybrid/v1",), _hidden(True)),
}


def _normalize_entry(entry: dict) -> dict:
    """Entries of format v1 (``replacement``, flat shape fields) in the v2 form."""
    if "kind" in entry:
        return entry
    kind = entry.get("replacement")
    config = {"in_features": entry.get("in_features"), "out_features": entry.get("out_features")}
    if kind == "low_rank":
        config["rank"] = entry.get("rank")
    return {**entry, "kind": kind, "format": f"compressor.kind.{kind}/v1", "config": config}


def build_replacement(entry: dict) -> nn.Module:
    """An empty replacement module for one ``compression.blocks`` entry."""
    entry = _normalize_entry(entry)
    kind = entry.get("kind")
    if kind not in REPLACEMENTS:
        raise ValueError(
            f"unknown replacement kind {kind!r} in the compression config; expected one of {sorted(REPLACEMENTS)}"
        )
    formats, build = REPLACEMENTS[kind]
    fmt = entry.get("format", formats[-1])
    if fmt not in formats:
        raise ValueError(f"block entry format {fmt!r} is not one this version reads ({formats}): upgrade compressor")
    return build(entry["config"])


def apply_compression(model: nn.Module, compression: dict | None) -> None:
    """Swap every replaced block listed in ``compression`` for its empty replacement."""
    if not compression:
        return
    fmt = compression.get("format")
    if fmt not in KNOWN_FORMATS:
        raise ValueError(
            f"compression format {fmt!r} is not one of {KNOWN_FORMATS}: this checkpoint was written by an "
            "incompatible compressor version"
        )
    for entry in compression.get("blocks", []):
        if _normalize_entry(entry).get("kind") in (None, "none"):
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
