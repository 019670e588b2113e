"""Stop signals: SIGTERM unwinds a run as Ctrl-C does, and a few steps finish before either takes effect.

``timeout``, ``docker stop``, Slurm at its time limit and most process managers send SIGTERM, whose default
action kills the process where it stands: no ``finally`` runs, so a size run's work folder (the model's F16
and llama.cpp's preset, 16 GB for a 7B) and a half-written staging folder stay behind. Under
:func:`stop_signals_raise` SIGTERM raises :class:`~compressor.core.errors.Terminated` (a
``KeyboardInterrupt``) in the main thread instead, so every clean-up written for Ctrl-C runs for it too.
:func:`signals_deferred` holds both signals back over a few renames that must not stop half-way (publishing
an output).

The command line installs the handler; the library never does (a program that imports compressor keeps
its own signal handling). Only the main thread can set handlers: elsewhere both are no-ops.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from compressor.core.errors import Terminated

#: The signals a run stops on.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


#: Seconds after a SIGTERM during which another is ignored: the clean-up the first started (removing a work
#: folder of many GB) is not broken into by a second one sent right after it.
REPEAT_GRACE_S = 10.0


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """SIGTERM raises :class:`~compressor.core.errors.Terminated` in the main thread while the block runs (the
    previous handler is restored after). A SIGTERM within :data:`REPEAT_GRACE_S` of the one that raised is
    ignored, so that the clean-up runs to its end; a later one raises again (an exception raised inside a
    ``__del__`` is dropped by Python, and the run must still be stoppable). SIGKILL stops it at once."""
    if not _main_thread():
        yield
        return
    last = [float("-inf")]

    def stop(signum, frame):
        if time.monotonic() - last[0] < REPEAT_GRACE_S:
            return
        last[0] = time.monotonic()
        raise Terminated(signum, signal.Signals(signum).name)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive while the block runs take effect when it ends (each handler as it was,
    then the signal raised again), so that the block's steps all happen or none: e.g. files moved from an
    earlier output into the new one, then the folders swapped."""
    if not _main_thread():
        yield
        return
    pending: list[int] = []
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s, handler in before.items():
        if handler is not None:  # None: set outside Python; left alone
            signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, handler in before.items():
            if handler is not None:
                signal.signal(s, handler)
        for s in dict.fromkeys(pending):
            signal.raise_signal(s)


__all__ = ["REPEAT_GRACE_S", "STOP_SIGNALS", "signals_deferred", "stop_signals_raise"]
