"""Writing results: atomic JSON (a reader never sees half a file), timestamps, the command line."""

from __future__ import annotations

import json
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path


def write_json(path: str | Path, obj, *, default=None) -> Path:
    """Write ``obj`` as indented JSON (trailing newline) to ``path`` atomically: a temporary file in
    the same folder, then a rename. Creates the folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2, default=default) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def utc_now(timespec: str = "seconds") -> str:
    """The current UTC time, ISO 8601 (``timespec="auto"`` keeps the microseconds)."""
    return datetime.now(timezone.utc).isoformat(timespec=timespec)


def command_line() -> str:
    """How this benchmark was started: ``python`` and its arguments, shell-quoted."""
    return shlex.join(["python", *sys.argv])
