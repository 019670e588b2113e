"""One place that makes progress bars: stage name in the label, stderr, and
silent under ``--quiet`` (``TQDM_DISABLE``) or when stderr is not a terminal."""

from __future__ import annotations

import os

from tqdm.auto import tqdm


def progress(iterable=None, **kwargs):
    quiet = os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes")
    kwargs.setdefault("leave", False)
    return tqdm(iterable, disable=True if quiet else None, **kwargs)
