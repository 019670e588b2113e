"""The two workflows a run can be, chosen once per recipe by :func:`compressor.pipeline.preflight.workflow_for`.

The runner runs ``load → calibrate → compress → report → ship → publish``; what ``compress`` and ``ship`` do,
and the checks that differ, belong to the workflow:

* :class:`~compressor.pipeline.structural.StructuralWorkflow` — replace FFN blocks (the policy's search and
  gate), then write every format as it is;
* :class:`~compressor.pipeline.size.SizeWorkflow` — change no block and plan the file a user ships to
  ``output.size`` (plan → write → verify → gate, as many times as it tries a plan).

Each implements :class:`Workflow` in full; neither derives from the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from compressor.recipe.schema import Recipe

if TYPE_CHECKING:  # the stage products (Loaded, Calibrated, Checked) are :mod:`.products`', which reads this
    from compressor.inputs.load import ResolvedSource
    from compressor.output.base import WriteRequest
    from compressor.policy.compress import CompressionResult


class Workflow(Protocol):
    """What the pipeline asks of a run's workflow (the checks before the model loads, then its two stages)."""

    recipe: Recipe
    changes_blocks: bool
    """Whether the run replaces blocks: its search is confirmed on held-out windows, its fits may snap onto the
    output's grid, and the model in memory becomes the compressed class after it."""

    def default_formats(self, model_type: str, src: ResolvedSource) -> list[str]:
        """``output.formats`` when the recipe names none."""

    def check_config(self, config, *, writes: bool, given: bool) -> None:
        """What the model's config allows, before it loads (``given``: a model object was handed in)."""

    def check_evaluation(self, streams: dict[str, torch.Tensor], *, writes: bool) -> None:
        """What the evaluation text and the output allow, before the model loads."""

    def check_writers(self, tokenizer, model_type: str, src: ResolvedSource, config) -> None:
        """Each requested format can write this run's model: asked before the model loads."""

    def compress(self, loaded: Loaded, calibrated: Calibrated, checked: Checked) -> CompressionResult:
        """The model after this workflow's changes, with the gate's measurements."""

    def ship(self, request: WriteRequest, windows: torch.Tensor, checked: Checked, report: dict,
             result: CompressionResult, *, use_cache: bool) -> Path:
        """The verified staging folder (rank 0)."""

    def follow(self, request: WriteRequest, windows: torch.Tensor) -> tuple:
        """A rank other than 0 under torchrun, while rank 0 ships: its share of the work, then rank 0's last word
        ``(failure or None, report)``."""

    def estimate(self, model, fwd: float, *, hidden: bool, recorded: dict) -> dict[str, float]:
        """Expected seconds of this workflow's own stages (``fwd``: a forward's seconds per token)."""


__all__ = ["Workflow"]
