"""Mixtures of experts, for the size planner: each routed expert as its own linear layers.

transformers (5.x) holds a layer's routed experts as two stacked parameters — ``gate_up_proj``
``[experts, 2·ffn, hidden]`` and ``down_proj`` ``[experts, hidden, ffn]`` — and runs them in one module
(``Qwen3MoeExperts``, ``MixtralExperts``, ``Qwen2MoeExperts``). :func:`unfuse_experts` swaps each such module
for :class:`UnfusedExperts`: the same function, with every expert's ``gate_proj``, ``up_proj`` and
``down_proj`` an ``nn.Linear`` sharing the stacked parameters' memory. Every statistic the size planner
measures at a linear layer's input and output (Ĥ, F) is then measured per expert, on the tokens the router
sends it, and F at its down projection carries the router's weight on them (the output is scaled by it).

The converter (:mod:`compressor.output.gguf.converter`) stacks the experts of a layer into one
``ffn_{gate,up,down}_exps`` tensor: one GGML type for all of them, priced as the sum over its experts.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn

_PROJ = ("gate_proj", "up_proj", "down_proj")


class Expert(nn.Module):
    """One routed expert: ``down(act(gate x) · up x)``."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        for name, w in zip(_PROJ, (gate, up, down)):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            lin.weight = nn.Parameter(w, requires_grad=False)
            setattr(self, name, lin)


class UnfusedExperts(nn.ModuleList):
    """A layer's routed experts as :class:`Expert` modules (``experts.0.gate_proj`` …), computing what the
    stacked module computed: each expert on the tokens routed to it, scaled by the router's weight, summed."""

    def __init__(self, fused: nn.Module) -> None:
        gate_up, down = fused.gate_up_proj.data, fused.down_proj.data
        width = gate_up.shape[1] // 2
        super().__init__([Expert(gate_up[e, :width], gate_up[e, width:], down[e]) for e in range(gate_up.shape[0])])
        self.act_fn = fused.act_fn
        self.num_experts = len(self)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == self.num_experts:
                continue
            pos, token = torch.where(mask[e])
            x = hidden_states[token]
            expert = self[e]
            y = expert.down_proj(self.act_fn(expert.gate_proj(x)) * expert.up_proj(x))
            out.index_add_(0, token, (y * top_k_weights[token, pos, None]).to(out.dtype))
        return out


def _fused(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and hasattr(module, "act_fn"))


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def unfuse_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Swap every stacked-experts module of ``model`` for :class:`UnfusedExperts`, in place; returns the modules
    swapped out, by name. The parameters are shared, not copied."""
    found = [(name, m) for name, m in model.named_modules() if _fused(m)]
    for name, m in found:
        _swap(model, name, UnfusedExperts(m))
    return found


_EXPERT_MODULE = re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)(\.weight)?$")


def checkpoint_name(model_type: str, name: str) -> str:
    """An unfused expert projection's name (``model.layers.3.mlp.experts.5.up_proj.weight``) as the checkpoint
    on disk names it (what the converter's layout is keyed by); any other name as it is."""
    from compressor.core.archs import ARCHITECTURES

    m = _EXPERT_MODULE.match(name)
    spec = ARCHITECTURES.get(model_type)
    if m is None or spec is None or spec.experts is None:
        return name
    layer, e, proj, suffix = m.groups()
    return f"{layer}.{spec.experts[_PROJ.index(proj)].format(e=e)}{suffix or ''}"


@contextlib.contextmanager
def unfused_experts(model: nn.Module):
    """``model`` with its stacked experts unfused (:func:`unfuse_experts`) inside the block, and the original
    modules back after it: the model handed in is the model handed back."""
    found = unfuse_experts(model)
    try:
        yield model
    finally:
        for name, m in found:
            _swap(model, name, m)
