"""The size workflow (``output.size``): the file users ship, planned to a byte budget; no block changes.

plan → allocate → write → verify → gate → back off, in one package:

* what a size plans into is the format's: its package registers a size target beside its writer
  (:mod:`compressor.output.registry`; :mod:`compressor.output.gguf.target`, :mod:`compressor.output.ctensors.target`);
  what every format shares is :mod:`compressor.sizing` (the target's interface, sites, prices, plan, budget);
* :mod:`.checks` — what a size needs before the model loads; :mod:`.ship` — the run; :mod:`.runtime` — its
  estimate;
* :mod:`.prices` — one backward pass and the input moments of every linear layer, then every tensor
  priced in every option of the target (cached with the statistics);
* :mod:`.planner` — the least predicted loss within a byte budget (:mod:`compressor.sizing.plan`);
* :mod:`.stage` — the loop: each plan handed to the format's writer as an argument, written and verified where
  it runs (llama.cpp), judged by the gate's rule (:mod:`.gate`), ``smallest`` searched with the gate's search.

:class:`SizeWorkflow` is chosen by :func:`compressor.pipeline.workflow.workflow_for`; the structural workflow is
:mod:`compressor.pipeline.structural`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from compressor.output.base import WriteRequest
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import Recipe


class SizeWorkflow:
    """A run that plans the file a user ships to ``output.size``: it changes no block of the model."""

    changes_blocks = False

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    def default_formats(self, model_type: str, src) -> list[str]:
        """The format whose anchor the size names (``W4A16``: compressed-tensors), else ``[gguf]``: a size is the
        file a deployer ships, and nothing else."""
        from compressor.output.registry import default_format

        return [default_format(self.recipe.output.size)]

    def check_config(self, config, *, writes: bool, given: bool) -> None:
        """A float source, an architecture the target plans (experts included), and the memory (onloading by
        itself where its format streams)."""
        from compressor.pipeline.size.checks import check_moe, check_source, fit_memory

        check_moe(self.recipe, config)
        check_source(self.recipe, config)
        if writes and not given:
            fit_memory(self.recipe, config)

    def check_evaluation(self, streams: dict[str, torch.Tensor], *, writes: bool) -> None:
        """A size plans the file a deployer ships: a run that writes nothing is refused (its files are gated on
        every window, so there is no held-out confirmation to size)."""
        from compressor.pipeline.size.checks import check_output

        check_output(self.recipe, writes=writes)

    def check_writers(self, tokenizer, model_type: str, src, config) -> None:
        """The size's own rules (one sized format, its architecture), then each writer as the planned format's
        target sees it (:func:`~.checks.writer_refusal`)."""
        from compressor.pipeline.formats import refuse_writer, writer_refusals
        from compressor.pipeline.size.checks import check, writer_refusal

        check(self.recipe, model_type, src, config=config)
        refusals = writer_refusals(self.recipe, "none", tokenizer, model_type, src)  # a size replaces no block
        for name, why in refusals.items():
            refuse_writer(self.recipe.output, name, writer_refusal(self.recipe, name, why, model_type, src))

    def compress(self, loaded, calibrated, checked) -> CompressionResult:
        """The blocks stay as they are: the original's evaluation on the gate's domains
        (:func:`~.ship.baseline_only`)."""
        from compressor.pipeline.size.ship import baseline_only

        return baseline_only(loaded.model, self.recipe, checked.eval_streams)

    def ship(self, request: WriteRequest, windows: torch.Tensor, checked, report: dict, result: CompressionResult,
             *, use_cache: bool) -> Path:
        """plan → allocate → write → verify → gate → back off: the verified staging folder of the chosen file."""
        from compressor.pipeline.size.ship import ship

        return ship(self.recipe, request, windows, checked, report, result, use_cache=use_cache)

    def follow(self, request: WriteRequest, windows: torch.Tensor) -> tuple:
        """A rank other than 0 under torchrun: its share of the size plan's statistics, pricing and rounding, with
        rank 0 (:func:`~compressor.pipeline.size.prices.follow`); rank 0 plans and writes. Returns rank 0's last
        word."""
        from compressor.core import distributed as dist
        from compressor.core.moe import unfused_experts
        from compressor.pipeline.size.prices import follow
        from compressor.pipeline.size.rounding import Compensator

        bs = self.recipe.calibration.batch_size
        with unfused_experts(request.model):  # the same modules as rank 0 measures (compressor.core.moe)
            priced = follow(request, windows, bs)
        last = None
        if priced is not None:
            go, measured = priced
            # as rank 0 rounds: outside the unfused experts
            last = Compensator.of(request, measured, windows, bs, {}, go.target, spill=go.spill()).follow()
        return last if last is not None else dist.broadcast_object()

    def estimate(self, model, fwd: float, *, hidden: bool, recorded: dict) -> dict[str, float]:
        from compressor.pipeline.size.runtime import estimate

        return estimate(self.recipe, model, fwd)


__all__ = ["SizeWorkflow"]
