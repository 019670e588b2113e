"""Input checks that name the bad thing and the fix, run as early as possible.

* :func:`check_data_source` — a calibration/evaluation data file is usable
  (exists, readable, non-empty, UTF-8 text where text is expected, has the
  text column) — before any model is loaded;

:class:`DataFileError` is an input error (exit 2: the file given is unusable,
nothing was written). The NaN/Inf checks of weights and activations live in
:mod:`compressor.core.finite`.
"""

from __future__ import annotations

import codecs
import csv
import json
import re
from pathlib import Path

from compressor.core.errors import DataFileError

TEXT_SUFFIXES = (".txt", ".jsonl", ".csv", ".json")


# --------------------------------------------------------------------------------------------------
# Data files
# --------------------------------------------------------------------------------------------------


def check_data_source(source) -> None:
    """Check a :class:`compressor.inputs.data.TextSource` that names a local file.

    Hub datasets, ``embedded`` and ``save_to_disk`` folders are left to the
    loader. Raises :class:`FileNotFoundError` or :class:`DataFileError`.
    """
    kind = source.kind()
    if kind == "disk":
        check_saved_dataset(Path(source.dataset).expanduser())
    elif kind == "hub":
        check_hub_name(source.dataset)
    if kind != "file":
        return
    check_data_file(Path(source.dataset).expanduser(), source.text_column)


#: What ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` leave in their folder.
SAVED_DATASET_FILES = (("dataset_info.json", "state.json"), ("dataset_dict.json",))
_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def check_saved_dataset(folder: Path) -> None:
    """A folder is a data source only when ``save_to_disk`` wrote it; else say which files it holds."""
    if any(all((folder / f).is_file() for f in group) for group in SAVED_DATASET_FILES):
        return
    from compressor.inputs.data import _FILE_BUILDERS

    try:
        usable = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in _FILE_BUILDERS)
    except OSError as e:
        raise DataFileError(f"{folder} cannot be read: {e.strerror}; check its permissions") from None
    hint = (f" (this folder holds {', '.join(usable[:6])}{' …' if len(usable) > 6 else ''})" if usable else "")
    raise DataFileError(f"{folder} is a folder but not a dataset saved with `Dataset.save_to_disk` (no "
                        "dataset_info.json + state.json, no dataset_dict.json); give one data file "
                        f"(.txt/.jsonl/.json/.parquet/.csv){hint}, or the folder save_to_disk wrote")


def check_hub_name(name: str) -> None:
    """A Hub dataset name is ``name`` or ``owner/name``: a scheme (``hf:``, ``hf://``) or other characters are
    refused here, not sent to ``datasets`` (which reads them as a path under the working directory)."""
    if _HUB_NAME.match(name):
        return
    bare = re.sub(r"^(hf|hub|huggingface)(://|:)(datasets/)?", "", name, flags=re.I)
    hint = (f"write the Hub name without the scheme: {bare!r}" if bare != name and _HUB_NAME.match(bare)
            else "a Hub dataset name looks like owner/name (e.g. Salesforce/wikitext)")
    raise DataFileError(f"{name!r} is not a local file or folder (nothing by that name here) and not a Hub dataset "
                        f"name: {hint}; or give a local .txt/.jsonl/.parquet file, 'embedded' or 'embedded-code'")


def check_data_file(path: Path, text_column: str = "text") -> None:
    from compressor.inputs.data import _FILE_BUILDERS

    suffix = path.suffix.lower()
    if suffix not in _FILE_BUILDERS:
        raise DataFileError(
            f"{path}: unsupported data file type {suffix or '(no suffix)'!r}; "
            f"use one of {', '.join(sorted(_FILE_BUILDERS))}"
        )
    try:
        with path.open("rb") as f:
            head = f.read(1)
    except OSError as e:
        raise DataFileError(f"{path} cannot be read: {e.strerror}; check its permissions") from None
    if not head:
        raise DataFileError(f"{path} is empty (0 bytes); give a file with text in it")
    if suffix in TEXT_SUFFIXES:
        _check_utf8(path)
    if suffix == ".txt":
        if not _has_non_space(path):
            raise DataFileError(f"{path} holds only whitespace; give a file with text in it")
    elif suffix == ".jsonl":
        _check_jsonl(path, text_column)
    elif suffix == ".json":
        _check_json(path, text_column)
    elif suffix == ".csv":
        _check_csv(path, text_column)
    elif suffix == ".parquet":
        _check_parquet(path, text_column)


def _check_utf8(path: Path) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                where = offset + e.start
                raise DataFileError(
                    f"{path} is not UTF-8 text (undecodable byte at offset {where}); "
                    + ("it looks like a binary file. " if b"\0" in chunk else "")
                    + "Convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or give another file"
                ) from None
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataFileError(f"{path} is not UTF-8 text (it ends inside a multi-byte character)") from None


def _has_non_space(path: Path) -> bool:
    with path.open("r", encoding="utf-8") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return True
    return False


def _missing_column(path: Path, column: str, columns) -> DataFileError:
    return DataFileError(
        f"{path} has no text column {column!r}; its columns are {sorted(columns)}. "
        "Set calibration.text_column / evaluation.text_column to the column that holds the text"
    )


def _check_jsonl(path: Path, column: str) -> None:
    """Every line, not only the first: a broken line 10,000 must not fail a run after the model loaded."""
    seen = False
    with path.open("r", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataFileError(
                    f"{path} line {n} is not JSON ({e}); a .jsonl file holds one JSON object per line"
                ) from None
            if not isinstance(row, dict):
                raise DataFileError(f"{path} line {n} is a JSON {type(row).__name__}, expected an object like "
                                    f'{{"{column}": "..."}}')
            if column not in row:
                raise _missing_column(path, column, row)
            seen = True
    if not seen:
        raise DataFileError(f"{path} has no JSON lines (only whitespace); give a file with text in it")


def _check_json(path: Path, column: str) -> None:
    if path.stat().st_size > 256 << 20:
        return  # too big to parse here; the loader will check it
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        try:  # JSON Lines under a .json name is accepted by the loader
            return _check_jsonl(path, column)
        except DataFileError:
            raise DataFileError(f"{path} is not valid JSON or JSON Lines") from None
    if isinstance(data, list):
        if not data:
            raise DataFileError(f"{path} is an empty JSON list; give a file with text in it")
        if isinstance(data[0], dict) and column not in data[0]:
            raise _missing_column(path, column, data[0])


def _check_csv(path: Path, column: str) -> None:
    with path.open("r", encoding="utf-8", newline="") as f:
        header = next(csv.reader(f), None)
    if not header:
        raise DataFileError(f"{path} has no header row; a .csv data file needs a header with a {column!r} column")
    if column not in header:
        raise _missing_column(path, column, header)


def _check_parquet(path: Path, column: str) -> None:
    try:
        import pyarrow.parquet as pq

        schema = pq.read_schema(str(path))
    except ImportError:
        return
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataFileError(f"{path} is not a readable Parquet file ({e})") from None
    if column not in schema.names:
        raise _missing_column(path, column, schema.names)
