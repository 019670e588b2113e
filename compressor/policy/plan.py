"""Plan: pass A, one layer-sequential walk that measures every block and says what it offers.

Per block: its R²_lin profile, and either the kind's fit at its configured level (``greedy``) or its
error curve (``allocate``: a :class:`~compressor.policy.allocate.BlockCurve`, whose rungs are the
block's options) with the statistics kept for re-solves at other levels
(:class:`~compressor.engine.spill.BlockStore`). :class:`Blocks` is what every stage shares: where
the FFN blocks are and how the kind fits one at a size.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from compressor.engine.profiling import BlockProfile, block_profile
from compressor.engine.records import register_record
from compressor.engine.runstate import RunState
from compressor.engine.spill import BlockStore
from compressor.engine.walker import LayerStats, LayerWalker
from compressor.fitting.kinds import BlockData, Fitted
from compressor.policy.allocate import BlockCurve
from compressor.recipe.schema import Recipe

logger = logging.getLogger(__name__)

# The hidden-unit kinds re-solve the down projection on the kept units: with fewer fit rows per
# unit than this, its error on unseen text is visibly inflated by overfitting (n / (n − p)).
MIN_ROWS_PER_UNIT = 5


def scarce_rows_message(rows: int, units: int, max_tokens: int, heldout_fraction: float,
                        ridge: float = 0.0) -> str | None:
    """A warning when ``rows`` fit rows are few for an exact re-solve on up to ``units`` hidden units, or None
    (also None with ``replacement.ridge`` > 0, which is what keeps such a re-solve from fitting noise).

    Least squares on ``n`` rows and ``p`` regressors errs on unseen rows at least ``n / (n − p)`` times
    as much as it would with unlimited rows (the classical out-of-sample inflation of OLS); on real
    blocks it is far more (Qwen2.5-Coder-1.5B at 1.6 rows per unit: held-out error 43× the fit rows',
    ``tools/structural/results/resolve_rows_qwen2.5_coder_1.5b.json``)."""
    if ridge > 0 or rows >= MIN_ROWS_PER_UNIT * units:
        return None
    p = max(units - 256, units // 2)  # a small cut: where the allocation starts
    need = math.ceil(MIN_ROWS_PER_UNIT * units / (1 - heldout_fraction) / 1024) * 1024
    effect = (f"at least {rows / (rows - p):.1f}× the error the same units would have with unlimited text (at "
              f"{p:,} units; measured on real blocks: far more)" if rows > p else
              "underdetermined (fewer rows than units)")
    return (f"calibration: {rows:,} fit rows for FFNs of {units:,} hidden units ({rows / units:.1f} per unit) and "
            f"replacement.ridge 0. An exact re-solve of the down projection on the kept units then errs on unseen "
            f"text by {effect}, so even small cuts look costly to the gate. Keep the default replacement.ridge (1), "
            f"or give ≥ {MIN_ROWS_PER_UNIT} rows per unit: calibration.max_tokens ≥ {need:,} (now {max_tokens:,})")


@dataclass
class LayerResult:
    """What one layer's step of a walk produced; serialisable (:mod:`compressor.engine.runstate`
    checkpoints it, and a resumed run takes it instead of measuring the layer again)."""

    index: int
    profile: BlockProfile | None = None
    fitted: Fitted | None = None
    curve: BlockCurve | None = None
    data: BlockData | None = None
    """allocate: the block's statistics kept for re-solves at other levels (None when memory is short)."""


def checkpointed_walk(walker: LayerWalker, state: RunState, desc: str,
                      step: Callable[[int, LayerStats], LayerResult],
                      apply: Callable[..., nn.Module | None], **kwargs) -> None:
    """One layer walk: ``step`` turns a layer's statistics into a :class:`LayerResult`,
    which is recorded, then ``apply(result, reload)`` takes it in (and may return a replacement to
    install); ``reload()`` reads the record back from disk (None when the run records nothing).
    Layers an interrupted run finished are not measured again: their records are applied."""
    records = state.walk(desc)

    def reloader(i: int) -> Callable[[], LayerResult] | None:
        return (lambda: records.load(i)) if records.on_disk else None

    def on_layer(i: int, st: LayerStats):
        result = step(i, st)
        records.save(i, result)
        return apply(result, reloader(i))

    walker.walk(on_layer, done=records.done, replay=lambda i: apply(records.load(i), reloader(i)), desc=desc,
                **kwargs)


def activation(model: nn.Module, spec) -> str | None:
    """The activation function named by the model's config (the architecture row says where), or None."""
    cfg = model.config
    for attr in spec.act_attrs:
        value = getattr(cfg, attr, None)
        if isinstance(value, str):
            return value
    return None


def block_weight(mode: str, st: LayerStats, grad_moment: torch.Tensor | None) -> float:
    """The block's sensitivity: cost per unit of held-out relative output error (see
    :mod:`compressor.policy.allocate`)."""
    if mode == "fisher":
        if grad_moment is None:
            raise ValueError("fisher allocation needs the loss-gradient statistics")
        return float((grad_moment * st.xy.fit.cyy_diag).sum()) / max(st.xy.fit.n, 1)
    if mode == "residual":
        bulk = st.xy.heldout["bulk"]
        energy = float(bulk.cyy_diag.sum()) / max(bulk.n, 1)
        return energy / st.resid_energy if st.resid_energy > 0 else 1.0
    return 1.0


@dataclass
class Blocks:
    """The model's FFN blocks as the policy sees them, and how the replacement kind fits one."""

    model: nn.Module
    spec: Any
    """The architecture's row (:mod:`compressor.core.archs`)."""
    kind: Any
    """The replacement kind (:func:`compressor.fitting.kinds.get_kind`)."""
    rc: Any
    """The recipe's ``replacement`` section."""
    modules: dict[int, str]
    """Block index → the FFN module's path."""
    ffn_params: dict[int, int]
    """Block index → the parameters of its original FFN."""
    act: str | None = None
    widths: dict = field(default_factory=dict)
    """``{"multiple": m}`` when the width rule restricts the kept widths (else empty: the default calls)."""
    intercept: bool = True
    grad_moments: dict[int, torch.Tensor] = field(default_factory=dict)
    grid: dict[int, str] = field(default_factory=dict)
    """Block index → the GGML type the output file stores its re-solved down projection in, for a kind
    that snaps onto it (:mod:`compressor.fitting.snap`); empty: float fits."""

    def ffn(self, i: int) -> nn.Module:
        return self.model.get_submodule(self.modules[i])

    def data(self, i: int, st: LayerStats) -> BlockData:
        return BlockData(i, self.ffn(i), self.spec, self.act, st.xy.fit, st.xy.heldout_total(), st.zfit, st.zheld,
                         output_weight=self.grad_moments.get(i))

    def fit_at(self, data: BlockData, size: int) -> Fitted:
        extra = {} if self.intercept else {"intercept": False}
        if self.kind.snaps and data.index in self.grid:
            extra["grid"] = self.grid[data.index]
        return self.kind.fit(data, self.rc, size, **self.widths, **extra)


@dataclass
class Plan:
    """What pass A found: every block's profile, and its fit (greedy) or curve (allocate)."""

    profiles: list[BlockProfile | None]
    fitted: dict[int, Fitted] = field(default_factory=dict)
    curves: list[BlockCurve] = field(default_factory=list)


def measure(blocks: Blocks, recipe: Recipe, strategy: str, walk: Callable[..., None], kept: BlockStore,
            desc: str) -> Plan:
    """Pass A over every block (``walk``: :func:`checkpointed_walk` over the run's walker and state);
    ``kept`` receives the statistics of every block (allocate) and its fits."""
    rc, m, pol, cal = recipe.replacement, recipe.measure, recipe.policy, recipe.calibration
    plan = Plan([None] * len(blocks.modules))
    warned: list[bool] = []

    def step(i: int, st: LayerStats) -> LayerResult:
        prof, _ = block_profile(st.xy, outlier_share_flag=m.outlier_share_flag)
        prof.ffn_params, prof.affine_params = blocks.ffn_params[i], prof.d_in * prof.d_out + prof.d_out
        data = blocks.data(i, st)
        if blocks.kind.needs_hidden and not warned and data.zfit is not None:
            warned.append(True)
            msg = scarce_rows_message(int(data.zfit.n), data.d_ff, cal.max_tokens, cal.heldout_fraction,
                                      getattr(rc, "ridge", 0.0))
            if msg:
                logger.warning("%s", msg)
        if strategy == "greedy":
            return LayerResult(
                i, prof, fitted=blocks.fit_at(data, blocks.kind.default_level(data, rc, **blocks.widths))
            )
        levels = blocks.kind.levels(data, rc, **blocks.widths)
        weight = block_weight(pol.allocation, st, blocks.grad_moments.get(i))
        data.zheld = None  # the curve holds what the held-out rows had to say
        return LayerResult(i, prof, curve=BlockCurve(i, blocks.ffn_params[i], levels, weight), data=data)

    def take(r: LayerResult, reload: Callable[[], LayerResult] | None = None) -> None:
        plan.profiles[r.index] = r.profile
        if r.fitted is not None:
            plan.fitted[r.index] = kept.keep_fit(r.fitted)
        if r.curve is not None:
            plan.curves.append(r.curve)
        if r.data is not None:
            r.data.ffn, r.data.spec = blocks.ffn(r.index), blocks.spec  # not recorded: live objects
            if reload is None:
                kept[r.index] = r.data
            else:  # the record holds the statistics already: a spilling store reads them from there
                kept.keep_recorded(r.index, r.data, lambda: reload().data)
        return None

    walk(desc, step, take)
    return plan


register_record(LayerResult)
