"""Shared machinery of the hidden-unit kinds (``prune`` and ``hybrid``).

Both keep a subset ``K`` of the FFN's hidden units exactly as they are (their
gate/up rows) and re-solve the output map in closed form from the streamed
statistics of ``z = [x, h]``: ``prune`` on ``h_K`` alone (FLAP-like structured
pruning with closed-form compensation), ``hybrid`` on ``[h_K, x]`` (kept units
plus an affine bypass). ``K`` comes from the OBS path (:mod:`compressor.fitting.obs`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from compressor.fitting.solve import score, solve_affine, subset
from compressor.fitting.obs import ObsPath, obs_path
from compressor.core.onload import execution_device, tensor
from compressor.fitting.kinds.base import BlockData, Fitted, Kind, Level


def linear_params(mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W [out, in], bias)`` of an ``nn.Linear`` or a GPT-2 ``Conv1D`` (weight stored [in, out])."""
    w = tensor(mod, "weight")  # read back from the offload store when the layer is onloaded
    if type(mod).__name__ == "Conv1D":
        w = w.T
    return w.detach(), None if getattr(mod, "bias", None) is None else tensor(mod, "bias").detach()


def _device(data: BlockData) -> torch.device:
    """Solve where the block's weights live (a GPU factorises 2k×2k float64 matrices in milliseconds)."""
    return execution_device(data.ffn)


class HiddenUnitKind(Kind):
    needs_hidden = True
    bypass: bool

    # -- the path ---------------------------------------------------------
    def _moments(self, data: BlockData):
        """(fit, held-out) statistics over this kind's regressors; x first when bypassed."""
        if self.bypass:
            return data.zfit, data.zheld
        cols = torch.arange(data.d, data.d + data.d_ff)
        return subset(data.zfit, cols), subset(data.zheld, cols) if data.zheld is not None else None

    def path(self, data: BlockData, cfg) -> ObsPath:
        step = cfg.step_units or max(1, math.ceil(data.d_ff / 128))
        weight = data.output_weight if cfg.selection == "loss" else None
        if cfg.selection == "loss" and weight is None:
            raise ValueError("replacement.selection: loss needs the loss-gradient statistics of the block output")
        key = (self.name, step, cfg.selection)
        if data.cache.get("obs_key") != key:
            zfit, zheld = self._moments(data)
            data.cache["obs"] = obs_path(zfit, zheld, data.d if self.bypass else 0, step=step,
                                         output_weight=weight, device=_device(data))
            data.cache["obs_key"] = key
        return data.cache["obs"]

    def unit_params(self, data: BlockData) -> int:
        gated = len(data.spec.ffn_up) == 2
        up_bias = linear_params(data.ffn.get_submodule(data.spec.ffn_up[0]))[1] is not None
        return (2 if gated else 1) * (data.d + int(up_bias)) + data.d_out

    def params_at(self, data: BlockData, units: int) -> int:
        bypass = data.d * data.d_out if self.bypass else 0
        return bypass + data.d_out + units * self.unit_params(data)

    def levels(self, data: BlockData, cfg) -> list[Level]:
        p = self.path(data, cfg)
        return [Level(k, self.params_at(data, k), e) for k, e in zip(p.sizes, p.heldout_rel_error)]

    def default_level(self, data: BlockData, cfg) -> int:
        if cfg.keep is None:
            raise ValueError(f"replacement.keep is required for kind {self.name} unless the policy allocates units")
        return int(round(cfg.keep * data.d_ff))

    # -- the fit ----------------------------------------------------------
    def fit(self, data: BlockData, cfg, size: int) -> Fitted:
        spec, ffn = data.spec, data.ffn
        if not spec.ffn_up or not spec.ffn_down:
            raise ValueError(f"kind {self.name} needs the FFN's hidden units; this architecture has no ffn_up/ffn_down row")
        kept = self.path(data, cfg).kept(size)
        # Regressor columns in the module's order: [h_K, x] (x only with the bypass).
        cols = kept + data.d
        if self.bypass:
            cols = torch.cat([cols, torch.arange(data.d)])
        if cols.numel():
            f = solve_affine(subset(data.zfit, cols), device=_device(data))
            W, b, warnings = f.W, f.b, list(f.warnings)
        else:  # no units, no bypass: the best constant is the mean output
            W, b, warnings = torch.zeros(0, data.d_out, dtype=torch.float64), data.zfit.my.cpu(), []
        r2 = score(subset(data.zheld, cols), W, b).r2 if data.zheld is not None else float("nan")
        ups = [linear_params(ffn.get_submodule(name)) for name in spec.ffn_up]
        up_w = torch.cat([w[kept] for w, _ in ups]).to(torch.float64)
        tensors = {"out.weight": W.T, "out.bias": b}
        up_bias = ups[0][1] is not None
        if size:
            tensors["up.weight"] = up_w
            if up_bias:
                tensors["up.bias"] = torch.cat([b[kept] for _, b in ups]).to(torch.float64)
        config = {
            "in_features": data.d, "out_features": data.d_out, "units": int(size), "act": data.act,
            "gated": len(spec.ffn_up) == 2, "up_bias": up_bias, "bypass": self.bypass,
        }
        return Fitted(kind=self.name, index=data.index, config=config, tensors=tensors,
                      params=self.params_at(data, size), heldout_r2=r2, warnings=warnings)
