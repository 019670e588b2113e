"""The size run's work folder: where it is, the disk it needs, and a full disk said as such.

A GGUF size writes the model once as F16 (the file a deployer would quantize) and llama.cpp's preset made from
it before anything else — 16 GB and about 4.5 GB for a 7B — then each planned file. They live in a work folder,
``.<name>.size-<pid>`` beside the output (the output's file system, which may be the only one with room), or
under ``output.workdir`` (a scratch disk), removed on every exit and reclaimed after a kill. Before the F16 is
written the run estimates what it will write where (:func:`disk_need`) and refuses, with the numbers, a disk
without room (:func:`check_disk`), and checks again with the budget itself once it is measured
(:func:`budget_need`); a write that fails for want of space later is said as such, naming the file whose write
failed and its disk (:func:`disk_full_error`), where gguf-py's numpy write says only ``65536 requested and 52128
written`` and safetensors a bare ``SafetensorError``.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from compressor.core.errors import InputError
from compressor.inputs.safety import DiskFullError, as_disk_full, disk_of
from compressor.recipe.schema import Recipe
from compressor.sizing.target import SizeTarget

logger = logging.getLogger(__name__)


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
    """About how many bytes a size run writes: into its work folder (a GGUF's F16, the anchor it is measured
    against — llama.cpp's preset, or the uniform compressed-tensors checkpoint — and a passing plan kept there
    while others are tried) and beside the output (the planned file, and any other format). Before the budget is
    known the planned file is an estimate (:func:`disk_need`); after it, the budget itself (:func:`budget_need`),
    and what is already written is no longer counted."""

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
    budget: bool = False
    """``planned`` is the budget (the file's bytes), not an estimate."""
    anchor: str | None = None
    """What ``preset`` is, where it is not llama.cpp's preset made from the F16."""

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

    def planned_file(self) -> str:
        return (f"the planned file ({'its budget, ' if self.budget else 'about '}{human_bytes(self.planned)}"
                f"{' each, two at once' if self.plans > 1 else ''})")

    def describe(self) -> str:
        parts = [f"the F16 of the model's {self.weights:,} weights ({human_bytes(self.f16)})"] if self.f16 else []
        if self.preset:
            what = self.anchor or f"llama.cpp's {self.preset_name} made from it"
            parts.append(f"{what} (about {human_bytes(self.preset)})")
        parts.append(self.planned_file())
        if self.other:
            parts.append(f"the other formats (about {human_bytes(self.other)})")
        if self.moments:
            parts.append(f"the input moments (or their GPTQ factors) kept for the rounding "
                         f"(about {human_bytes(self.moments)})")
        if self.rounded:
            parts.append(f"the rounded tensors kept for the file (about {human_bytes(self.rounded)})")
        return ", ".join(parts)


def human_bytes(n: int) -> str:
    from compressor.engine.cache import human_bytes as human

    return human(n)


def disk_need(recipe: Recipe, request, target: SizeTarget) -> DiskNeed | None:
    """What a size run will write, before its budget is measured, where its ``target`` writes the model's F16 and
    the anchor into the work folder (:attr:`~compressor.sizing.target.SizeTarget.writes_f16`: GGUF), from the
    model's weights (None for another format, whose budget is counted, not written: :func:`budget_need` checks
    it). Each figure
    is an estimate: the F16 two bytes a weight; a preset per tensor, as llama.cpp quantizes it —
    its bits per weight on Llama-3-8B (:data:`~.budget.PRESET_BPW`) where rows are whole k-quant blocks of 256,
    8.5 (``Q8_0``) where they are only 32-blocks, F16 else (a small model's rows are often too short), 1-D
    tensors F32; a size in bytes or bits per weight the size itself; at most the F16."""
    from compressor.output.gguf.budget import PRESET_BPW

    if not target.writes_f16:
        return None
    model = request.model
    params = list({id(p): p for p in model.parameters()}.values())
    weights = sum(p.numel() for p in params)
    f16 = 2 * weights
    kind, value = recipe.output.planned.kind, recipe.output.planned.value
    preset_name = value if kind == "preset" else None
    if kind == "preset":
        preset = min(f16, _preset_bytes(params, PRESET_BPW.get(value, 8.5)))
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


def _preset_bytes(params, bpw: float) -> int:
    """About a preset's tensor bytes (:func:`disk_need`)."""
    bits = 0.0
    for p in params:
        row = p.shape[-1] if p.dim() > 1 else 0
        bits += p.numel() * (32 if p.dim() < 2 else bpw if row % 256 == 0 else 8.5 if row % 32 == 0 else 16)
    return int(bits / 8)


def budget_need(need: DiskNeed | None, recipe: Recipe, request, budget, fmt: str) -> DiskNeed:
    """What is left to write once the size's budget is measured: the planned file at the budget's bytes
    (``smallest``: the estimate, its budget being the whole F16), and for compressed-tensors the uniform
    checkpoint it is measured against (written in the work folder); a GGUF's F16 and preset are written by now."""
    from compressor.core.params import count_params

    smallest = recipe.output.planned.kind == "smallest"
    if need is None:  # compressed-tensors: no F16, the budget is the checkpoint's bytes counted
        weights = count_params(request.model)
        other = weights * getattr(request.dtype, "itemsize", 2) if "hf" in recipe.output.formats else 0
        planned = budget.layout.file_bytes // 4 if smallest else budget.limit
        anchor = budget.preset
        return DiskNeed(weights, 0, int(anchor["file_bytes"]) if anchor else 0, None, planned, other,
                        plans=2 if smallest else 1, moments=spilled_moments(request.model), rounded=planned,
                        budget=not smallest, anchor=f"the uniform {anchor['name']} checkpoint" if anchor else None)
    planned = need.planned if smallest else budget.limit
    return DiskNeed(need.weights, 0, 0, need.preset_name, planned, need.other, plans=need.plans,
                    moments=need.moments, rounded=planned, budget=not smallest)


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
    numbers and the fix: before the F16 is written (an estimate), and again once the budget is known (the
    budget itself), before anything is priced."""
    if need is None:
        return
    if _device(workdir) == _device(out.parent):
        places = [(workdir.parent, need.total, need.describe())]
    else:  # a passing plan is kept in the work folder while others are tried, and published beside the output
        places = [(workdir.parent, need.work, need.describe()),
                  (out.parent, need.output,
                   need.planned_file() + (" and the other formats" if need.other else ""))]
    more = not need.budget and need.f16 > 0
    for folder, n, what in places:
        free = shutil.disk_usage(folder).free
        if n > free:
            raise InputError(
                f"output.size: not enough disk space: this run writes about {_bytes(n)} on {disk_of(folder)}, "
                f"which holds {folder} ({what}), and {_bytes(free)} is free there. {_room_fix(workdir, out)}")
        logger.info("output.size: this run writes about %s on the disk holding %s (%s); %s is free there%s",
                    _bytes(n), folder, what, _bytes(free),
                    " (checked again once the budget is measured)" if more else "")


def _device(path: Path | None) -> int | None:
    """The device of ``path``'s nearest existing folder (which disk it is on)."""
    while path is not None and not path.exists() and path.parent != path:
        path = path.parent
    try:
        return os.stat(path).st_dev if path is not None else None
    except OSError:
        return None


def _bytes(n: int | None) -> str:
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
    """``exc`` as a :class:`DiskFullError` when it is one (:func:`~compressor.inputs.safety.as_disk_full`: a
    full-disk errno or its words, or a bare failure that left a disk it wrote to all but full), naming the file
    whose write failed — one the staging folder's writers named already (:mod:`compressor.pipeline.writing`,
    before that folder was removed), else the error's own file or the newest in the work folder since
    ``since`` — its disk, the space free and what the run needs, and the fix; None otherwise."""
    from compressor.output.base import staging_path

    needs = ""
    if need is not None:
        apart = _device(workdir) != _device(out.parent)
        if apart and isinstance(exc, DiskFullError) and _device(exc.path) == _device(out.parent):
            needs = f"; this run writes about {_bytes(need.output)} there: {need.planned_file()}"
        else:
            n = need.work if apart else need.total
            needs = f"; this run writes about {_bytes(n)}{' there' if apart else ''}: {need.describe()}"
    fix = _room_fix(workdir, out)
    # a DiskFullError was said where its file was written: what the run needs and the fix are added; a plain
    # RuntimeError is llama.cpp's quantizer failing (no errno); its subclasses are the gate's verdicts
    return as_disk_full(exc, [workdir, staging_path(out)], since, fix, needs)


__all__ = ["DiskFullError", "DiskNeed", "budget_need", "check_disk", "check_workdir", "disk_full_error", "disk_need",
           "make_work_folder", "work_folder"]
