"""Output safety: what ``--overwrite`` may replace, where outputs may go, and
leftovers of interrupted runs.

The rule: a run never deletes anything it reads (recipe, data, model, cache),
the current directory, the home folder or a parent of any of them, and with
``overwrite`` it only replaces an empty folder or an earlier compressor output
(recognised by its ``config.json`` ``compression`` section or its
``report.json``) — and of that output only the files compressor wrote: what a
user added there is kept (:func:`added_entries`). Everything is checked before
a model is loaded.

No torch / transformers import here: the checks run before anything heavy.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from fnmatch import fnmatchcase
from pathlib import Path

logger = logging.getLogger(__name__)

REPORT_SCHEMA_PREFIX = "compressor.report/"


class OutputError(FileExistsError):
    """The output location is unsafe or unusable (an input error: exit code 2)."""


def _resolve(p: str | Path) -> Path:
    return Path(p).expanduser().resolve()


def is_compressor_output(folder: Path) -> bool:
    """True if ``folder`` looks like a checkpoint this tool wrote earlier."""
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        comp = cfg.get("compression") if isinstance(cfg, dict) else None
        if isinstance(comp, dict) and comp.get("tool") == "compressor":
            return True
    except (OSError, ValueError):
        pass
    try:
        report = json.loads((folder / "report.json").read_text(encoding="utf-8"))
        return isinstance(report, dict) and str(report.get("schema", "")).startswith(REPORT_SCHEMA_PREFIX)
    except (OSError, ValueError):
        return False


#: What compressor writes at the top of an output folder (``fnmatch`` patterns: every writer's files, the
#: tokenizer's, the report, recipe and card). An earlier output's ``report.json`` lists its own files
#: (``files``); these tell compressor's files from a user's in one written before that list was kept, and
#: name the files a user added that a new output could replace.
WRITTEN_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "*.gguf",
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "chat_template.*",
    "*.model", "modeling_*.py", "recipe.yaml", "README.md", "report.json",
)


def _written_list(folder: Path) -> set[str] | None:
    """The files an earlier output's ``report.json`` says compressor wrote; None when it lists none."""
    try:
        files = json.loads((folder / "report.json").read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(files) if isinstance(files, list) and all(isinstance(f, str) for f in files) else None


def looks_written(name: str) -> bool:
    """Whether ``name`` is a file name compressor writes into an output (:data:`WRITTEN_PATTERNS`)."""
    return any(fnmatchcase(name, p) for p in WRITTEN_PATTERNS)


def added_entries(folder: Path) -> list[str]:
    """The entries of an earlier compressor output that compressor did not write — notes, data, anything a
    user put beside the model — sorted: not in its ``report.json`` ``files`` list, or, for an output written
    before that list was kept, not named like a file compressor writes. ``--overwrite`` keeps them."""
    written = _written_list(folder)
    return sorted(p.name for p in folder.iterdir()
                  if (p.name not in written if written is not None else not looks_written(p.name)))


def _describe(folder: Path, names: list[str]) -> str:
    shown = [n + ("/" if (folder / n).is_dir() else "") for n in names[:8]]
    return ", ".join(shown) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _protected(reads: Iterable[tuple[str, Path]]) -> list[tuple[str, Path]]:
    """(what, path) pairs the output must never be, contain or replace."""
    found = [(what, _resolve(p)) for what, p in reads]
    found.append(("the current directory", Path.cwd().resolve()))
    found.append(("your home folder", Path.home().resolve()))
    return found


def check_output_folder(
    out: str | Path,
    *,
    overwrite: bool,
    reads: Iterable[tuple[str, str | Path]] = (),
    model_dir: str | Path | None = None,
) -> Path:
    """Check that ``out`` may be written (and, with ``overwrite``, replaced); return it resolved.

    ``reads`` are ``(description, path)`` pairs of everything the run reads
    (recipe, data files, cache folder); ``model_dir`` is the local model folder,
    which the output may not be, contain, or lie inside.
    Raises :class:`OutputError` saying what is wrong and what to do.

    >>> check_output_folder("/tmp/new-output", overwrite=False)   # doctest: +SKIP
    PosixPath('/tmp/new-output')
    """
    out = _resolve(out)
    if model_dir is not None:
        src = _resolve(model_dir)
        if out == src or out.is_relative_to(src) or src.is_relative_to(out):
            raise OutputError(
                f"output {out} is, contains or lies inside the input model folder {src}; "
                "the input is never modified — choose another folder"
            )
    for what, path in _protected(reads):
        if out == path or path.is_relative_to(out):
            rel = "is" if out == path else "contains"
            raise OutputError(
                f"output {out} {rel} {what} ({path}); writing there would delete it. "
                "Choose a new folder for the output, e.g. --output out/compressed"
            )
    if out.exists() and not out.is_dir():
        raise OutputError(f"output {out} exists and is a file, not a folder; choose a folder path for the output")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite and is_compressor_output(out):
            raise OutputError(
                f"{out} is not empty (an earlier compressor output); choose another folder or set "
                "output.overwrite: true (--overwrite) to replace it"
            )
        if not overwrite:  # --overwrite would be refused too: do not suggest it
            raise OutputError(
                f"{out} is not empty and is not an earlier compressor output, so --overwrite would not replace it "
                "either (it may hold files you need); choose a new or empty folder"
            )
        if not is_compressor_output(out):
            raise OutputError(
                f"{out} is not empty and is not an earlier compressor output (no config.json `compression` section "
                "and no compressor report.json), so --overwrite will not delete it: it may hold files you need. "
                "Choose a new or empty folder, or remove that folder yourself if you really want it replaced"
            )
        clash = [n for n in added_entries(out) if looks_written(n)]
        if clash:  # kept files must not collide with the new output's: refused rather than replaced
            raise OutputError(
                f"{out} holds {_describe(out, clash)}, which the earlier compressor output there did not write (its "
                "report.json does not list them) and a new output may write under the same name, so --overwrite "
                f"would replace them. Move them out of {out}, or choose another output folder; other files you "
                "added there are kept by --overwrite"
            )
    _check_dir_writable(out, "output folder")
    return out


def _check_dir_writable(path: Path, what: str) -> None:
    """The nearest existing ancestor of ``path`` must be a writable folder."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise OutputError(f"{what} {path}: {probe} is a file, not a folder; choose another location")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path}: {probe} is not writable by you; choose a location you can write to")


def check_report_path(path: str | Path, *, reads: Iterable[tuple[str, str | Path]] = ()) -> Path:
    """Check that a report file can be written at ``path`` (before any work is done)."""
    p = _resolve(path)
    for what, read in reads:
        if p == _resolve(read):
            raise OutputError(f"--report {path}: that is {what}; writing the report there would overwrite it")
    if p.is_dir():
        raise OutputError(f"--report {path} is a folder; give a file name, e.g. {p / 'report.json'}")
    if not p.parent.is_dir():
        raise OutputError(
            f"--report {path}: folder {p.parent} does not exist; create it first or give a path in an existing folder"
        )
    if not os.access(p.parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise OutputError(f"--report {path}: not writable by you; choose a location you can write to")
    return p


# --------------------------------------------------------------------------------------------------
# Leftovers of interrupted saves
# --------------------------------------------------------------------------------------------------

#: ``tmp``: a staging folder; ``old``: an earlier output moved aside; ``size``: the size stage's work folder (the
#: F16 and the preset files, many GB on a large model).
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old|size)-(?P<pid>\d+)$")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OverflowError:
        return False
    return True


def clean_stale_temps(out: Path) -> list[Path]:
    """Remove ``.<name>.tmp-<pid>`` / ``.<name>.old-<pid>`` / ``.<name>.size-<pid>`` folders beside ``out``
    left by runs that were killed (their process no longer exists)."""
    removed: list[Path] = []
    parent = out.parent
    if not parent.is_dir():
        return removed
    for p in parent.iterdir():
        m = _LEFTOVER.match(p.name)
        if not m or m["name"] != out.name or not p.is_dir() or p.is_symlink():
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or pid_alive(pid):
            continue
        shutil.rmtree(p, ignore_errors=True)
        logger.warning("removed %s, left by an interrupted run (process %d no longer exists)", p, pid)
        removed.append(p)
    return removed


# --------------------------------------------------------------------------------------------------
# One run per output
# --------------------------------------------------------------------------------------------------


def lock_path(out: str | Path) -> Path:
    """``.<name>.compressor-lock`` beside the output."""
    out = _resolve(out)
    return out.parent / f".{out.name}.compressor-lock"


class OutputLock:
    """Held by the run writing ``out``, from its input checks to its exit.

    A second run on the same output is refused (its resume state and staging
    folder are the first run's). The lock file holds the owner's pid; the lock
    of a process that no longer exists is reclaimed, and that is logged.

    >>> with OutputLock(Path("out/model")):            # doctest: +SKIP
    ...     ...
    """

    def __init__(self, out: str | Path) -> None:
        self.out = _resolve(out)
        self.path = lock_path(self.out)
        self.held = False

    def acquire(self) -> "OutputLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner is not None and owner != os.getpid() and pid_alive(owner):
                    raise OutputError(
                        f"another compressor run (process {owner}) is writing {self.out}; wait for it to finish or "
                        f"stop it, or choose another output. If no such run exists, delete {self.path}"
                    ) from None
                logger.warning("reclaiming %s: its run (process %s) no longer exists", self.path, owner)
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "output": str(self.out)}, f)
            self.held = True
            return self
        raise OutputError(f"could not take the lock {self.path}; remove it if no run is writing {self.out}")

    def _owner(self) -> int | None:
        try:
            return int(json.loads(self.path.read_text(encoding="utf-8"))["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # unreadable: a crash while it was written

    def release(self) -> None:
        if self.held and self._owner() == os.getpid():
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        self.held = False

    def __enter__(self) -> "OutputLock":
        return self.acquire() if not self.held else self

    def __exit__(self, *exc) -> None:
        self.release()
