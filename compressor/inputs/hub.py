"""What a Hub model or dataset that cannot be fetched says: offline (and how to point at a local copy),
or not found — never a raw ``OSError`` / ``ConnectionError`` from deep inside a library.

>>> with hub_access("model.source", "owner/name", LOCAL_MODEL_FIX):   # doctest: +SKIP
...     AutoConfig.from_pretrained("owner/name")
"""

from __future__ import annotations

from contextlib import contextmanager

from compressor.core.errors import InputError

#: How to give a model without the network.
LOCAL_MODEL_FIX = ("point model.source at a local copy: a save_pretrained folder or a .gguf file (on a machine "
                   "with a network: `hf download {name} --local-dir DIR`), or set HF_HUB_OFFLINE=1 when the "
                   "model is in the Hugging Face cache already")
#: How to give a dataset without the network.
LOCAL_DATA_FIX = ("give a local copy: a .txt/.jsonl/.parquet file or a `Dataset.save_to_disk` folder (on a machine "
                  "with a network: `datasets.load_dataset({name!r}, ...).save_to_disk(DIR)`), or 'embedded' / "
                  "'embedded-code' (shipped with Python)")
_OFFLINE_NAMES = ("connect", "offline", "timeout", "localentrynotfound", "nameresolution", "maxretry")


def looks_offline(err: BaseException) -> bool:
    """True when ``err`` or an exception it came from is a failure to reach the network."""
    seen = 0
    while err is not None and seen < 16:
        if isinstance(err, (ConnectionError, TimeoutError)):
            return True
        if any(n in type(err).__name__.lower() for n in _OFFLINE_NAMES):
            return True
        text = str(err).lower()
        if "offline" in text or "couldn't connect" in text or "failed to resolve" in text:
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


@contextmanager
def hub_access(field: str, name: str, fix: str):
    """Turn a failure to fetch ``name`` from the Hub into an :class:`InputError` (exit 2) naming
    ``field``: offline, or not found / not accessible, with ``fix`` (``{name}`` is filled in)."""
    try:
        yield
    except InputError:
        raise
    except (OSError, ConnectionError, ValueError) as e:
        if isinstance(e, ValueError) and not looks_offline(e):
            raise
        fix = fix.format(name=name)
        if looks_offline(e):
            raise InputError(f"{field}: {name!r} is not a local path, so it would come from the Hugging Face Hub, "
                             f"which cannot be reached: this machine looks offline ({type(e).__name__}). To run "
                             f"offline, {fix}") from None
        raise InputError(f"{field}: {name!r} is not a local path, and the Hugging Face Hub has no such repository "
                         f"or refuses access ({type(e).__name__}: {str(e)[:200]}). Check the name (a local path "
                         f"must exist), log in for a gated repository, or {fix}") from None
