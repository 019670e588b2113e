"""The size run's work folder: where it is, the disk it needs, and a full disk said as such.

A GGUF size writes the model once as F16 (the file a deployer would quantize) and llama.cpp's preset made from
it before anything else — 16 GB and about 4.5 GB for a 7B — then each planned file. They live in a work folder,
``.<name>.size-<pid>`` beside the output (the output's file system, which may be the only one with room), or
under ``output.workdir`` (a scratch disk), removed on every exit and reclaimed after a kill. Before the F16 is
written the run estimates what it will write where (:func:`disk_need`) and refuses, with the numbers, a disk
without room (:func:`check_disk`); a write that fails for want of space later is said as such, naming the file
(:func:`disk_full_error`), where gguf-py's numpy write says only ``65536 requested and 52128 written``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from compressor.core.errors import InputError
from compressor.recipe.schema import Recipe

logger = logging.getLogger(__name__)

#: A disk with less free than this after a failed write is taken to be the reason (llama.cpp's quantizer
#: reports a failed write as its own error, without an errno).
LOW_FREE_BYTES = 16 << 20
#: ``ndarray.tofile``'s short write (gguf-py writes tensors with it): the disk filled, no errno given.
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class DiskFullError(OSError):
    """A size run's write failed for want of disk space (exit 1): the message names the file, what is free and
    what the run needs, and where the work folder is."""


def work_folder(recipe: Recipe, out: Path) -> Path:
    """This run's work folder (not created): ``.<name>.size-<pid>`` beside the output ``out``, or under
    ``output.workdir`` as ``.<name>@<host>.size-<pid>`` — a scratch folder may be shared by machines, and a
    folder is reclaimed only by a run on the machine whose process left it."""
    if recipe.output.workdir is None:
        return out.parent / f".{out.name}.size-{os.getpid()}"
    return _custom_parent(recipe) / f".{_tagged(out)}.size-{os.getpid()}"


def make_work_folder(recipe: Recipe, out: Path, path: Path) -> None:
    """Create the work folder ``path`` (:func:`work_folder`), removing first what killed runs of this output
    left where it goes (:func:`compressor.inputs.safety.clean_stale_temps` knows the names)."""
    from compressor.inputs.safety import clean_stale_temps

    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(out if recipe.output.workdir is None else path.parent / _tagged(out))
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()


def _custom_parent(recipe: Recipe) -> Path:
    return Path(recipe.output.workdir).expanduser().resolve()


def _tagged(out: Path) -> str:
    return f"{out.name}@{socket.gethostname()}"


def check_workdir(recipe: Recipe, model_dir: Path | None) -> None:
    """``output.workdir``, before anything loads: an existing folder the user can write, not inside the output
    (publishing replaces that folder) nor inside the model's folder (inputs are never modified)."""
    if recipe.output.workdir is None or recipe.output.path is None:
        return
    where = _custom_parent(recipe)
    out = Path(recipe.output.path).expanduser().resolve()
    fix = "give an existing folder on a disk with room for the model's F16, e.g. --set output.workdir=/scratch"
    if where == out or where.is_relative_to(out):
        raise InputError(f"output.workdir: {where} is inside the output folder {out}, which publishing replaces; "
                         f"{fix} outside it")
    if model_dir is not None and (where == model_dir or where.is_relative_to(model_dir)):
        raise InputError(f"output.workdir: {where} is inside the model's folder {model_dir}, which a run never "
                         f"modifies; {fix} outside it")
    if not where.is_dir():
        what = "is a file" if where.exists() else "does not exist"
        raise InputError(f"output.workdir: {where} {what}; {fix} (create it first)")
    if not os.access(where, os.W_OK | os.X_OK):
        raise InputError(f"output.workdir: {where} is not writable by you; {fix}")


# --------------------------------------------------------------------------------------------------
# What the run writes, and the room for it
# --------------------------------------------------------------------------------------------------


@dataclass
class DiskNeed:
    """About how many bytes a GGUF size run writes: into its work folder (the F16, the preset, a passing plan
    kept there while others are tried) and beside the output (the planned file, and any other format)."""

    weights: int
    f16: int
    preset: int
    preset_name: str | None
    planned: int
    other: int = 0
    """Other formats written beside the file (a Hugging Face folder)."""
    plans: int = 1
    """Planned files at once: one for a size; for ``smallest``, one that passed kept while the next is tried."""
    moments: int = 0
    """Input moments spilled to the work folder for the plan's rounding (an onloaded model, or one whose moments
    are measured in groups of layers), or the GPTQ factors pricing made of them in their place: one float32
    ``d_in²`` per input read."""

    rounded: int = 0
    """The rounded tensors' bytes, spilled to the work folder as the plan's rounding makes them (at most the
    planned file)."""

    @property
    def work(self) -> int:
        """On the work folder's disk, where it is not the output's: a passing plan is copied there."""
        return self.f16 + self.preset + self.planned + self.moments + self.rounded

    @property
    def output(self) -> int:
        """Beside the output, where it is not the work folder's disk."""
        return self.planned + self.other

    @property
    def total(self) -> int:
        """On one disk holding both (a plan moves between them by rename)."""
        return self.f16 + self.preset + self.plans * self.planned + self.other + self.moments + self.rounded

    def describe(self) -> str:
        from compressor.engine.cache import human_bytes

        parts = [f"the F16 of the model's {self.weights:,} weights ({human_bytes(self.f16)})"]
        if self.preset:
            parts.append(f"llama.cpp's {self.preset_name} made from it (about {human_bytes(self.preset)})")
        parts.append(f"the planned file (about {human_bytes(self.planned)})")
        if self.other:
            parts.append(f"the other formats (about {human_bytes(self.other)})")
        if self.moments:
            parts.append(f"the input moments (or their GPTQ factors) kept for the rounding "
                         f"(about {human_bytes(self.moments)})")
        if self.rounded:
            parts.append(f"the rounded tensors kept for the file (about {human_bytes(self.rounded)})")
        return ", ".join(parts)


def disk_need(recipe: Recipe, request, fmt: str) -> DiskNeed | None:
    """What a size run of ``fmt`` will write, from the model's weight count (None for a format other than GGUF,
    whose budget writes no F16). Each figure is an estimate: the F16 is two bytes a weight, a preset its bits
    per weight on Llama-3-8B (:data:`~.budget.PRESET_BPW`; a small model's are higher) and at most the F16."""
    from compressor.output.gguf.budget import PRESET_BPW

    if fmt != "gguf":
        return None
    model = request.model
    weights = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    f16 = 2 * weights
    kind, value = recipe.output.planned.kind, recipe.output.planned.value
    preset_name = value if kind == "preset" else None
    if kind == "preset":
        preset = min(f16, int(weights * PRESET_BPW.get(value, 8.5) / 8))
    elif kind == "bpw":
        preset = min(f16, int(weights * value / 8))
    elif kind == "bytes":
        preset = min(f16, int(value))
    else:  # smallest: no preset; a plan of about four bits a weight
        preset = 0
    if kind in ("bpw", "bytes"):
        preset_name = "largest preset that fits"
    planned = preset or f16 // 4
    other = weights * getattr(request.dtype, "itemsize", 2) if "hf" in recipe.output.formats else 0
    return DiskNeed(weights, f16, preset, preset_name, planned, other, plans=2 if kind == "smallest" else 1,
                    moments=spilled_moments(model), rounded=planned)


def spilled_moments(model) -> int:
    """About the bytes of input moments the pricing spills to the work folder: every input's float32 ``d_in²`` when
    the model is onloaded or its moments take more than one group of layers (:func:`~.prices.moment_groups`); 0
    when they stay in memory. Linears of one parent reading one width share an input (q/k/v, gate/up), except
    the parent's last (an attention's output projection reads the attention's result)."""
    from torch import nn

    from compressor.core.onload import is_offloaded
    from compressor.engine.tensorstats import linear_names
    from compressor.pipeline.size.prices import moment_groups

    names = linear_names(model)
    if not is_offloaded(model) and len(moment_groups(model, names)) == 1:
        return 0
    linears = [(n.rpartition(".")[0], m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    last = {parent: i for i, (parent, _) in enumerate(linears)}
    inputs = {(parent, d, last[parent] == i) for i, (parent, d) in enumerate(linears)}
    return sum(4 * d * d for _, d, _ in inputs)


def check_disk(need: DiskNeed | None, workdir: Path, out: Path) -> None:
    """Say up front what the run will write where, and refuse (exit 2) a disk without room for it, with the
    numbers and the fix, before the F16 is written."""
    if need is None:
        return
    if os.stat(workdir).st_dev == os.stat(out.parent).st_dev:
        places = [(workdir.parent, need.total, need.describe())]
    else:  # a passing plan is kept in the work folder while others are tried, and published beside the output
        places = [(workdir.parent, need.work, need.describe()),
                  (out.parent, need.output, f"the planned file{' and the other formats' if need.other else ''}")]
    for folder, n, what in places:
        free = shutil.disk_usage(folder).free
        if n > free:
            raise InputError(
                f"output.size: not enough disk space: this run writes about {_bytes(n)} on the disk holding {folder} "
                f"({what}), and {_bytes(free)} is free there. {_room_fix(workdir, out)}")
        logger.info("output.size: this run writes about %s on the disk holding %s (%s); %s is free there",
                    _bytes(n), folder, what, _bytes(free))


def _bytes(n: int | None) -> str:
    from compressor.engine.cache import human_bytes

    return "an unknown amount" if n is None else f"{human_bytes(n)} ({n:,} bytes)"


def _room_fix(workdir: Path, out: Path) -> str:
    if workdir.parent == out.parent:
        return (f"The work folder {workdir.name} sits beside the output {out}: free space on that disk, or put the "
                "work folder (the F16 and the preset) on a disk with room with output.workdir (e.g. --set "
                "output.workdir=/scratch)")
    return (f"The work folder is {workdir} (output.workdir) and the planned file is written beside the output {out}: "
            "free space there, or choose another output.workdir or output folder")


# --------------------------------------------------------------------------------------------------
# A full disk, said as such
# --------------------------------------------------------------------------------------------------


def disk_full_error(exc: BaseException, workdir: Path, out: Path, need: DiskNeed | None,
                    since: float) -> DiskFullError | None:
    """``exc`` as a :class:`DiskFullError` when it is one (an ``ENOSPC``-like errno, numpy's short write, or any
    failure that left a disk it wrote to all but full), naming the file being written (the newest in the work
    and staging folders since ``since``), the space free and needed, and the fix; None otherwise."""
    from compressor.output.base import staging_path

    staging = staging_path(out)
    folders = [f for f in (workdir, staging) if f.is_dir()] + [out.parent]
    free = {f: _free(f) for f in folders}
    full = isinstance(exc, OSError) and (exc.errno in _FULL_ERRNOS or bool(_SHORT_WRITE.search(str(exc))))
    # a plain RuntimeError is llama.cpp's quantizer failing (no errno); its subclasses are the gate's verdicts
    may_be = type(exc) in (OSError, RuntimeError)  # not a refusal (FileExistsError) nor a missing file
    if not full and not (may_be and any(v is not None and v < LOW_FREE_BYTES for v in free.values())):
        return None
    file = _newest_file([workdir, staging], since)
    what = (f"writing {file}" if file is not None else
            f"writing the planned file into the staging folder {staging} (removed)")
    room = _free(file.parent) if file is not None else free[out.parent]
    needs = (f"; this run writes about {_bytes(need.total)}: {need.describe()}"
             if need is not None else "")
    error = DiskFullError(f"the disk is full: {what} failed ({type(exc).__name__}: {exc}); {_bytes(room)} is "
                          f"free there{needs}. {_room_fix(workdir, out)}")
    error.errno = errno.ENOSPC
    return error


def _free(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _newest_file(folders: list[Path], since: float) -> Path | None:
    """The file modified last under ``folders`` at or after ``since`` (the one being written when a write
    failed), or None."""
    newest, when = None, since - 1.0
    for folder in folders:
        for root, _dirs, files in os.walk(folder):
            for name in files:
                path = Path(root) / name
                try:
                    mtime = path.stat().st_mtime
                except OSError:
                    continue
                if mtime >= when:
                    newest, when = path, mtime
    return newest


__all__ = ["DiskFullError", "DiskNeed", "check_disk", "check_workdir", "disk_full_error", "disk_need",
           "make_work_folder", "work_folder"]
