"""The key of a run: what a saved run state depends on, so a resume can tell it belongs to this run.

The model's source files (path, name, size and mtime of each weight/config
file, sha256 of ``config.json``: cheap, and safe when the model is offloaded),
the evaluation token fingerprint, the recipe's sha256 and that of its
measurement settings, the FFN width multiple and the tool version
(:func:`run_key`); the calibration fingerprint is added once the data is known
(:meth:`compressor.engine.runstate.RunState.bind_calibration`). How a saved
key differs from this run's, in words: :func:`describe_change`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

# Files of a model folder whose size and mtime identify the model (weights, configs, tokenizer).
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".txt", ".py")
KEY_LABELS = {
    "model": "model", "calibration": "calibration data", "evaluation": "evaluation data", "recipe": "recipe",
    "measurement": "measurement settings", "widths": "FFN width multiple", "tool_version": "tool version",
}


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_identity(src, revision: str | None = None) -> dict:
    """What identifies the model's source files, without reading the weights.

    ``src`` is a :class:`compressor.inputs.load.ResolvedSource`. A hub id resolves to
    its snapshot in the local Hugging Face cache when it is there; otherwise
    the id and revision are all there is."""
    folder: Path | None = None
    if src.is_local:
        folder = Path(src.path).resolve()
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(src.path, src.gguf_file or "config.json", revision=revision)
            if isinstance(found, str):
                folder = Path(found).parent
        except Exception:  # noqa: BLE001 - no hub client or no cache: the id is the identity
            folder = None
    ident: dict[str, Any] = {"source": src.describe(), "revision": revision}
    if folder is None:
        return ident
    if src.gguf_file:
        files = [folder / src.gguf_file]
    else:
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in MODEL_FILE_SUFFIXES)
    ident["path"] = str(folder)
    ident["files"] = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    config = folder / "config.json"
    ident["config_sha256"] = sha256_file(config) if config.is_file() else None
    return ident


def tokens_fingerprint(streams: dict[str, torch.Tensor]) -> str:
    """sha256 over the evaluation token streams, per domain name."""
    h = hashlib.sha256()
    for name, ids in streams.items():
        t = ids.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def run_key(recipe, src, eval_streams: dict[str, torch.Tensor], width_multiple: int = 1) -> dict:
    """The key of a run before its calibration data is known (see :meth:`RunState.bind_calibration`).
    ``width_multiple``: the multiple the kept FFN widths come in, resolved from the output section
    (which the recipe hashes leave out) — it decides the widths pass A measures."""
    from compressor.core.version import __version__

    return {"model": model_identity(src, recipe.model.revision), "evaluation": tokens_fingerprint(eval_streams),
            "recipe": recipe.sha256(), "measurement": recipe.measurement_sha256(), "widths": int(width_multiple),
            "tool_version": __version__}


def describe_change(k: str, old, new) -> str:
    """Field ``k`` of a run key, saved as ``old`` and now ``new``, in words (for a refusal to resume)."""
    if k == "model" and isinstance(old, dict) and isinstance(new, dict):
        changed = sorted(f for f in set(old) | set(new) if old.get(f) != new.get(f))
        return f"model: its {', '.join(changed)} changed"
    if k == "widths":
        return (f"FFN width multiple: saved {old}, now {new} — output.formats and output.width_multiple decide "
                "it (a GGUF at the source's quantization keeps widths in multiples of its block); give this run "
                "the earlier run's output settings")
    short = (lambda v: v[:12] if isinstance(v, str) and len(v) == 64 else v)
    return f"{KEY_LABELS.get(k, k)}: saved {short(old)}, now {short(new)}"
