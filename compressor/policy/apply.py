"""Apply: install a choice's fits in the model, take them out again, and record what was decided.

A choice (``{block: Level or None}``, from :class:`compressor.policy.allocate.Allocation`) becomes fits
in one of two ways: re-solved from the statistics pass A kept (no calibration pass; the search's
every step), or fitted on one more calibration walk (a teacher target, which needs the compressed
model's own inputs; or statistics that were not kept).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from compressor.engine.spill import BlockStore
from compressor.engine.walker import LayerStats
from compressor.fitting.kinds import BlockData, Fitted, Level
from compressor.policy.allocate import BlockCurve
from compressor.policy.plan import Blocks, LayerResult
from compressor.policy.result import BlockDecision

Choice = dict[int, Level | None]


class Installer:
    """Puts fits into the model for a choice, and restores the original FFNs.

    ``walk(desc, step, take, **kwargs)``: a checkpointed calibration walk
    (:func:`compressor.policy.plan.checkpointed_walk` over the run's walker and state)."""

    def __init__(self, blocks: Blocks, kept: BlockStore, walk: Callable[..., None]) -> None:
        self.blocks, self.kept, self.walk = blocks, kept, walk
        self.originals = {i: blocks.ffn(i) for i in blocks.modules}
        # (block, units) → its fit, when fits live on disk: a block keeps its width across the search's
        # steps, and the chosen target is installed again at the end.
        self._on_disk: dict[tuple[int, int], Fitted] = {}

    def restore(self) -> None:
        for i, mod in self.originals.items():
            self.blocks.model.set_submodule(self.blocks.modules[i], mod)

    def install(self, choice: Choice, target: str, desc: str) -> dict[int, Fitted]:
        """The original model, then ``choice``'s blocks replaced by fits to ``target``; returns the fits.
        ``desc`` names the calibration walk (its records) when one is needed."""
        self.restore()
        narrowed = {i: lv for i, lv in choice.items() if lv is not None}
        if target == "none" and all(i in self.kept for i in narrowed):
            return {i: self._resolve(i, lv) for i, lv in narrowed.items()}
        fits: dict[int, Fitted] = {}

        def step(i: int, st: LayerStats) -> LayerResult:
            return LayerResult(i, fitted=self.blocks.fit_at(self.blocks.data(i, st), choice[i].size))

        def take(r: LayerResult, reload=None) -> nn.Module:
            mod = r.fitted.build(self.originals[r.index])
            fits[r.index] = self.kept.keep_fit(r.fitted)  # may move its tensors to disk: after the build
            return mod

        self.walk(desc, step, take, target=target, layers=list(narrowed))
        return fits

    def _resolve(self, i: int, lv: Level) -> Fitted:
        f = self._on_disk.get((i, lv.size))
        if f is None:
            f = self.kept.keep_fit(self.blocks.fit_at(self.kept[i], lv.size))
        if self.kept.spill:  # fits on disk: kept for the next attempt that wants this width
            self._on_disk[i, lv.size] = f
        self.blocks.model.set_submodule(self.blocks.modules[i], f.build(self.originals[i]))
        return f


def record_choice(decisions: list[BlockDecision], excluded: set[int], curves: list[BlockCurve], choice: Choice,
                  fits: dict[int, Fitted], keep: float, target: str, gate_said: str, *, standard: bool) -> None:
    """Every candidate's decision at the chosen target: kept (with its fit and predicted cost) or not replaced."""
    curve_of = {c.index: c for c in curves}
    for d in decisions:
        if d.index in excluded:
            continue
        lv = choice.get(d.index)
        if lv is None:
            d.decision, d.reason = "not replaced", f"allocation kept the original at ffn_keep {keep:.3f}"
            continue
        f = fits[d.index]
        d.decision = "kept"
        d.reason = (f"every block at width {lv.size} (output.architecture: standard)" if standard else
                    f"allocated {lv.size} units at ffn_keep {keep:.3f}") + f" (target {target}); {gate_said}"
        d.size, d.replacement_params = lv.size, f.params
        d.r2_replacement = f.heldout_r2 if f.heldout_r2 == f.heldout_r2 else 1.0 - lv.heldout_rel_error
        d.predicted_cost = curve_of[d.index].weight * lv.heldout_rel_error


def reject_all(decisions: list[BlockDecision], excluded: set[int]) -> None:
    for d in decisions:
        if d.index not in excluded:
            d.decision, d.reason = "rejected", "no allocated target tried passed the gate"
