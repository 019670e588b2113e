"""Calibration and evaluation text → fixed-length token windows.

Sources (through 🤗 ``datasets`` wherever a loader exists):

* ``embedded`` — the default: the English reference text that ships inside
  every CPython install (``pydoc_data.topics``, ~465k characters of the
  Python language reference). Any fresh install has it, so the tool runs
  offline with no data argument. Its topics are split in two disjoint halves:
  even ones for calibration, odd ones for evaluation.
* a local ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file,
* a folder written by ``Dataset.save_to_disk`` (``load_from_disk``),
* a hub dataset name (with ``config`` / ``split`` / ``text_column``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

EMBEDDED = "embedded"
_FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class TextSource:
    """Where text comes from. ``dataset`` is ``embedded``, a file, a folder or a hub name."""

    dataset: str = EMBEDDED
    config: str | None = None
    split: str = "train"
    text_column: str = "text"

    def kind(self) -> str:
        if self.dataset == EMBEDDED:
            return "embedded"
        p = Path(self.dataset).expanduser()
        if p.is_file():
            return "file"
        if p.is_dir():
            return "disk"
        if p.suffix.lower() in _FILE_BUILDERS or self.dataset.startswith((".", "/", "~")):
            raise FileNotFoundError(
                f"data file {self.dataset!r} does not exist; give an existing .txt/.jsonl/.parquet file, "
                "a `save_to_disk` folder, a hub dataset name, or 'embedded'"
            )
        return "hub"


def _embedded_documents(role: str) -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # stripped Python builds: fall back to stdlib docstrings
        import inspect
        import json, logging as _l, pathlib, argparse, collections, subprocess, textwrap  # noqa: E401

        topics = {m.__name__: inspect.getdoc(m) or "" for m in (json, _l, pathlib, argparse, collections, subprocess, textwrap)}
    keys = sorted(topics)
    parity = 0 if role == "calibration" else 1
    return [topics[k] for i, k in enumerate(keys) if i % 2 == parity]


def load_documents(source: TextSource, role: str = "calibration") -> list[str]:
    """Return the source's documents as a list of strings."""
    kind = source.kind()
    if kind == "embedded":
        return _embedded_documents(role)
    import datasets

    if kind == "file":
        path = Path(source.dataset).expanduser()
        builder = _FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"unsupported data file type {path.suffix!r} for {path}; use one of {sorted(_FILE_BUILDERS)}"
            )
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    elif kind == "disk":
        ds = datasets.load_from_disk(str(Path(source.dataset).expanduser()))
        if isinstance(ds, datasets.DatasetDict):
            if source.split not in ds:
                raise ValueError(f"split {source.split!r} not in {source.dataset}; it has {list(ds)}")
            ds = ds[source.split]
    else:
        ds = datasets.load_dataset(source.dataset, source.config, split=source.split)
    if source.text_column not in ds.column_names:
        raise ValueError(
            f"text column {source.text_column!r} not found in {source.dataset}; columns are {ds.column_names}. "
            "Set text_column."
        )
    docs = ds[source.text_column]
    if kind == "file" and builder == "text":
        # The text builder yields one row per line; regroup lines into documents
        # of 32 lines so the text reads as written and parity splits stay disjoint.
        return ["\n".join(docs[i : i + 32]) for i in range(0, len(docs), 32)]
    return [d for d in docs if d]


def tokenize_stream(tokenizer, documents: list[str], max_tokens: int) -> torch.Tensor:
    """Concatenate documents (blank-line separated) into one id stream of ≤ ``max_tokens``."""
    ids: list[int] = []
    chars_per_call = 200_000
    for doc in documents:
        for start in range(0, len(doc), chars_per_call):
            piece = doc[start : start + chars_per_call]
            ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
            if len(ids) >= max_tokens:
                return torch.tensor(ids[:max_tokens], dtype=torch.long)
        ids.extend(tokenizer("\n\n", add_special_tokens=False)["input_ids"])
    return torch.tensor(ids[:max_tokens], dtype=torch.long)


@dataclass
class CalibrationSet:
    """Token windows [N, seq_len] split into fit and held-out by whole windows."""

    fit: torch.Tensor
    heldout: torch.Tensor

    @property
    def seq_len(self) -> int:
        return int(self.fit.shape[1])

    def fingerprint(self) -> str:
        import hashlib

        h = hashlib.sha256()
        for t in (self.fit, self.heldout):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.numpy().tobytes())
        return h.hexdigest()


def split_windows(stream: torch.Tensor, seq_len: int, heldout_fraction: float, seed: int) -> CalibrationSet:
    """Cut ``stream`` into whole windows and hold out a seeded random subset of them."""
    n = stream.numel() // seq_len
    if n < 2:
        raise ValueError(
            f"only {stream.numel()} calibration tokens: need at least 2 windows of seq_len={seq_len}. "
            "Give more text or raise max_tokens."
        )
    windows = stream[: n * seq_len].view(n, seq_len)
    n_held = min(n - 1, max(1, math.ceil(heldout_fraction * n)))
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    held = torch.sort(perm[:n_held]).values
    fit = torch.sort(perm[n_held:]).values
    return CalibrationSet(fit=windows[fit].contiguous(), heldout=windows[held].contiguous())


def calibration_set(
    tokenizer, source: TextSource, *, seq_len: int = 128, max_tokens: int = 16384,
    heldout_fraction: float = 0.2, seed: int = 0,
) -> CalibrationSet:
    docs = load_documents(source, "calibration")
    stream = tokenize_stream(tokenizer, docs, max_tokens)
    cal = split_windows(stream, seq_len, heldout_fraction, seed)
    logger.info(
        "calibration: %d fit + %d held-out windows of %d tokens from %s",
        cal.fit.shape[0], cal.heldout.shape[0], seq_len, source.dataset,
    )
    return cal


def evaluation_tokens(tokenizer, source: TextSource, calibration: TextSource | None, *, max_tokens: int) -> torch.Tensor:
    """Evaluation id stream, disjoint from calibration text.

    With the embedded default the halves are disjoint by construction. When the
    evaluation source *is* the calibration source, documents are split by parity
    (even → calibration, odd → evaluation) and a warning says so.
    """
    docs = load_documents(source, "evaluation")
    if calibration is not None and source == calibration and source.kind() != "embedded":
        logger.warning(
            "evaluation data is the calibration data (%s): evaluating on odd-numbered documents only; "
            "give a separate evaluation source for a clean split", source.dataset,
        )
        docs = docs[1::2] if len(docs) > 1 else docs
    stream = tokenize_stream(tokenizer, docs, max_tokens)
    if stream.numel() < 2:
        raise ValueError(f"evaluation text from {source.dataset!r} produced {stream.numel()} tokens; need more")
    return stream
