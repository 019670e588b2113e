"""The tensor list of a plan: the in-memory model's tensors GGUF-named, a GGUF source's copied, the
gated FFNs; attn_q/attn_k rows permuted where the written architecture's RoPE layout differs."""

from __future__ import annotations

import functools

import numpy as np
from torch import nn

from compressor.core import onload
from compressor.core.archs import ARCHITECTURES, find_blocks
from compressor.output.gated import NotRepresentableError
from compressor.output.gguf.naming import (
    _FFN_TENSOR, ROPE_LAYOUT, Tensor, _field, _gguf, _needs_permute, _permute_qk,
)
from compressor.output.gguf.plan import Plan


def model_tensors(model: nn.Module, plan: Plan) -> list[Tensor]:
    """Every tensor of the model (except the FFNs when a block was replaced), GGUF-named, float32: each read
    when it is written (an onloaded model's from its offload store, :func:`compressor.core.onload.tensor`)."""
    gguf = _gguf()
    spec = ARCHITECTURES[plan.model_type]
    path, blocks = find_blocks(model, spec)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, spec.gguf_arch), len(blocks))
    # the FFNs of a changed model are written from their gated form (:func:`ffn_tensors`)
    ffn_prefixes = () if plan.unchanged else tuple(f"{path}.{i}.{spec.ffn_out}." for i in range(len(blocks)))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out = []
    for hf_name, t in model.state_dict(keep_vars=True).items():
        if hf_name.startswith(ffn_prefixes):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise NotRepresentableError(f"no GGUF tensor name for {hf_name!r} of a {plan.model_type} model")
        if name == "output.weight" and tied:
            continue  # llama.cpp falls back to token_embd
        permute = _needs_permute(name, "neox", ROPE_LAYOUT[plan.arch])
        out.append(Tensor(name, None, load=functools.partial(_read, model, hf_name, name, permute),
                          shape=tuple(t.shape)))
    return out


def _read(model: nn.Module, hf_name: str, name: str, permute: bool) -> np.ndarray:
    data = onload.tensor(model, hf_name).detach().float().cpu().numpy()
    return _permute_qk(name, data, model.config) if permute else data


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
    """The gated FFN tensors of ``layers`` (weights, and the biases that are not all zero), float32."""
    out = []
    for i in layers:
        g = plan.ffns[i]
        for role, w, b in (("gate", g.gate_w, g.gate_b), ("up", g.up_w, g.up_b), ("down", g.down_w, g.down_b)):
            out.append(Tensor(f"blk.{i}.ffn_{role}.weight", w.detach().float().cpu().numpy()))
            if g.has_bias[f"{role}_b"]:
                out.append(Tensor(f"blk.{i}.ffn_{role}.bias", b.detach().float().cpu().numpy()))
    return out
