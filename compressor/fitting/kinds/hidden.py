"""Shared machinery of the hidden-unit kinds (``prune`` and ``hybrid``).

Both keep a subset ``K`` of the FFN's hidden units exactly as they are (their
gate/up rows) and re-solve the output map in closed form from the streamed
statistics of ``z = [x, h]``: ``prune`` on ``h_K`` alone (FLAP-like structured
pruning with closed-form compensation), ``hybrid`` on ``[h_K, x]`` (kept units
plus an affine bypass). ``K`` comes from the OBS path (:mod:`compressor.fitting.obs`).

Widths on a grid (``multiple``): an output may take only FFN widths that are
multiples of ``M`` (GGML quantization blocks, one standard width). The width
of a replacement as a gated MLP is its kept units, plus ``d`` for the hybrid
bypass (:mod:`compressor.output.gated`), so the allowed unit counts are
``k ≡ -bypass (mod M)``, all reachable. The path then runs with a step that
divides ``M`` and lands on those counts (:func:`grid_step`), and
:meth:`HiddenUnitKind.levels` offers only them: the allocation chooses among
widths the output can take; nothing is rounded afterwards.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from compressor.fitting.solve import (DEAD_COLUMN_RTOL, score, shrunk, solve_affine, solve_linear, solve_shrunk,
                                      subset)
from compressor.fitting.obs import ObsPath, obs_path
from compressor.core.onload import execution_device, tensor
from compressor.fitting.kinds.base import BlockData, Fitted, Kind, Level


def linear_params(mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W [out, in], bias)`` of an ``nn.Linear`` or a GPT-2 ``Conv1D`` (weight stored [in, out])."""
    w = tensor(mod, "weight")  # read back from the offload store when the layer is onloaded
    if type(mod).__name__ == "Conv1D":
        w = w.T
    return w.detach(), None if getattr(mod, "bias", None) is None else tensor(mod, "bias").detach()


logger = logging.getLogger(__name__)


def grid_step(step: int, span: int, multiple: int) -> int:
    """The largest divisor of ``gcd(multiple, span)`` that is at most ``step``.

    A path that removes that many units per step, starting ``span`` units above a width on the
    grid of ``multiple``, visits every width of the grid below it.

    >>> grid_step(12, 1536, 64), grid_step(70, 8960, 256), grid_step(12, 1530, 64)
    (8, 64, 2)
    """
    g = math.gcd(multiple, span)
    return max(d for d in range(1, min(step, g) + 1) if g % d == 0)


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

    @staticmethod
    def prior(data: BlockData) -> torch.Tensor:
        """The original model's coefficients over ``z = [x, h]`` ([d + d_ff, d_out], float64): zero for the
        bypass ``x``, the down projection for ``h``. The ridge (``replacement.ridge``) shrinks toward them."""
        w, _ = linear_params(data.ffn.get_submodule(data.spec.ffn_down))
        out = torch.zeros(data.zfit.d_in, data.d_out, dtype=torch.float64)
        out[data.d:] = w.T.to(torch.float64).cpu()
        return out

    def path(self, data: BlockData, cfg, multiple: int = 1) -> ObsPath:
        step = cfg.step_units or max(1, math.ceil(data.d_ff / 128))
        if multiple > 1:
            step = self._grid_step(data, cfg, step, multiple)
        weight = data.output_weight if cfg.selection == "loss" else None
        if cfg.selection == "loss" and weight is None:
            raise ValueError("replacement.selection: loss needs the loss-gradient statistics of the block output")
        ridge = getattr(cfg, "ridge", 0.0)
        key = (self.name, step, cfg.selection, ridge)
        if data.cache.get("obs_key") != key:
            zfit, zheld = self._moments(data)
            prior = None
            if ridge:
                prior = self.prior(data)
                prior = prior if self.bypass else prior[data.d:]
            data.cache["obs"] = obs_path(zfit, zheld, data.d if self.bypass else 0, step=step,
                                         output_weight=weight, device=_device(data), ridge=ridge, prior=prior)
            data.cache["obs_key"] = key
        return data.cache["obs"]

    def _grid_step(self, data: BlockData, cfg, step: int, multiple: int) -> int:
        """A path step that visits every unit count whose width is on the grid of ``multiple``.

        The path first drops the dead units (zero variance, the rule of :mod:`compressor.fitting.obs`)
        at once, then ``step`` at a time from the live count: the step must divide the distance from
        there to the grid."""
        diag = torch.diagonal(data.zfit.cxx)
        diag = diag if self.bypass else diag[data.d:]  # the regressors of this kind's path
        n_live = int((diag[data.d if self.bypass else 0:] > DEAD_COLUMN_RTOL * float(diag.mean())).sum())
        span = self.width(data, n_live)
        aligned = grid_step(step, span, multiple)
        if cfg.step_units is not None and aligned != step:
            logger.warning("block %d: replacement.step_units %d misses widths in multiples of %d from %d live units; "
                           "using %d", data.index, step, multiple, n_live, aligned)
        return aligned

    def width(self, data: BlockData, units: int) -> int:
        """The FFN width of the replacement as a gated MLP: its kept units, plus ``d`` for the bypass
        (an affine map of rank ``d`` is ``d`` constant-gate units; :mod:`compressor.output.gated`)."""
        return units + (data.d if self.bypass else 0)

    def unit_params(self, data: BlockData) -> int:
        gated = len(data.spec.ffn_up) == 2
        up_bias = linear_params(data.ffn.get_submodule(data.spec.ffn_up[0]))[1] is not None
        return (2 if gated else 1) * (data.d + int(up_bias)) + data.d_out

    def params_at(self, data: BlockData, units: int) -> int:
        bypass = data.d * data.d_out if self.bypass else 0
        return bypass + data.d_out + units * self.unit_params(data)

    def grid(self, data: BlockData, multiple: int) -> list[int]:
        """Unit counts whose width is a positive multiple of ``multiple``, descending (a zero width is
        left out: llama.cpp's per-layer-width graph skips attention with it)."""
        return [k for k in range(data.d_ff, -1, -1) if (w := self.width(data, k)) > 0 and w % multiple == 0]

    def levels(self, data: BlockData, cfg, multiple: int = 1) -> list[Level]:
        """The ladder: every size the path visits, or with ``multiple`` > 1 only the sizes on its grid."""
        p = self.path(data, cfg, multiple)
        if multiple == 1:
            return [Level(k, self.params_at(data, k), e) for k, e in zip(p.sizes, p.heldout_rel_error)]
        error = dict(zip(p.sizes, p.heldout_rel_error))
        # The aligned step visits every grid size up to the live units; above them (dead units kept
        # with zero weight) the error is the live units' own, the next visited size up.
        return [Level(k, self.params_at(data, k), error[k] if k in error else error[min(s for s in error if s > k)])
                for k in self.grid(data, multiple)]

    def default_level(self, data: BlockData, cfg, multiple: int = 1) -> int:
        if cfg.keep is None:
            raise ValueError(f"replacement.keep is required for kind {self.name} unless the policy allocates units")
        k = int(round(cfg.keep * data.d_ff))
        return k if multiple == 1 else min(self.grid(data, multiple), key=lambda g: (abs(g - k), -g))

    # -- the fit ----------------------------------------------------------
    def fit(self, data: BlockData, cfg, size: int, multiple: int = 1, intercept: bool = True,
            grid: str | None = None) -> Fitted:
        """The replacement keeping ``size`` units (from the path of ``multiple``); ``intercept=False``
        solves the output map through the origin (its bias is zero: for a class without an MLP bias).
        ``grid``: the GGML type the output file stores the down projection in (``prune`` only): the solved
        map is snapped onto it (:func:`compressor.fitting.snap.snap`), its bytes kept in ``Fitted.stored``."""
        spec, ffn = data.spec, data.ffn
        if not spec.ffn_up or not spec.ffn_down:
            raise ValueError(
                f"kind {self.name} needs the FFN's hidden units; this architecture has no ffn_up/ffn_down row"
            )
        kept = self.path(data, cfg, multiple).kept(size)
        # Regressor columns in the module's order: [h_K, x] (x only with the bypass).
        cols = kept + data.d
        if self.bypass:
            cols = torch.cat([cols, torch.arange(data.d)])
        ridge = getattr(cfg, "ridge", 0.0)
        if cols.numel() and ridge:
            m = shrunk(subset(data.zfit, cols), ridge, self.prior(data)[cols])
            W, b, warnings = solve_shrunk(m, intercept=intercept, device=_device(data))
        elif cols.numel():
            f = (solve_affine if intercept else solve_linear)(subset(data.zfit, cols), device=_device(data))
            W, b, warnings = f.W, f.b, list(f.warnings)
        else:  # no units, no bypass: the best constant is the mean output
            my = data.zfit.my.cpu()
            W, b, warnings = (
                torch.zeros(0, data.d_out, dtype=torch.float64),
                my if intercept else torch.zeros_like(my),
                [],
            )
        stored = {}
        if grid is not None and size and not self.bypass:
            W, b, stored = self._snap(data, cols, W, b, grid, intercept)
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
                      params=self.params_at(data, size), heldout_r2=r2, warnings=warnings, stored=stored)

    @staticmethod
    def _snap(data: BlockData, cols: torch.Tensor, W: torch.Tensor, b: torch.Tensor, grid: str, intercept: bool):
        """``(W, b, stored)`` of the map snapped onto ``grid`` ([k, d_out] in, as solved)."""
        from compressor.core.ggml import GGMLType
        from compressor.fitting.snap import snap

        m = subset(data.zfit, cols)
        qtype = GGMLType[grid]
        Wq, bq, raw = snap(W.T, m.cxx.cpu() / m.n, m.mx.cpu(), m.my.cpu(), qtype, intercept=intercept)
        return Wq.T.contiguous(), bq, {"out.weight": (qtype.name, torch.from_numpy(raw))}
