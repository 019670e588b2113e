"""Cache of profile statistics, so changing only the policy skips calibration.

Keyed by a fingerprint of the model's weights, of the calibration token
windows, and of the measurement settings; stored as safetensors (no pickle)
under ``$COMPRESSOR_CACHE_DIR`` (default ``~/.cache/compressor``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from .measure import BlockStats

logger = logging.getLogger(__name__)

CACHE_FORMAT = "compressor.stats-cache/v1"


def cache_dir() -> Path:
    return Path(os.environ.get("COMPRESSOR_CACHE_DIR") or Path.home() / ".cache" / "compressor").expanduser()


@torch.no_grad()
def model_fingerprint(model: nn.Module) -> str:
    """sha256 over every tensor of the state dict (name, dtype, shape, bytes)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def stats_key(model_fp: str, data_fp: str, settings: dict) -> str:
    blob = json.dumps({"format": CACHE_FORMAT, "model": model_fp, "data": data_fp, "settings": settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def load_stats(key: str) -> dict[int, BlockStats] | None:
    path = cache_dir() / f"{key}.safetensors"
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    try:
        sd = load_file(str(path))
        indices = sorted({int(k.split(".")[0].removeprefix("block")) for k in sd})
        stats = {i: BlockStats.from_state_dict(sd, i) for i in indices}
    except Exception as e:  # a corrupt cache entry is recomputed, never fatal
        logger.warning("ignoring unreadable cache entry %s: %s", path, e)
        return None
    logger.info("profile statistics loaded from cache %s", path)
    return stats


def save_stats(key: str, stats: dict[int, BlockStats]) -> Path:
    from safetensors.torch import save_file

    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    sd: dict[str, torch.Tensor] = {}
    for st in stats.values():
        sd.update({k: v.contiguous() for k, v in st.state_dict().items()})
    path = folder / f"{key}.safetensors"
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    save_file(sd, str(tmp), metadata={"format": CACHE_FORMAT})
    os.replace(tmp, path)
    return path
