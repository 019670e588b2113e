"""What every replacement kind provides, and the registry that names them.

A kind turns one block's streamed statistics into a closed-form replacement
module. It offers a ladder of *levels* (kept hidden units, rank, or just one
level for the affine map), each with its parameter count and held-out
relative error, so that a policy can allocate one global budget across blocks
(:mod:`compressor.policy.allocate`); and it fits the replacement at a chosen level.

Adding a kind is one module under ``compressor/kinds/`` with a class
registered by :func:`register`, its recipe config (a pydantic model
discriminated by ``kind``), and its module class in
:mod:`compressor.core.modeling` (so checkpoints reload without compressor).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from compressor.core.archs import ArchSpec
from compressor.core.stats import Moments


@dataclass
class BlockData:
    """Everything a kind may fit from, for one block.

    ``fit``/``heldout`` are statistics of ``x → y`` (FFN input → output).
    ``zfit``/``zheld`` are statistics of ``z = [x, h] → y`` where ``h`` is
    what the down projection receives; present only when a kind needs them.
    ``y`` may be a teacher target instead of the block's own output.
    """

    index: int
    ffn: nn.Module
    """The original FFN module (its weights are read, never modified)."""
    spec: ArchSpec
    act: str | None
    fit: Moments
    heldout: Moments
    zfit: Moments | None = None
    zheld: Moments | None = None
    output_weight: torch.Tensor | None = None
    """Diagonal loss-gradient second moment at the block output (loss-aware selection)."""
    cache: dict = field(default_factory=dict)
    """Per-block results a kind reuses (e.g. the OBS path)."""

    def affine(self):
        """The block's full affine least-squares fit (solved once, shared by the kinds that need it)."""
        from compressor.fitting.solve import solve_affine

        if "affine" not in self.cache:
            self.cache["affine"] = solve_affine(self.fit)
        return self.cache["affine"]

    @property
    def d(self) -> int:
        return self.fit.d_in

    @property
    def d_out(self) -> int:
        return self.fit.d_out

    @property
    def d_ff(self) -> int:
        if self.zfit is None:
            raise ValueError("hidden-unit statistics were not collected for this block")
        return self.zfit.d_in - self.fit.d_in


@dataclass(frozen=True)
class Level:
    """One rung of a kind's ladder for one block."""

    size: int
    """Kept hidden units (prune, hybrid), rank (low_rank), or 0 (affine)."""
    params: int
    heldout_rel_error: float
    """Held-out SSE / SST of the replacement's output (1 − R²)."""


@dataclass
class Fitted:
    """A fitted replacement: its tensors, how to build it, what it costs."""

    kind: str
    index: int
    config: dict
    """Shape arguments for :func:`compressor.core.modeling.build_replacement`."""
    tensors: dict[str, torch.Tensor]
    """Parameter name (relative to the module) → float64 value."""
    params: int
    heldout_r2: float
    warnings: list[str] = field(default_factory=list)
    stored: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)
    """Tensor name → ``(GGML type name, ggml's bytes [rows, row bytes])`` for a tensor snapped onto the
    output file's grid (:mod:`compressor.fitting.snap`), uint8: the writer stores these bytes as they are."""

    def entry(self, module_path: str) -> dict:
        """The checkpoint's ``compression.blocks`` entry (versioned per kind)."""
        r2 = self.heldout_r2 if math.isfinite(self.heldout_r2) else None  # config.json stays strict JSON
        return {"index": self.index, "module": module_path, "kind": self.kind,
                "format": KINDS[self.kind].format, "config": dict(self.config), "params": self.params,
                "heldout_r2": r2}

    def build(self, like: nn.Module) -> nn.Module:
        """The replacement module with the fitted weights, on ``like``'s device and dtype."""
        from compressor.core.modeling import build_replacement
        from compressor.core.onload import execution_device, offload_module

        ref = next(like.parameters())
        mod = build_replacement({"kind": self.kind, "config": self.config})
        # An offloaded original is a meta placeholder: the replacement goes where the layer computes.
        mod = mod.to(device=execution_device(like), dtype=ref.dtype)
        state = mod.state_dict()
        missing = set(state) ^ set(self.tensors)
        if missing:
            raise RuntimeError(f"{self.kind} replacement tensors do not match its module: {sorted(missing)}")
        with torch.no_grad():
            for name, value in self.tensors.items():
                state[name].copy_(value.to(state[name].dtype))
        if ref.device.type == "meta":  # the layer is onloaded: so is its replacement
            offload_module(mod, execution_device(like))
        return mod

    def spill(self, folder: Path) -> None:
        """Keep the tensors in a safetensors file under ``folder`` instead of RAM (read back by
        :meth:`build`): an onloaded run holds every block's fit, and they would add up with depth."""
        from safetensors.torch import save_file

        if isinstance(self.tensors, SpilledTensors):
            return
        path = Path(folder) / f"fit-{self.index}-{uuid.uuid4().hex}.safetensors"
        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(path))
        self.tensors = SpilledTensors(path, list(self.tensors))


class SpilledTensors(Mapping):
    """Read-only name → tensor mapping backed by a safetensors file (each access reads one tensor)."""

    def __init__(self, path: Path, names: list[str]) -> None:
        self.path, self.names = path, names

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.names:
            raise KeyError(name)
        with safe_open(str(self.path), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class Kind:
    """Base class of a replacement kind (see the module docstring)."""

    name: ClassVar[str]
    format: ClassVar[str]
    needs_hidden: ClassVar[bool] = False
    snaps: ClassVar[bool] = False
    """Whether :meth:`fit` takes ``grid`` (the output file's GGML type for the re-solved map)."""

    def levels(self, data: BlockData, cfg) -> list[Level]:
        """The ladder, from most to least parameters."""
        raise NotImplementedError

    def default_level(self, data: BlockData, cfg) -> int:
        """The level size the config asks for when nothing is allocated."""
        raise NotImplementedError

    def fit(self, data: BlockData, cfg, size: int) -> Fitted:
        raise NotImplementedError


KINDS: dict[str, Kind] = {}


def register(cls: type[Kind]) -> type[Kind]:
    KINDS[cls.name] = cls()
    return cls


def get_kind(name: str) -> Kind:
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown replacement kind {name!r}; known kinds: {sorted(KINDS)}") from None
