"""Calibration and evaluation text → fixed-length token windows.

Sources (through 🤗 ``datasets`` wherever a loader exists):

* ``embedded`` — prose: the English reference text that ships inside
  every CPython install (``pydoc_data.topics``, ~465k characters of the
  Python language reference). Any fresh install has it, so the tool runs
  offline with no data argument. Its topics are split in two disjoint halves:
  even ones for calibration, odd ones for evaluation.
* ``embedded-code`` — source code: the pure-Python standard-library modules
  named in :data:`EMBEDDED_CODE_FILES` (``_pydecimal.py``, ``_pyio.py``…, ~450k
  characters, in every CPython install), cut into pieces of
  :data:`CODE_PIECE_LINES` lines taken from the files in turn; even pieces for
  calibration, odd ones for evaluation. Every one of those files starts with an
  underscore, so a check on the *public* standard library (no path part
  starting with ``_``, as ``tools/checks/independent_check.py --text stdlib`` reads it)
  never sees the gate's code.
* a local ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file,
* a folder written by ``Dataset.save_to_disk`` (``load_from_disk``),
* a hub dataset name (with ``config`` / ``split`` / ``text_column``).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_CODE = "embedded-code"
#: The sources that ship with Python itself (no file, no network).
EMBEDDED_SOURCES = (EMBEDDED, EMBEDDED_CODE)
#: The gate's code domain: private pure-Python twins and helpers of the standard library, in this order.
#: A file missing from a stripped Python build is skipped (the rest are more than 8,192 tokens of code).
EMBEDDED_CODE_FILES = ("_pydecimal.py", "_pyio.py", "_collections_abc.py", "_strptime.py", "_markupbase.py",
                       "_compat_pickle.py", "_threading_local.py", "_py_abc.py", "_weakrefset.py")
#: Lines per piece of ``embedded-code``: long enough to hold a function or two, short enough to interleave files.
CODE_PIECE_LINES = 40
_FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class TextSource:
    """Where text comes from. ``dataset`` is ``embedded``, a file, a folder or a hub name."""

    dataset: str = EMBEDDED
    config: str | None = None
    split: str = "train"
    text_column: str = "text"

    def kind(self) -> str:
        if self.dataset in EMBEDDED_SOURCES:
            return "embedded"
        p = Path(self.dataset).expanduser()
        if p.is_file():
            return "file"
        if p.is_dir():
            return "disk"
        if p.suffix.lower() in _FILE_BUILDERS or self.dataset.startswith((".", "/", "~")):
            raise FileNotFoundError(
                f"data file {self.dataset!r} does not exist; give an existing .txt/.jsonl/.parquet file, "
                "a `save_to_disk` folder, a hub dataset name, 'embedded' or 'embedded-code'"
            )
        return "hub"


def embedded_code_files() -> list[Path]:
    """The ``embedded-code`` files of this Python, in :data:`EMBEDDED_CODE_FILES` order (those present)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / name for name in EMBEDDED_CODE_FILES if (root / name).is_file()]


def _embedded_code_documents(role: str) -> list[str]:
    """Pieces of :data:`CODE_PIECE_LINES` lines, one from each file in turn, split by parity (even:
    calibration, odd: evaluation), so either half samples every file."""
    pieces = []
    for f in embedded_code_files():
        lines = f.read_text(encoding="utf-8").splitlines()
        pieces.append(["\n".join(lines[i : i + CODE_PIECE_LINES]) for i in range(0, len(lines), CODE_PIECE_LINES)])
    if not pieces:
        raise FileNotFoundError(f"none of the embedded-code files {list(EMBEDDED_CODE_FILES)} is in this Python's "
                                "standard library; give a code file as the evaluation dataset")
    turns = [p for group in itertools.zip_longest(*pieces) for p in group if p is not None and p.strip()]
    parity = 0 if role == "calibration" else 1
    return turns[parity::2]


def _embedded_documents(role: str) -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # stripped Python builds: fall back to stdlib docstrings
        import inspect
        import json, logging as _l, pathlib, argparse, collections, subprocess, textwrap  # noqa: E401

        topics = {
            m.__name__: inspect.getdoc(m) or ""
            for m in (json, _l, pathlib, argparse, collections, subprocess, textwrap)
        }
    keys = sorted(topics)
    parity = 0 if role == "calibration" else 1
    return [topics[k] for i, k in enumerate(keys) if i % 2 == parity]


# Lines of a .txt file are grouped into documents of this many lines (parity splits work on documents).
LINES_PER_DOCUMENT = 32
# A longer "line" (e.g. a whole file without line breaks) is cut into pieces of this many characters.
MAX_LINE_CHARS = 1 << 20


def _text_lines(path: Path) -> Iterator[str]:
    """The lines of a UTF-8 text file without their line breaks (universal newlines, as the
    ``datasets`` text loader reads them), 1 MB at a time; a line over :data:`MAX_LINE_CHARS`
    comes out in pieces, so memory stays bounded whatever the file holds."""
    carry = ""
    with path.open("r", encoding="utf-8") as f:
        while chunk := f.read(1 << 20):
            *lines, carry = (carry + chunk).split("\n")
            yield from lines
            while len(carry) > MAX_LINE_CHARS:
                yield carry[:MAX_LINE_CHARS]
                carry = carry[MAX_LINE_CHARS:]
    if carry:
        yield carry


def _text_file_documents(path: Path) -> Iterator[str]:
    """Documents of :data:`LINES_PER_DOCUMENT` lines, produced lazily: a run reads only as much of the
    file as it tokenizes, and nothing is copied into a dataset cache."""
    group: list[str] = []
    chars = 0
    for line in _text_lines(path):
        group.append(line)
        chars += len(line)
        # A document also ends at MAX_LINE_CHARS: very long lines never pile up into one huge string.
        if len(group) == LINES_PER_DOCUMENT or chars >= MAX_LINE_CHARS:
            yield "\n".join(group)
            group, chars = [], 0
    if group:
        yield "\n".join(group)


def load_documents(source: TextSource, role: str = "calibration") -> Iterable[str]:
    """The source's documents (a lazy iterator for ``.txt`` files, else a list)."""
    kind = source.kind()
    if kind == "embedded":
        return _embedded_code_documents(role) if source.dataset == EMBEDDED_CODE else _embedded_documents(role)
    if kind == "file" and Path(source.dataset).suffix.lower() == ".txt":
        return _text_file_documents(Path(source.dataset).expanduser())
    import datasets

    from compressor.engine.cache import cache_dir

    if kind == "file":
        path = Path(source.dataset).expanduser()
        builder = _FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"unsupported data file type {path.suffix!r} for {path}; use one of {sorted(_FILE_BUILDERS)}"
            )
        # inside compressor's cache folder: counted, capped and removed with the rest
        ds = datasets.load_dataset(builder, data_files=str(path), split="train",
                                   cache_dir=str(cache_dir() / "datasets"))
    elif kind == "disk":
        ds = datasets.load_from_disk(str(Path(source.dataset).expanduser()))
        if isinstance(ds, datasets.DatasetDict):
            if source.split not in ds:
                raise ValueError(f"split {source.split!r} not in {source.dataset}; it has {list(ds)}")
            ds = ds[source.split]
    else:
        from compressor.inputs.hub import LOCAL_DATA_FIX, hub_access

        with hub_access(f"{role}.dataset", source.dataset, LOCAL_DATA_FIX):
            ds = datasets.load_dataset(source.dataset, source.config, split=source.split)
    if source.text_column not in ds.column_names:
        raise ValueError(
            f"text column {source.text_column!r} not found in {source.dataset}; columns are {ds.column_names}. "
            "Set text_column."
        )
    return [d for d in ds[source.text_column] if d]


def tokenize_stream(tokenizer, documents: Iterable[str], max_tokens: int) -> torch.Tensor:
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


def window_start(tokenizer) -> int | None:
    """The token every sequence must start with: the BOS id when the tokenizer puts one in front of
    text by default (Gemma), else None (SmolLM2, Qwen2.5). Windows cut from a text stream lack it, and a
    model trained with it is out of its regime without: Gemma-3-270M's perplexity on WikiText-2 valid is
    170 in windows without BOS and 37 with it."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    try:
        ids = tokenizer("a")["input_ids"]
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say is treated as adding nothing
        return None
    return int(bos) if ids and ids[0] == bos else None


def start_windows(stream: torch.Tensor, seq_len: int, start: int | None) -> torch.Tensor:
    """``stream`` laid out so that every ``seq_len``-token window starts with ``start``: chunks of
    ``seq_len - 1`` ids, each with ``start`` in front (unchanged when ``start`` is None)."""
    if start is None or stream.numel() == 0:
        return stream
    chunks = stream.flatten().to(torch.long).split(seq_len - 1)
    head = torch.tensor([start], dtype=torch.long)
    return torch.cat([torch.cat([head, c]) for c in chunks])


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


def split_windows(
    stream: torch.Tensor | list[torch.Tensor], seq_len: int, heldout_fraction: float, seed: int,
) -> CalibrationSet:
    """Cut ``stream`` into whole windows and hold out a seeded random subset of them.

    A list of streams (e.g. reference text and self-generated text) is cut one
    stream at a time, so no window straddles two sources.
    """
    streams = stream if isinstance(stream, list) else [stream]
    parts = [s[: (s.numel() // seq_len) * seq_len].view(-1, seq_len) for s in streams]
    windows = torch.cat(parts) if parts else torch.empty(0, seq_len, dtype=torch.long)
    n = windows.shape[0]
    if n < 2:
        raise ValueError(
            f"only {sum(s.numel() for s in streams)} calibration tokens: need at least 2 windows of seq_len={seq_len} "
            f"({2 * seq_len} tokens), and the text has no more. Give a longer text, or lower seq_len"
        )
    n_held = min(n - 1, max(1, math.ceil(heldout_fraction * n)))
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    held = torch.sort(perm[:n_held]).values
    fit = torch.sort(perm[n_held:]).values
    return CalibrationSet(fit=windows[fit].contiguous(), heldout=windows[held].contiguous())


def same_source(a: TextSource, b: TextSource) -> bool:
    """Do ``a`` and ``b`` read the same documents?

    Files compare by resolved path whatever their split names (a file has no
    splits; ``split`` defaults differ between calibration and evaluation);
    ``save_to_disk`` folders by resolved path and split; hub datasets by name,
    config and split; ``embedded`` is always the same source.
    """
    ka, kb = a.kind(), b.kind()
    if ka != kb:
        return False
    if ka == "embedded":
        return a.dataset == b.dataset
    if ka == "file":
        return Path(a.dataset).expanduser().resolve() == Path(b.dataset).expanduser().resolve()
    if ka == "disk":
        return Path(a.dataset).expanduser().resolve() == Path(b.dataset).expanduser().resolve() and a.split == b.split
    return (a.dataset, a.config, a.split) == (b.dataset, b.config, b.split)


def _shares(source: TextSource, others) -> bool:
    """True when a non-embedded ``source`` is also one of ``others`` (embedded is split by topic already)."""
    return source.kind() != "embedded" and any(same_source(source, o) for o in others)


def calibration_text_tokens(
    tokenizer, source: TextSource, *, max_tokens: int, evaluation: tuple[TextSource, ...] | list[TextSource] = (),
) -> torch.Tensor:
    """Calibration id stream; the even-numbered documents only when an evaluation domain reads the same source."""
    docs = load_documents(source, "calibration")
    if _shares(source, evaluation):
        docs = itertools.islice(docs, 0, None, 2)
    return tokenize_stream(tokenizer, docs, max_tokens)


def calibration_set(
    tokenizer, source: TextSource, *, seq_len: int = 128, max_tokens: int = 16384,
    heldout_fraction: float = 0.2, seed: int = 0, evaluation: tuple[TextSource, ...] | list[TextSource] = (),
    extra: torch.Tensor | None = None,
) -> CalibrationSet:
    """Calibration windows from ``source`` (≤ ``max_tokens``), plus windows cut from ``extra`` ids if given.

    ``evaluation``: the evaluation sources; when one is ``source`` itself, the
    calibration takes the even-numbered documents and the evaluation the odd ones.
    """
    streams = (
        [calibration_text_tokens(tokenizer, source, max_tokens=max_tokens, evaluation=evaluation)] if max_tokens else []
    )
    if extra is not None:
        streams.append(extra.flatten().to(torch.long))
    parts = (([source.dataset] if max_tokens else [])
             + ([f"{extra.numel()} self-generated tokens"] if extra is not None else []))
    return windows_from(tokenizer, streams, seq_len=seq_len, heldout_fraction=heldout_fraction, seed=seed,
                        names=parts)


def windows_from(tokenizer, streams: list[torch.Tensor], *, seq_len: int, heldout_fraction: float, seed: int,
                 names: list[str]) -> CalibrationSet:
    """Calibration windows cut from each id stream in turn (no window straddles two sources), every window
    starting as the model's input does (:func:`window_start`), a seeded share held out; ``names``: the
    streams' sources, for the log."""
    start = window_start(tokenizer)
    cal = split_windows([start_windows(s, seq_len, start) for s in streams], seq_len, heldout_fraction, seed)
    logger.info("calibration: %d fit + %d held-out windows of %d tokens from %s",
                cal.fit.shape[0], cal.heldout.shape[0], seq_len, " + ".join(names))
    return cal


def evaluation_tokens(
    tokenizer, source: TextSource, calibration: TextSource | Sequence[TextSource] | None, *, max_tokens: int,
) -> torch.Tensor:
    """Evaluation id stream, disjoint from calibration text (``calibration``: the source it reads, or each of
    them when it reads several).

    With the embedded default the halves are disjoint by construction. When the
    evaluation source *is* a calibration source (:func:`same_source`),
    documents are split by parity (even → calibration, odd → evaluation) and a
    warning says so.
    """
    docs = load_documents(source, "evaluation")
    read = [] if calibration is None else [calibration] if isinstance(calibration, TextSource) else list(calibration)
    if _shares(source, read):
        logger.warning(
            "evaluation data is the calibration data (%s): calibrating on even-numbered and evaluating on "
            "odd-numbered documents; give a separate evaluation source for a clean split", source.dataset,
        )
        docs = itertools.islice(docs, 1, None, 2)
    stream = tokenize_stream(tokenizer, docs, max_tokens)
    if stream.numel() < 2:
        raise ValueError(f"evaluation text from {source.dataset!r} produced {stream.numel()} tokens; need more")
    return stream


class OverlapError(ValueError):
    """An evaluation text contains calibration windows: the gate would be measured on training data."""


def _spans(stream: torch.Tensor, n: int) -> set[bytes]:
    """Every length-``n`` span of a 1-D id stream (all offsets), as bytes for exact set lookup."""
    if stream.numel() < n:
        return set()
    u = stream.to(torch.int64).contiguous().unfold(0, n, 1).contiguous().numpy()
    return {row.tobytes() for row in u}


def check_disjoint(cal: CalibrationSet, evaluation: dict[str, torch.Tensor], *, ngram: int = 32) -> dict[str, dict]:
    """Raise :class:`OverlapError` if any calibration window occurs verbatim in an evaluation stream.

    Sound and cheap: every calibration window (fit and held-out) is looked up,
    as exact bytes, in the set of *all* length-``seq_len`` spans of each
    evaluation stream (every offset, not only aligned chunks), so a leaked
    window is found wherever it sits; the cost is one set of ≤ ``max_tokens``
    spans per domain. Shorter shared passages are legitimate in natural text
    (boilerplate, quotations) and are only measured: the returned
    ``{domain: {"leaked_windows", "shared_ngram_fraction"}}`` gives the share of
    each domain's ``ngram``-token spans that also occur in calibration windows.
    """
    windows = torch.cat([cal.fit, cal.heldout])
    cal_ngrams: set[bytes] = set()
    for w in windows:
        cal_ngrams |= _spans(w, ngram)
    out, bad = {}, []
    for name, stream in evaluation.items():
        spans = _spans(stream.flatten(), cal.seq_len)
        leaked = sum(w.to(torch.int64).contiguous().numpy().tobytes() in spans for w in windows)
        grams = _spans(stream.flatten(), ngram)
        shared = len(grams & cal_ngrams) / len(grams) if grams else 0.0
        out[name] = {"leaked_windows": int(leaked), "shared_ngram_fraction": shared, "ngram": ngram}
        if leaked:
            bad.append(f"{name!r}: {leaked} of {windows.shape[0]} calibration windows occur verbatim in it")
    if bad:
        raise OverlapError(
            "evaluation overlaps calibration — " + "; ".join(bad)
            + ". The gate would be measured on text the replacements were fitted on; use disjoint sources "
            "(the same file for both is split by document automatically)."
        )
    return out
