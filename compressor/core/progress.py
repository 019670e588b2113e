"""One place that makes progress: the stage name in the label, on stderr, silent under
``--quiet`` (``TQDM_DISABLE``).

On a terminal it is a tqdm bar. Where stderr is not a terminal (a build
pipeline's log, ``2> file``) a bar would be noise, and silence for minutes
looks like a hang; there it logs a line at most every :data:`LOG_INTERVAL_S`
seconds (and at the end of a stage longer than that) with the count, the rate
and the estimated time left.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from tqdm.auto import tqdm

logger = logging.getLogger("compressor.progress")

LOG_INTERVAL_S = 30.0


def _quiet() -> bool:
    return os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes")


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


class LogProgress:
    """The subset of tqdm's interface the engine uses, reporting through ``logging`` instead."""

    def __init__(self, iterable=None, *, total=None, desc: str = "", unit: str = "it", interval: float = LOG_INTERVAL_S,
                 clock=time.monotonic, **_) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.desc, self.unit, self.interval, self.clock = total, desc, unit, interval, clock
        self.n = 0
        self.start = self.last = clock()
        self.logged = False

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            self._log(now)

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def _log(self, now: float, done: bool = False) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.n / elapsed
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        if done:
            tail = f"done in {_duration(elapsed)}"
        elif self.total and rate > 0:
            tail = f"about {_duration((self.total - self.n) / rate)} left"
        else:
            tail = f"{_duration(elapsed)} so far"
        logger.info("%s: %s %s (%.3g %s/s), %s", self.desc or "progress", count, self.unit, rate, self.unit, tail)
        self.logged = True

    def close(self) -> None:
        if self.logged:  # a stage long enough to have reported says when it ended
            self._log(self.clock(), done=True)
            self.logged = False

    def __enter__(self) -> "LogProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(iterable=None, **kwargs):
    """A tqdm bar on a terminal, periodic log lines elsewhere, nothing under ``--quiet``."""
    kwargs.setdefault("leave", False)
    if _quiet():
        return tqdm(iterable, disable=True, **kwargs)
    if not _is_terminal():
        return LogProgress(iterable, **kwargs)
    return tqdm(iterable, **kwargs)
