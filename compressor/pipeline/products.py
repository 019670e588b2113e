"""What the run's stages hand each other: the checks' results (:class:`Checked`), the loaded model
(:class:`Loaded`) and the calibration (:class:`Calibrated`). A leaf of :mod:`compressor.pipeline`: both
workflows and every stage read these, and nothing here imports a stage."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from compressor.core.archs import ArchSpec
from compressor.engine.runstate import RunState
from compressor.inputs.data import CalibrationSet
from compressor.inputs.load import ResolvedSource
from compressor.inputs.safety import OutputLock
from compressor.pipeline.workflow import Workflow


@dataclass
class Checked:
    """What :func:`check` established before anything heavy ran."""

    out: Path | None
    """The output folder; None when nothing is to be written (:func:`compressor.oneshot` without ``output_dir``)."""
    eval_streams: dict[str, torch.Tensor]
    state: RunState
    reads: list[tuple[str, Path]]
    workflow: Workflow
    """The run's workflow, chosen once (:func:`~compressor.pipeline.workflow.workflow_for`)."""
    lock: OutputLock | None = None
    """Held until the run ends: one run per output (rank 0 holds it under a process group)."""
    width_multiple: int = 1
    """The multiple the kept FFN widths come in (:func:`compressor.recipe.schema.width_multiple`)."""
    grid: dict[int, str] = field(default_factory=dict)
    """Block → the GGML type the GGUF output stores its down projection in (:func:`output_grid`)."""
    seconds: float = 0.0
    """Wall time of the checks."""
    keep_state: bool = False
    """Keep the run state when the run ends (``--keep-state``)."""

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


@dataclass
class Loaded:
    model: nn.Module
    tokenizer: object
    source: ResolvedSource
    model_type: str
    spec: ArchSpec


@dataclass
class Calibrated:
    cal: CalibrationSet
    info: dict
    overlap: dict = field(default_factory=dict)
