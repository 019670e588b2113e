"""What every output writer provides, and the shared, atomic publishing.

A writer turns the compressed in-memory model into one output format inside a
*staging folder* beside the output, then reloads what it wrote and compares it
with the in-memory model (its verification). Every requested writer writes
into the same staging folder; only when all of them have verified is the
folder renamed into place (:func:`publish`), so an output is either the old
one or the complete new one, never a mix.

A writer is registered with its format's size target as one
:class:`~compressor.output.registry.Format` (:mod:`compressor.output.registry`):
it declares what it can represent (:meth:`Writer.unsupported`, asked before
the model loads), writes, and verifies.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

logger = logging.getLogger(__name__)

@dataclass
class WriteRequest:
    """Everything a writer may need, built once by the pipeline's write stage."""

    model: Any
    """The compressed model, in memory (or onloaded)."""
    tokenizer: Any
    compression: dict
    """The ``compression`` section: which blocks were replaced, by what."""
    source: Any
    """The :class:`~compressor.inputs.load.ResolvedSource` the model came from."""
    dtype: Any
    """The torch dtype to save floating weights in."""
    extra_files: dict[str, str] = field(default_factory=dict)
    """Text files written beside the weights (recipe, model card)."""
    probe_tokens: Any = None
    """1-D token ids the verification compares logits and perplexity on."""
    probe_seq_len: int = 256
    probe_stride: int = 256
    probe_batch_size: int = 8
    expected_ppl: float | None = None
    """The in-memory model's perplexity on ``probe_tokens`` (the gate's final number)."""
    gate: Any = None
    """The rule a check holds the written file to: the recipe's policy
    (:class:`compressor.recipe.schema.PolicyConfig` — its budget as the recipe gives it, headroom, confidence),
    passed as it is to :func:`compressor.evaluation.gate.gate_check`. A quantized output may be no worse
    than the original at the same quantization by more than that. None: no such check."""
    offload: str = "none"
    device: str = "cpu"
    options: dict = field(default_factory=dict)
    """Writer-specific options from the recipe's ``output`` section."""


@dataclass
class Written:
    """What one writer wrote: its files in the staging folder, and the plan it wrote them from (what
    :meth:`Writer.verify` checks them against; compressed-tensors leaves its codes on it)."""

    folder: Path
    files: list[Path]
    plan: Any = None
    """The per-tensor plan in the format's own terms: a size's (made by its target,
    :meth:`~compressor.sizing.target.SizeTarget.file_plan`), or :meth:`Writer.plan` of the writer's options;
    None for a format that stores the model's tensors as they are."""


class VerificationError(RuntimeError):
    """A writer's reloaded output disagrees with the in-memory model: nothing is published (exit 1)."""


class GateMissed(VerificationError):
    """A written file runs, and is over the gate where it runs: nothing is published (the pipeline reports it as
    the gate's failure, exit 3; ``check`` is what was measured)."""

    def __init__(self, message: str, check: dict) -> None:
        super().__init__(message)
        self.check = check


class Writer:
    """One output format. Subclasses set :attr:`format` and implement :meth:`write` and :meth:`verify`."""

    format: ClassVar[str] = ""
    description: ClassVar[str] = ""
    source_suffix: ClassVar[str | None] = None
    """A source file this format re-writes in its own architecture and quantization by default (``.gguf``)."""
    verify_passes: ClassVar[int] = 1
    """Evaluations of the probe its verify runs (for the run-time estimate)."""

    def unsupported(self, model_type: str, kind: str) -> str | None:
        """Why this format cannot represent ``kind`` replacements of a ``model_type`` model
        (with the alternative), or None when it can. Asked before the model loads."""
        return None

    def check_options(self, options: dict) -> str | None:
        """Why this writer's options (from the recipe's ``output`` section) are invalid, or None."""
        return None

    def check_tokenizer(self, tokenizer, source) -> str | None:
        """Why this format cannot carry the tokenizer, or None. Asked before the model loads."""
        return None

    def check_widths(self, compression: dict, config: dict, source, options: dict) -> str | None:
        """Why the FFN widths of a finished ``compression`` section cannot be written, or None.
        Asked as soon as the widths are known, before anything is written."""
        return None

    def source_refusal(self, model_type: str) -> str | None:
        """Why a :attr:`source_suffix` source of ``model_type`` is not re-written in this format by default."""
        return None

    def width_block(self, src, output) -> int:
        """The multiple every kept FFN width must be for this format to store it (``output``: the recipe's output
        section; ``src``: the resolved source): 1 when any width is stored."""
        return 1

    def snap_grid(self, src, output) -> dict[int, str]:
        """Block → the quantized type this format stores that block's FFN down projection in, where a fit may
        snap onto it so the gate measures the file's weights (:mod:`compressor.fitting.snap`); empty: none."""
        return {}

    def plan(self, request: WriteRequest):
        """The per-tensor plan this writer's options give (a uniform quantization is a plan too); None for a
        format that stores the model's tensors as they are."""
        return None

    def write(self, request: WriteRequest, folder: Path, plan=None) -> Written:
        """Write this format's files into the staging ``folder`` from ``plan`` (a size's plan in this format's
        terms; None: :meth:`plan` of the writer's options); return what was written."""
        raise NotImplementedError

    def verify(self, request: WriteRequest, written: Written) -> dict:
        """Reload what :meth:`write` wrote, compare it with ``request.model`` and return the
        report entry; raise :class:`VerificationError` on a mismatch."""
        raise NotImplementedError


# --------------------------------------------------------------------------------------------------
# Staging and publishing
# --------------------------------------------------------------------------------------------------


def staging_path(out: Path) -> Path:
    """Where this process stages ``out``: ``.<name>.tmp-<pid>`` beside it."""
    return out.parent / f".{out.name}.tmp-{os.getpid()}"


def staging_folder(out: Path) -> Path:
    """A fresh, empty staging folder beside ``out`` (:func:`staging_path`); leftovers of
    killed runs are removed first (see :func:`compressor.inputs.safety.clean_stale_temps`)."""
    from compressor.inputs.safety import clean_stale_temps

    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(out)
    tmp = staging_path(out)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def apply_umask(folder: Path) -> None:
    """Give every file the permissions the user's umask asks for.

    ``save_pretrained`` writes weights through a private temporary file
    (mode 0600); a published checkpoint should be as readable as any other
    file the user creates.
    """
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def publish(tmp: Path, out: Path) -> Path:
    """Rename the finished staging folder into place; an earlier output (already
    judged safe to replace) is moved aside first and removed after — but what
    compressor did not write there (a user's notes or data beside the model:
    :func:`~compressor.inputs.safety.added_entries`) is moved into the new output
    first, so ``--overwrite`` replaces only compressor's own files. The moves and
    renames all happen before a Ctrl-C or SIGTERM takes effect."""
    from compressor.core.signals import signals_deferred
    from compressor.inputs.safety import OutputError, added_entries

    apply_umask(tmp)
    old, added = None, []
    with signals_deferred():  # a stop half-way would leave the user's files in a folder about to be deleted
        if out.exists():
            added = added_entries(out)
            clash = [n for n in added if (tmp / n).exists() or (tmp / n).is_symlink()]
            if clash:  # added during the run under a name the new output writes: neither is thrown away
                raise OutputError(f"{out}: {', '.join(clash)} appeared there during the run (the earlier output's "
                                  "report.json does not list them) and the new output writes the same names; nothing "
                                  f"was replaced. Move them out of {out} and run again")
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            _swap(tmp, out, old, added)
        else:
            tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)
    if added:
        logger.info("kept what compressor did not write in the earlier output: %s", ", ".join(added))
    logger.info("published %s", out)
    return out


def _swap(tmp: Path, out: Path, old: Path, added: list[str]) -> None:
    """``added`` (entries of the earlier output ``out``) moved into ``tmp``, ``out`` renamed to ``old`` and
    ``tmp`` to ``out``; on any failure everything is put back where it was, so that the staging folder the
    caller then removes holds none of the user's files."""
    moved = []
    try:
        for name in added:
            (out / name).rename(tmp / name)
            moved.append(name)
        out.rename(old)
        tmp.rename(out)
    except BaseException:
        if old.exists() and not out.exists():
            old.rename(out)
        for name in moved:
            (tmp / name).rename(out / name)
        raise
