"""Model files checked before anything loads, and the weights a load actually filled.

* :func:`check_model_files` — a local source is a readable checkpoint: a valid
  ``config.json`` naming an architecture transformers knows, weight files
  whose headers parse and whose tensors lie inside the file, the tokenizer
  files; a GGUF file parses to its last tensor. Cheap: headers only.
* :func:`check_loading_info` — after ``from_pretrained``: no weight the
  architecture needs was missing from the files (transformers would initialise
  it at random and carry on), none was left over, none had the wrong shape.

Every problem is an :class:`~compressor.core.errors.InputError` (exit 2) that
names the file and the tensors.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from compressor.core.errors import InputError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
MAX_LISTED = 6


def _listed(names) -> str:
    names = sorted(names)
    more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
    return ", ".join(names[:MAX_LISTED]) + more


# Sources already found sound in this process, keyed by their files' size and mtime: a run checks
# before loading (validation) and the loader checks again for direct callers; parsing a 1 GB GGUF's
# tensor table twice would cost seconds for nothing.
_SOUND: set[tuple] = set()


def _identity(src) -> tuple:
    folder = Path(src.path)
    files = [folder / src.gguf_file] if src.gguf_file else sorted(p for p in folder.iterdir() if p.is_file())
    return (str(folder), src.gguf_file, tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))


def check_model_files(src) -> None:
    """Check a resolved local source (:class:`~compressor.inputs.load.ResolvedSource`); hub ids are left to the hub."""
    if not src.is_local:
        return
    key = _identity(src)
    if key in _SOUND:
        return
    _check_model_files(src)
    _SOUND.add(key)


def _check_model_files(src) -> None:
    folder = Path(src.path)
    if src.gguf_file:
        check_gguf(folder / src.gguf_file)
        return
    _check_config(folder / "config.json")
    _check_weights(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(
            f"model folder {folder} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); compressor needs "
            "the tokenizer to read text. Save it beside the weights: tokenizer.save_pretrained(folder)"
        )


def _check_config(path: Path) -> None:
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{path} is not a readable JSON config ({type(e).__name__}: {str(e)[:200]}); "
                         "re-save the model with save_pretrained") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{path} must hold a JSON object (the model's config); got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise InputError(f"{path} has no model_type; a save_pretrained config names its architecture there")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    base = model_type.removeprefix("compressed_")
    if base not in CONFIG_MAPPING_NAMES:
        raise InputError(
            f"{path}: model_type {model_type[:80]!r} is not an architecture this transformers version knows; "
            "check the config, or upgrade transformers"
        )


def _check_weights(folder: Path) -> None:
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InputError(f"{index} is not a valid shard index ({type(e).__name__}); re-save the model") from None
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise InputError(f"{index} names weight files that are not in {folder}: {_listed(missing)}; "
                             "the download is incomplete: fetch the missing shards")
    if not files:
        raise InputError(f"model folder {folder} has no weight files ({', '.join(WEIGHT_SUFFIXES)}); "
                         "is the download complete?")
    for f in files:
        if f.suffix == ".safetensors":
            check_safetensors(f)


def check_safetensors(path: Path) -> None:
    """The header parses and every tensor's bytes lie inside the file (no tensor data is read)."""
    size = path.stat().st_size
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            lo, hi = info["data_offsets"]
            if not 0 <= lo <= hi:
                raise ValueError(f"tensor {name[:80]!r} has offsets {lo}..{hi}")
            end = max(end, hi)
        if 8 + n + end > size:
            raise ValueError(f"its tensors need {8 + n + end} bytes but the file has {size}: it is truncated")
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise InputError(f"weight file {path} is corrupt ({str(e)[:200]}); re-download or re-save the model") from None


def check_gguf(path: Path) -> None:
    """The GGUF header, metadata and tensor table parse and every tensor lies inside the file."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise InputError(f"{path} is a GGUF file: reading it needs the gguf package (pip install gguf)") from None
    try:
        reader = GGUFReader(str(path))
        for t in reader.tensors:
            _ = t.data.shape  # views into the memory map: fails when the file stops early
    except Exception as e:  # noqa: BLE001 - any failure to parse is a corrupt file
        raise InputError(f"GGUF file {path} is truncated or corrupt ({type(e).__name__}: {str(e)[:200]}); "
                         "re-download it") from None


def check_loading_info(info: dict, source: str) -> None:
    """Refuse a load that left weights missing (randomly initialised), unexpected or of the wrong shape."""
    missing = [k for k in info.get("missing_keys") or () if not k.endswith(("rotary_emb.inv_freq",))]
    unexpected = list(info.get("unexpected_keys") or ())
    mismatched = [str(m[0]) if isinstance(m, (tuple, list)) else str(m) for m in info.get("mismatched_keys") or ()]
    problems = []
    if missing:
        problems.append(f"{len(missing)} weight(s) the architecture needs are missing from the files "
                        f"(they would be random): {_listed(missing)}")
    if mismatched:
        problems.append(f"{len(mismatched)} weight(s) have the wrong shape for the config: {_listed(mismatched)}")
    if unexpected:
        problems.append(f"{len(unexpected)} weight(s) in the files belong to no module of the architecture: "
                        f"{_listed(unexpected)}")
    if problems:
        raise InputError(
            f"model {source}: " + "; ".join(problems) + ". The checkpoint is incomplete or does not match its "
            "config.json: re-download or re-export it; nothing was written"
        )
