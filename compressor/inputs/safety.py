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

import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
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
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|size)-(?P<pid>\d+)$")
_KINDS = {"tmp": "staging folder", "old": "earlier output moved aside", "size": "size run's work folder"}


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


@dataclass(frozen=True)
class Leftover:
    """A folder a run leaves beside its output (or under ``output.workdir``) while it runs: its work folder
    (``.<name>.size-<pid>``, ``.<name>@<host>.size-<pid>`` under ``output.workdir``), its staging folder
    (``.<name>.tmp-<pid>``) or the earlier output it moved aside (``.<name>.old-<pid>``), named for its process."""

    path: Path
    output: str
    """The name of the output folder it belongs to."""
    kind: str
    pid: int
    host: str | None
    """The machine of a work folder under ``output.workdir`` (a scratch folder machines may share)."""
    state: str
    """``stale``: its process no longer exists on this machine; ``running``: it does (a live run's folder, never
    touched); ``elsewhere``: left on another machine, whose processes cannot be seen from here; ``kept``: an
    earlier output moved aside whose output is missing (a kill between the two renames of publishing), to rename
    back, not to remove."""

    def describe(self) -> str:
        whose = f"{_KINDS[self.kind]} of {self.output}"
        why = {"stale": f"process {self.pid} no longer exists",
               "running": f"process {self.pid} is running: not touched",
               "elsewhere": f"left by process {self.pid} on {self.host}: run `compressor clean` there",
               "kept": f"{self.output} itself is missing: rename this folder back to {self.output} rather than "
                       "remove it"}[self.state]
        return f"{whose} ({why})"


def leftovers(folder: Path) -> list[Leftover]:
    """The work, staging and moved-aside folders runs left in ``folder``, by name, each with whether its process
    still runs (:class:`Leftover`)."""
    import socket

    found = []
    here = socket.gethostname()
    for p in sorted(folder.iterdir()):
        m = _LEFTOVER.match(p.name)
        if not m or not p.is_dir() or p.is_symlink():
            continue
        name, pid, host = m["name"], int(m["pid"]), None
        if m["kind"] == "size" and "@" in name:
            name, host = name.rsplit("@", 1)
        if host is not None and host != here:
            state = "elsewhere"
        elif pid == os.getpid() or pid_alive(pid):
            state = "running"
        elif m["kind"] == "old" and not (folder / name).exists():
            state = "kept"
        else:
            state = "stale"
        found.append(Leftover(p, name, m["kind"], pid, host, state))
    return found


def folder_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (links not followed)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except OSError:
                pass
    return total


# --------------------------------------------------------------------------------------------------
# A full disk, said as such
# --------------------------------------------------------------------------------------------------

#: A disk with less free than this (and than a twentieth of its size) after a failed write is taken to be the
#: reason: llama.cpp's quantizer reports a failed write as its own error, without an errno.
LOW_FREE_BYTES = 16 << 20
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
#: How writers that give no errno say it: numpy's ``tofile`` (gguf-py writes tensors with it) a short write,
#: safetensors' Rust ``SafetensorError`` its io error.
_FULL_TEXT = re.compile(r"\d+ requested and \d+ written|No space left on device|Disk quota exceeded|StorageFull"
                        r"|QuotaExceeded|File too large|FileTooLarge")


class DiskFullError(OSError):
    """A write failed for want of disk space (exit 1): the message names the file whose write failed, the disk
    it is on, what is free there and the fix. ``path``: that file (or the folder written into); ``cause``: the
    writer's own error; ``said``: the message without what the run needs and the fix (:meth:`told`)."""

    def __init__(self, said: str, path: Path | None = None, cause: BaseException | None = None,
                 needs: str = "", fix: str = "") -> None:
        super().__init__(f"{said}{needs}. {fix}" if fix else f"{said}{needs}")
        self.errno = errno.ENOSPC
        self.said, self.path, self.cause = said, path, cause

    def told(self, needs: str, fix: str) -> "DiskFullError":
        """The same failure with what the run needs and the fix of a caller that knows more."""
        told = DiskFullError(self.said, self.path, self.cause, needs, fix)
        told.__cause__ = self.__cause__
        return told


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what caused it (``raise … from``, or raised while handling it), nearest first."""
    seen: list[BaseException] = []
    while exc is not None and all(exc is not e for e in seen):
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def says_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a write that failed for want of space: a full-disk errno, or the
    words a writer without one uses."""
    return any((isinstance(e, OSError) and e.errno in _FULL_ERRNOS) or bool(_FULL_TEXT.search(str(e)))
               for e in _chain(exc))


def failed_file(exc: BaseException) -> Path | None:
    """The file an ``OSError`` in ``exc``'s chain names (``filename``), if any."""
    for e in _chain(exc):
        name = getattr(e, "filename", None) if isinstance(e, OSError) else None
        if isinstance(name, (str, os.PathLike)) and str(name):
            return Path(name)
    return None


def newest_file(folders: Iterable[Path], since: float) -> Path | None:
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


def _existing(path: Path) -> Path:
    path = _resolve(path)
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def free_bytes(path: Path) -> int | None:
    """The bytes free on the disk holding ``path`` (or its nearest existing parent); None when unknown."""
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return None


def disk_of(path: Path) -> str:
    """The disk holding ``path``, as a user finds it in ``df``: ``the disk mounted at /mnt (10.0 MB)``."""
    from compressor.engine.cache import human_bytes

    where = _existing(path)
    if where.is_file():
        where = where.parent
    mount = where
    while not os.path.ismount(mount) and mount.parent != mount:
        mount = mount.parent
    try:
        size = f" ({human_bytes(shutil.disk_usage(mount).total)})"
    except OSError:
        size = ""
    return f"the disk mounted at {mount}{size}"


def nearly_full(path: Path) -> bool:
    """Whether the disk holding ``path`` has all but no room left (:data:`LOW_FREE_BYTES`)."""
    try:
        usage = shutil.disk_usage(_existing(path))
    except OSError:
        return False
    return usage.free < min(LOW_FREE_BYTES, usage.total // 20 or 1)


def as_disk_full(exc: BaseException, folders: list[Path], since: float, fix: str,
                 needs: str = "") -> DiskFullError | None:
    """``exc`` as a :class:`DiskFullError` when a write into ``folders`` failed for want of space (a full-disk
    errno or its words, or a writer's bare error that left the disk all but full), else None. The message names
    the file whose write failed (the error's own ``filename``, else the newest file written into ``folders``
    since ``since``: call it before they are removed), its disk, what is free there, ``needs`` (what the run
    writes) and ``fix``. A :class:`DiskFullError` already is one: ``needs`` and ``fix`` replace its own."""
    if isinstance(exc, DiskFullError):
        return exc.told(needs, fix)
    file = failed_file(exc) or newest_file([f for f in folders if f.is_dir()], since)
    where = file if file is not None else folders[0]
    bare = type(exc) in (OSError, RuntimeError, Exception) or type(exc).__name__ == "SafetensorError"
    if not says_disk_full(exc) and not (bare and nearly_full(where)):
        return None
    free = free_bytes(where)
    what = f"writing {file}" if file is not None else f"writing into {folders[0]}"
    shown = "an unknown amount" if free is None else f"{_human(free)} ({free:,} bytes)"
    return DiskFullError(f"the disk is full: {what} failed ({type(exc).__name__}: {exc}); {disk_of(where)} holds "
                         f"it, and {shown} is free there", file or folders[0], exc, needs, fix)


def _human(n: int) -> str:
    from compressor.engine.cache import human_bytes

    return human_bytes(n)


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
