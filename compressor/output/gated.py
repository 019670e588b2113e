"""Every FFN replacement as one gated MLP with biases: the form llama.cpp runs.

llama.cpp's Llama-family graphs compute an FFN as

    y = W_down (silu(W_gate x + b_gate) * (W_up x + b_up)) + b_down

with a width (the number of hidden units) per layer. Every replacement kind
is exactly such a block:

* an **original** gated MLP (untouched block) and the **prune** kind (kept
  hidden units, gate and up rows fused in one ``up`` Linear) are gated MLPs
  already;
* an **affine** map ``y = W x + b`` and a **low-rank** map ``y = U V x + b`` are
  gated MLPs of width ``r`` (``d`` for the full map): gate weights 0 and gate
  bias ``c``, so every unit's gate is the constant ``s = silu(c)``; up = ``V``
  (the identity for the full map), down = ``U / s``, down bias = ``b``;
* the **hybrid** kind is its kept units followed by such a width-``d`` affine
  bypass (``K + d`` units).

``c`` is chosen so that ``s`` is 1 (to float64 precision), keeping the down projection at the fitted map's
scale. Only SiLU-gated MLPs have this form: a plain ``act(W_up x)`` MLP (GPT-2) or another gate activation
(Gemma's GELU) is refused (:class:`NotRepresentableError`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from compressor.core.modeling import AffineFFN, HiddenUnitFFN, LowRankAffineFFN

#: ``c`` with ``silu(c) = c * sigmoid(c) = 1``: the constant gate of the affine units.
UNIT_GATE_BIAS = 1.2784645427610738


class NotRepresentableError(ValueError):
    """The module is not a SiLU-gated MLP in disguise (e.g. a plain GELU MLP)."""


@dataclass
class GatedMLP:
    """``down (silu(gate x + gate_b) * (up x + up_b)) + down_b`` of width ``gate_w.shape[0]``.

    Weights are ``[out, in]`` like ``nn.Linear``; every bias is present (zeros where
    the block has none) and :attr:`has_bias` says which are not all zero."""

    gate_w: torch.Tensor
    gate_b: torch.Tensor
    up_w: torch.Tensor
    up_b: torch.Tensor
    down_w: torch.Tensor
    down_b: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.gate_w.shape[0])

    @property
    def has_bias(self) -> dict[str, bool]:
        return {name: bool(getattr(self, name).abs().max() > 0) if getattr(self, name).numel() else False
                for name in ("gate_b", "up_b", "down_b")}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.gate_w.dtype)
        h = F.silu(F.linear(x, self.gate_w, self.gate_b)) * F.linear(x, self.up_w, self.up_b)
        return F.linear(h, self.down_w, self.down_b)

    def padded(self, multiple: int) -> "GatedMLP":
        """The same map with dead units (all weights 0) appended up to a multiple of ``multiple``
        (at least one unit): exact, at the cost of the padding's bytes and compute."""
        target = max(multiple, -(-self.width // multiple) * multiple)
        extra = target - self.width
        if extra == 0:
            return self
        d_in, d_out = self.gate_w.shape[1], self.down_w.shape[0]
        z = self.gate_w.new_zeros
        return GatedMLP(
            torch.cat([self.gate_w, z(extra, d_in)]), torch.cat([self.gate_b, z(extra)]),
            torch.cat([self.up_w, z(extra, d_in)]), torch.cat([self.up_b, z(extra)]),
            torch.cat([self.down_w, z(d_out, extra)], dim=1), self.down_b,
        )


def _is_silu(act: nn.Module | None) -> bool:
    if act is None:
        return False
    x = torch.linspace(-4, 4, 17)
    with torch.no_grad():
        return torch.allclose(act(x), F.silu(x), atol=1e-6)


def _bias(linear: nn.Linear, n: int) -> torch.Tensor:
    w = linear.weight
    return linear.bias.detach() if linear.bias is not None else w.new_zeros(n)


def affine_units(v: torch.Tensor, u: torch.Tensor, b: torch.Tensor) -> GatedMLP:
    """``y = u (v x) + b`` as ``r = v.shape[0]`` gated units with a constant gate."""
    r, d_in = v.shape
    s = F.silu(torch.tensor(UNIT_GATE_BIAS, dtype=torch.float64))
    return GatedMLP(
        gate_w=v.new_zeros(r, d_in), gate_b=v.new_full((r,), UNIT_GATE_BIAS),
        up_w=v, up_b=v.new_zeros(r),
        down_w=(u.double() / s).to(u.dtype), down_b=b,
    )


def _concat(a: GatedMLP, b: GatedMLP) -> GatedMLP:
    """Two gated MLPs on the same input, outputs summed: their units side by side."""
    return GatedMLP(
        torch.cat([a.gate_w, b.gate_w]), torch.cat([a.gate_b, b.gate_b]),
        torch.cat([a.up_w, b.up_w]), torch.cat([a.up_b, b.up_b]),
        torch.cat([a.down_w, b.down_w], dim=1), a.down_b + b.down_b,
    )


@torch.no_grad()
def as_gated(module: nn.Module, up_names: tuple[str, ...] = ("gate_proj", "up_proj"),
             down_name: str = "down_proj", in_features: int | None = None) -> GatedMLP:
    """The gated MLP equal to ``module``: a replacement (:class:`AffineFFN`,
    :class:`LowRankAffineFFN`, :class:`HiddenUnitFFN`) or an original gated MLP whose
    projections are named ``up_names`` = (gate, up) and ``down_name`` (the arch table's
    ``ffn_up``/``ffn_down``), with its activation in ``act_fn``. ``in_features`` is needed only
    for a replacement that keeps no unit and no bypass (a constant). Raises
    :class:`NotRepresentableError` for anything else."""
    if isinstance(module, AffineFFN):
        w = module.proj.weight.detach()
        eye = torch.eye(w.shape[1], dtype=w.dtype, device=w.device)
        return affine_units(eye, w, _bias(module.proj, w.shape[0]))
    if isinstance(module, LowRankAffineFFN):
        return affine_units(module.down.weight.detach(), module.up.weight.detach(),
                            _bias(module.up, module.up.weight.shape[0]))
    if isinstance(module, HiddenUnitFFN):
        return _hidden_units(module, in_features)
    if len(up_names) == 2 and all(hasattr(module, n) for n in (*up_names, down_name)):
        gate, up, down = (getattr(module, n) for n in (*up_names, down_name))
        if not _is_silu(getattr(module, "act_fn", None)):
            raise NotRepresentableError(
                f"{type(module).__name__}'s gate activation is not SiLU; llama.cpp's Llama-family FFN is SiLU-gated")
        k = gate.weight.shape[0]
        return GatedMLP(gate.weight.detach(), _bias(gate, k), up.weight.detach(), _bias(up, k),
                        down.weight.detach(), _bias(down, down.weight.shape[0]))
    raise NotRepresentableError(
        f"{type(module).__name__} is not a SiLU-gated MLP (projections {up_names} and {down_name!r}) nor a "
        "compressor replacement; only gated-SiLU architectures (llama, mistral, qwen2) can be written as GGUF")


def _hidden_units(m: HiddenUnitFFN, in_features: int | None) -> GatedMLP:
    d_out, k = m.out.out_features, m.units
    d_in = m.out.in_features - k if m.bypass else (m.up.in_features if m.up is not None else in_features)
    w_out = m.out.weight.detach()
    b_out = _bias(m.out, d_out)
    parts: list[GatedMLP] = []
    if k:
        if not m.gated or not _is_silu(m.act):
            raise NotRepresentableError(
                "the pruned FFN's hidden units are not SiLU-gated (plain or non-SiLU MLP); llama.cpp's "
                "Llama-family FFN is SiLU-gated: keep this model in the hf format")
        w_up = m.up.weight.detach()
        b_up = m.up.bias.detach() if m.up.bias is not None else w_up.new_zeros(2 * k)
        parts.append(GatedMLP(w_up[:k], b_up[:k], w_up[k:], b_up[k:], w_out[:, :k], b_out))
    if m.bypass:
        eye = torch.eye(d_in, dtype=w_out.dtype, device=w_out.device)
        bypass = affine_units(eye, w_out[:, k:], w_out.new_zeros(d_out) if parts else b_out)
        parts.append(bypass)
    if not parts:  # no units, no bypass: the constant b, carried by one dead unit
        if d_in is None:
            raise NotRepresentableError("a replacement with no hidden units and no bypass: pass in_features")
        z = w_out.new_zeros
        return GatedMLP(z(1, d_in), z(1), z(1, d_in), z(1), z(d_out, 1), b_out)
    return parts[0] if len(parts) == 1 else _concat(parts[0], parts[1])
