"""How much host memory a run may use: what the system has free, within the container's or job's limit.

``MemAvailable`` alone overstates it under a cgroup limit (docker ``--memory``, Slurm ``--mem``, Kubernetes):
the kernel's OOM killer acts on the cgroup's limit, not the machine's. So the memory available is the least of
``MemAvailable``, the cgroup's limit minus its usage (v2 ``memory.max``/``memory.current``, v1
``memory.limit_in_bytes``/``memory.usage_in_bytes``) and ``COMPRESSOR_MEMORY_LIMIT`` (bytes, or with a unit:
``8GB``, ``8GiB``), a limit the user sets for compressor alone (a shared machine; tests).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: The environment variable that caps the memory compressor plans for (bytes, or ``8GB`` / ``8GiB``).
LIMIT_ENV = "COMPRESSOR_MEMORY_LIMIT"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """``"8GB"`` → 8,000,000,000; ``"8GiB"`` → 8 × 2³⁰; a plain number is bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"{text!r} is not a number of bytes (e.g. 8000000000, 8GB or 8GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def _cgroup_room() -> int | None:
    """The cgroup's limit less its usage (None: no limit, or not Linux)."""
    v2 = Path("/sys/fs/cgroup")
    limit, used = _read_int(v2 / "memory.max"), _read_int(v2 / "memory.current")
    if limit is None:
        v1 = v2 / "memory"
        limit, used = _read_int(v1 / "memory.limit_in_bytes"), _read_int(v1 / "memory.usage_in_bytes")
        if limit is not None and limit >= 1 << 60:  # v1 says "no limit" with a huge number
            limit = None
    return None if limit is None else max(0, limit - (used or 0))


def available_bytes() -> int | None:
    """Host memory a run may still take (None: unknown). See the module docstring for what bounds it."""
    candidates = [_meminfo_available(), _cgroup_room()]
    if os.environ.get(LIMIT_ENV, "").strip():
        candidates.append(parse_bytes(os.environ[LIMIT_ENV]))
    known = [c for c in candidates if c is not None]
    return min(known) if known else None
