"""Per-block fit inputs kept between the measuring pass and allocate's re-solves.

The ``allocate`` strategy measures every block once, then re-solves blocks at
other kept sizes while it searches the global target. Re-solving needs each
block's statistics (for a hidden-unit kind, ``(d + d_ff)²`` float64 per block:
472 MB for a d = 2048 model); keeping all of them in RAM makes memory grow
with depth. :class:`BlockStore` keeps them in RAM while they fit in a share of
the available memory and otherwise spills each block's statistics to a
safetensors file in a temporary folder, read back one block at a time. The
small per-block results (the OBS path, the cached affine solve) stay in RAM.

Statistics a resumable run already recorded (its run state holds each layer's
record, :mod:`compressor.engine.runstate`) are not written a second time: the
store reads them back from the record (:meth:`BlockStore.keep_recorded`) — for
Qwen2.5-Coder-1.5B 30 GB of disk instead of 60. The temporary folder lies in
the run-state folder when there is one, so a killed run leaves nothing behind
in the system's temporary folder (the state folder is cleared when the run ends
or a later run of that output starts).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from compressor.fitting.kinds.base import BlockData
from compressor.core.stats import Moments

logger = logging.getLogger(__name__)

_FIELDS = ("fit", "heldout", "zfit", "zheld")
#: Name prefix of a store's temporary folder (in the run-state folder, or the system's temporary folder).
SPILL_PREFIX = "compressor-stats-"


def available_bytes() -> int:
    """Free memory; under a process group the least of all ranks, so every rank takes the same path."""
    from compressor.core.distributed import min_over_ranks

    try:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        free = 0
    return min_over_ranks(free)


def stats_bytes(data: BlockData) -> int:
    total = 0
    for name in _FIELDS:
        m = getattr(data, name)
        if m is not None:
            total += sum(t.numel() * t.element_size() for t in m.state_dict("m").values())
    return total


class BlockStore:
    """``store[i] = data`` keeps a block's :class:`BlockData`; ``store[i]`` gives it back whole.

    ``spill``: ``True`` always writes the statistics to disk, ``False`` never,
    ``None`` decides at the first block: in RAM while all blocks' statistics
    would take less than ``memory_share`` of the available memory.
    """

    def __init__(self, n_blocks: int, *, spill: bool | None = None, memory_share: float = 0.3,
                 folder: Path | None = None) -> None:
        self.n_blocks = n_blocks
        self.spill = spill
        self.memory_share = memory_share
        self._data: dict[int, BlockData] = {}
        self._files: dict[int, Path] = {}
        self._loaders: dict[int, Callable[[], BlockData]] = {}
        self._parent = folder
        self._folder: Path | None = None

    def _ensure_folder(self) -> Path:
        if self._folder is None:
            if self._parent is not None:
                self._parent.mkdir(parents=True, exist_ok=True)
            self._folder = Path(tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=self._parent))
        return self._folder

    def _decide(self, data: BlockData) -> bool:
        if self.spill is None:
            need = stats_bytes(data) * self.n_blocks
            self.spill = need > self.memory_share * available_bytes()
            if self.spill:
                logger.info("allocate: all blocks' statistics need %.1f GB; spilling them to disk", need / 1e9)
        return self.spill

    def keep_recorded(self, i: int, data: BlockData, load: Callable[[], BlockData]) -> None:
        """``store[i] = data`` for statistics already on disk elsewhere (a run-state record):
        ``load()`` gives them back. When this store spills it keeps only ``load``, not a copy."""
        if not self._decide(data):
            self._data[i] = data
            return
        self._loaders[i] = load
        self._files.pop(i, None)
        self._data[i] = dataclasses.replace(data, **{name: None for name in _FIELDS})

    def keep_fit(self, fitted):
        """A :class:`~compressor.fitting.kinds.Fitted` that stays around: its tensors go to disk when this
        store spills (an onloaded run keeps every block's fit; in RAM they would add up with depth)."""
        if self.spill:
            fitted.spill(self._ensure_folder())
        return fitted

    def __contains__(self, i: int) -> bool:
        return i in self._data

    def __setitem__(self, i: int, data: BlockData) -> None:
        if not self._decide(data):
            self._data[i] = data
            return
        from safetensors.torch import save_file

        self._ensure_folder()
        tensors = {}
        for name in _FIELDS:
            m = getattr(data, name)
            if m is not None:
                tensors.update({k: t.contiguous() for k, t in m.to("cpu").state_dict(name).items()})
        path = self._folder / f"block{i}.safetensors"
        save_file(tensors, str(path))
        self._files[i] = path
        self._loaders.pop(i, None)
        self._data[i] = dataclasses.replace(data, **{name: None for name in _FIELDS})

    def __getitem__(self, i: int) -> BlockData:
        data = self._data[i]
        if i in self._loaders:
            stored = self._loaders[i]()
            return dataclasses.replace(data, **{name: getattr(stored, name) for name in _FIELDS})
        if i not in self._files:
            return data
        from safetensors.torch import load_file

        sd = load_file(str(self._files[i]))
        present = {name for name in _FIELDS if f"{name}.n" in sd}
        return dataclasses.replace(data, **{name: Moments.from_state_dict(sd, name) for name in present})

    def close(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        self._data.clear()
        self._files.clear()
        self._loaders.clear()

    def __del__(self) -> None:
        self.close()
