"""On-disk cache of measured statistics, so changing only the policy skips calibration.

Storage is generic: :func:`put` / :func:`get` store named tensors plus string
metadata under a key, as one safetensors file (no pickle), written atomically
(temporary file + ``os.replace``). Reading an entry touches it; when the cache
grows past its cap the least recently used entries are evicted.

Location, first that is set: ``$COMPRESSOR_CACHE``, ``$COMPRESSOR_CACHE_DIR``
(older name), ``$XDG_CACHE_HOME/compressor``, ``~/.cache/compressor``.
Cap: ``$COMPRESSOR_CACHE_MAX_GB`` (default 4; 0 disables writing).
``compressor cache info`` / ``compressor cache clear`` show and empty it.

:func:`load_stats` / :func:`save_stats` keep the profile statistics on top of
that layer (keyed by :func:`stats_key` over a fingerprint of the model weights,
of the calibration windows and of the measurement settings).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily: `compressor cache info` needs no torch
    import torch
    from torch import nn

    from compressor.engine.measure import BlockStats

logger = logging.getLogger(__name__)

CACHE_FORMAT = "compressor.stats-cache/v1"
DEFAULT_MAX_GB = 4.0
SUFFIX = ".safetensors"
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def cache_dir() -> Path:
    for var in ("COMPRESSOR_CACHE", "COMPRESSOR_CACHE_DIR"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "compressor"
    return Path.home() / ".cache" / "compressor"


def max_bytes() -> int:
    """The cap from ``$COMPRESSOR_CACHE_MAX_GB`` (GB = 10⁹ bytes), default 4."""
    raw = os.environ.get("COMPRESSOR_CACHE_MAX_GB")
    if raw is None or raw.strip() == "":
        return int(DEFAULT_MAX_GB * 1e9)
    try:
        gb = float(raw)
        if gb < 0 or gb != gb:
            raise ValueError
    except ValueError:
        logger.warning("COMPRESSOR_CACHE_MAX_GB=%r is not a number ≥ 0; using the default %g", raw, DEFAULT_MAX_GB)
        gb = DEFAULT_MAX_GB
    return int(gb * 1e9)


def _path(key: str) -> Path:
    if not _KEY.match(key):
        raise ValueError(f"cache key {key!r}: use letters, digits, '_', '.', '-' (at most 128 characters)")
    return cache_dir() / f"{key}{SUFFIX}"


def _entries() -> list[Path]:
    folder = cache_dir()
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if p.suffix == SUFFIX and p.is_file() and not p.name.startswith(".")]


def put(key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path | None:
    """Store ``tensors`` (+ string ``metadata``) under ``key``; returns the file,
    or None when the entry alone is larger than the cap (nothing is stored)."""
    from safetensors.torch import save_file

    path = _path(key)
    cap = max_bytes()
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size > cap:
        logger.warning(
            "statistics (%.2f GB) exceed the cache cap COMPRESSOR_CACHE_MAX_GB=%.2f; not cached", size / 1e9, cap / 1e9
        )
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=dict(metadata or {}))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    evict(cap, keep=path)
    return path


def get(key: str) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """``(tensors, metadata)`` stored under ``key``, or None. Touches the entry (LRU)."""
    from safetensors import safe_open

    path = _path(key)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - a corrupt entry is dropped and recomputed, never fatal
        logger.warning("ignoring unreadable cache entry %s: %s", path, e)
        return None
    try:
        os.utime(path)
    except OSError:
        pass
    return tensors, metadata


def info() -> dict:
    """Where the cache is, how many entries, their total size and the cap."""
    entries = _entries()
    return {
        "location": str(cache_dir()),
        "entries": len(entries),
        "total_bytes": sum(p.stat().st_size for p in entries),
        "max_bytes": max_bytes(),
    }


def clear() -> int:
    """Delete every cache entry (only the cache's own files); returns how many."""
    n = 0
    folder = cache_dir()
    for p in _entries():
        p.unlink(missing_ok=True)
        n += 1
    if folder.is_dir():  # temporary files of killed writers
        for p in folder.glob(f".*{SUFFIX}.tmp-*"):
            p.unlink(missing_ok=True)
    return n


def evict(limit: int, *, keep: Path | None = None) -> list[Path]:
    """Delete least recently used entries until the total is ≤ ``limit`` bytes."""
    entries = sorted(((p.stat().st_mtime, p) for p in _entries()), key=lambda e: e[0])
    total = sum(p.stat().st_size for _, p in entries)
    removed = []
    for _, p in entries:
        if total <= limit:
            break
        if keep is not None and p == keep:
            continue
        size = p.stat().st_size
        p.unlink(missing_ok=True)
        total -= size
        removed.append(p)
        logger.info("cache: evicted least recently used entry %s (%.1f MB)", p.name, size / 1e6)
    return removed


# --------------------------------------------------------------------------------------------------
# Profile statistics on top of the generic layer
# --------------------------------------------------------------------------------------------------


def model_fingerprint(model: nn.Module) -> str:
    """sha256 over every tensor of the state dict (name, dtype, shape, bytes)."""
    import torch

    from compressor.core.onload import tensor

    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            if t.device.type == "meta":  # onloaded: read from the offload store, one tensor at a time
                t = tensor(model, name)
            t = t.detach().cpu().contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def stats_key(model_fp: str, data_fp: str, settings: dict) -> str:
    blob = json.dumps(
        {"format": CACHE_FORMAT, "model": model_fp, "data": data_fp, "settings": settings}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _read(key: str, fmt: str, decode, what: str):
    """``decode(tensors, metadata)`` of the entry under ``key`` if it has format ``fmt``, else None;
    a corrupt entry is recomputed by the caller, never fatal."""
    found = get(key)
    if found is None or found[1].get("format") != fmt:
        return None
    try:
        value = decode(*found)
    except Exception as e:  # noqa: BLE001
        logger.warning("ignoring unreadable cache entry %s: %s", key, e)
        return None
    logger.info("%s loaded from cache %s", what, _path(key))
    return value


def load_stats(key: str) -> dict[int, BlockStats] | None:
    from compressor.engine.measure import BlockStats

    def decode(sd, meta):
        indices = sorted({int(k.split(".")[0].removeprefix("block")) for k in sd})
        return {i: BlockStats.from_state_dict(sd, i) for i in indices}

    return _read(key, CACHE_FORMAT, decode, "profile statistics")


def save_stats(key: str, stats: dict[int, BlockStats]) -> Path | None:
    sd = {}
    for st in stats.values():
        sd.update(st.state_dict())
    return put(key, sd, {"format": CACHE_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S")})


PROFILE_FORMAT = "compressor.profile-cache/v1"


def load_profiles(key: str):
    """Cached per-block profiles (:class:`compressor.engine.profiling.BlockProfile`) under ``key``, or None."""
    from compressor.engine.profiling import BlockProfile

    return _read(key, PROFILE_FORMAT, lambda sd, meta: [BlockProfile(**b) for b in json.loads(meta["profiles"])],
                 "profile")


def save_profiles(key: str, profiles) -> Path | None:
    """Store per-block profiles (small: the statistics themselves are not kept)."""
    from dataclasses import asdict

    blob = json.dumps([asdict(p) for p in profiles])  # NaN/Infinity round-trip through Python's json
    return put(key, {"n_blocks": _count_tensor(len(profiles))},
               {"format": PROFILE_FORMAT, "profiles": blob, "created": time.strftime("%Y-%m-%dT%H:%M:%S")})


def _count_tensor(n: int):
    import torch

    return torch.tensor([n], dtype=torch.int64)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
