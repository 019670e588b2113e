"""The size stage (``output.size``): the file users ship, planned to a byte budget.

plan → allocate → write → gate → back off, in one package:

* what a size plans into is the format's: its package registers a size target beside its writer
  (:mod:`compressor.output.registry`; :mod:`compressor.output.gguf.target` — GGML types for llama.cpp, its
  budget the F16 and llama.cpp's preset of that name made from it, :mod:`compressor.output.gguf.budget`;
  :mod:`compressor.output.ctensors.target` — integer schemes of a compressed-tensors checkpoint); what every
  format shares is :mod:`compressor.sizing` (the target's interface, the sites and their prices' closed form,
  the plan and the budget);
* :mod:`.prices` — one backward pass and the input moments of every linear layer, then every tensor
  priced in every option of the target (cached with the statistics);
* :mod:`.planner` — the least predicted loss within a byte budget (:mod:`compressor.sizing.plan`);
* :mod:`.stage` — the loop: each plan written and measured by its writer where it runs (llama.cpp),
  judged by the gate's rule (:mod:`.gate`), ``smallest`` searched with the gate's own search.

A run's plan is chosen once, by :func:`sizing`: :class:`Sized` for a recipe with ``output.size``,
:class:`Structural` otherwise, whose hooks do nothing. The pipeline calls the hooks of the one it was given
(:mod:`.checks` before loading, :mod:`.ship` for the run, :mod:`.runtime` for the estimate) and asks nothing
else; the writers write the plan they are handed (:attr:`~compressor.output.base.WriteRequest.plans`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from compressor.output.base import WriteRequest
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import Recipe


class Structural:
    """A run that replaces blocks (or none): no file is planned to a size, and every hook of the size stage
    does nothing."""

    structural = True
    """Whether the run changes the model's blocks (its search is confirmed, its fits may snap onto the output's
    grid, and the model in memory becomes the compressed class after it)."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    def default_formats(self) -> list[str] | None:
        """``output.formats`` when the recipe names none (None: the pipeline's own default)."""
        return None

    def check(self, model_type: str, src, *, given=None, config=None) -> None:
        return None

    def check_source(self, config) -> None:
        return None

    def fit_memory(self, config) -> None:
        return None

    def check_output(self, *, writes: bool) -> None:
        return None

    def writer_refusal(self, name: str, why: str | None, model_type: str, src) -> str | None:
        return why

    def baseline_only(self, model, streams: dict[str, torch.Tensor]) -> CompressionResult | None:
        """None: the structural search evaluates the original itself."""
        return None

    def ship(self, request: WriteRequest, windows: torch.Tensor, checked, report: dict, result: CompressionResult,
             *, write: Callable[[], Path], use_cache: bool = True) -> Path | None:
        """None: the pipeline writes and verifies every format itself."""
        return None

    def follow(self, request: WriteRequest, windows: torch.Tensor):
        """A rank other than 0 under torchrun, while rank 0 ships: nothing (rank 0 writes alone); returns what
        it took of rank 0's last word, None here."""
        return None

    def estimate(self, model, cal: int, evals: int, fwd: float, params: int) -> dict[str, float] | None:
        return None


class Sized(Structural):
    """A run that plans the file a user ships to ``output.size``: it changes no block of the model."""

    structural = False

    def default_formats(self) -> list[str] | None:
        """The format whose anchor the size names (``W4A16``: compressed-tensors), else ``[gguf]``."""
        from compressor.output.registry import default_format

        return [default_format(self.recipe.output.size)]

    def check(self, model_type: str, src, *, given=None, config=None) -> None:
        from compressor.pipeline.size.checks import check

        check(self.recipe, model_type, src, given=given, config=config)

    def check_source(self, config) -> None:
        from compressor.pipeline.size.checks import check_source

        check_source(self.recipe, config)

    def fit_memory(self, config) -> None:
        from compressor.pipeline.size.checks import fit_memory

        fit_memory(self.recipe, config)

    def check_output(self, *, writes: bool) -> None:
        from compressor.pipeline.size.checks import check_output

        check_output(self.recipe, writes=writes)

    def writer_refusal(self, name: str, why: str | None, model_type: str, src) -> str | None:
        from compressor.pipeline.size.checks import writer_refusal

        return writer_refusal(self.recipe, name, why, model_type, src)

    def baseline_only(self, model, streams: dict[str, torch.Tensor]) -> CompressionResult:
        from compressor.pipeline.size.ship import baseline_only

        return baseline_only(model, self.recipe, streams)

    def ship(self, request: WriteRequest, windows: torch.Tensor, checked, report: dict, result: CompressionResult,
             *, write: Callable[[], Path], use_cache: bool = True) -> Path:
        from compressor.pipeline.size.ship import ship

        return ship(self.recipe, request, windows, checked, report, result, write=write, use_cache=use_cache)

    def follow(self, request: WriteRequest, windows: torch.Tensor):
        """A rank other than 0 under torchrun: its share of the size plan's statistics, pricing and rounding, with
        rank 0 (:func:`~compressor.pipeline.size.prices.follow`); rank 0 plans and writes. Returns rank 0's last
        word when it took it (None: still to come)."""
        from compressor.core.moe import unfused_experts
        from compressor.pipeline.size.prices import follow
        from compressor.pipeline.size.rounding import Compensator

        bs = self.recipe.calibration.batch_size
        with unfused_experts(request.model):  # the same modules as rank 0 measures (compressor.core.moe)
            priced = follow(request, windows, bs)
        if priced is None:
            return None
        go, measured = priced
        # as rank 0 rounds: outside the unfused experts
        return Compensator.of(request, measured, windows, bs, {}, go.target, spill=go.spill()).follow()

    def estimate(self, model, cal: int, evals: int, fwd: float, params: int) -> dict[str, float]:
        from compressor.pipeline.size.runtime import estimate

        return estimate(self.recipe, model, cal, evals, fwd, params)


def sizing(recipe: Recipe) -> Structural:
    """The run's plan, chosen here once: a size (``output.size``) or the structural run."""
    return Structural(recipe) if recipe.output.planned is None else Sized(recipe)


__all__ = ["Sized", "Structural", "sizing"]
