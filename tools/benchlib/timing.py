"""Timing: phases re-timed while other processes load the CPU, interleaved rounds, prefill / decode,
a stopwatch for the stages of a run."""

from __future__ import annotations

import logging
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, TypeVar

from .machine import BUSY_CORES, OtherCpu

logger = logging.getLogger("benchlib")
T = TypeVar("T")


def timed_with_retries(name: str, fn: Callable[[], T], retries: int) -> tuple[T, dict]:
    """Run ``fn()`` timed; re-run up to ``retries`` times while other processes load the CPU.

    Returns ``(value, record)`` for the fastest attempt; ``record`` has its wall
    and CPU seconds, the cores other processes used meanwhile, and all attempts.
    """
    attempts, best = [], None
    for k in range(retries + 1):
        with OtherCpu(quiet=True) as oc:
            c0, t0 = time.process_time(), time.perf_counter()
            value = fn()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rec = {"wall_s": wall, "cpu_s": cpu, "other_cores": oc.cores}
        attempts.append(rec)
        if best is None or wall < best[1]["wall_s"]:
            best = (value, rec)
        if oc.cores <= BUSY_CORES:
            break
        logger.warning(
            "%s: other processes used %.2f CPU cores (%.1f s wall)%s", name, oc.cores, wall,
            "; timing again" if k < retries else "; keeping the fastest attempt",
        )
    value, rec = best
    return value, dict(rec, attempts=attempts, contaminated=rec["other_cores"] > BUSY_CORES)


def interleaved(variants: dict[str, Any], measure: Callable[[Any], T], rounds: int) -> dict[str, list[T]]:
    """``measure(variant)`` for every variant, round after round (A B A B …), so that machine noise
    hits every variant alike and their ratio comes from one run; ``{name: [one result per round]}``."""
    out: dict[str, list[T]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, v in variants.items():
            out[name].append(measure(v))
    return out


def ratio_of_medians(numerator: list[float], denominator: list[float]) -> float:
    """``median(numerator) / median(denominator)``: e.g. a speed-up from interleaved rounds."""
    return statistics.median(numerator) / statistics.median(denominator)


def device_sync(device) -> Callable[[], None]:
    """``torch.cuda.synchronize`` on a CUDA device (kernels are asynchronous), else a no-op."""
    import torch

    return torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)


def prefill_decode(model, ids, reps: int, *, stat: str = "median", device="cpu",
                   prompt: int = 16, new_tokens: int = 64) -> tuple[float, float]:
    """Prefill seconds of ``ids`` (after one warm-up; ``stat`` = ``median`` of ``reps`` timed runs,
    or ``mean`` of one timed block of ``reps``) and greedy decoding speed (tokens/s) of
    ``new_tokens`` tokens after the first ``prompt`` tokens."""
    import torch

    sync = device_sync(device)
    with torch.no_grad():
        model(input_ids=ids)
        if stat == "mean":
            sync(); t0 = time.perf_counter()  # noqa: E702
            for _ in range(reps):
                model(input_ids=ids)
            sync(); prefill = (time.perf_counter() - t0) / reps  # noqa: E702
        elif stat == "median":
            runs = []
            for _ in range(reps):
                t0 = time.perf_counter()
                model(input_ids=ids)
                sync()
                runs.append(time.perf_counter() - t0)
            prefill = statistics.median(runs)
        else:
            raise ValueError(f"stat must be 'median' or 'mean', not {stat!r}")
        t0 = time.perf_counter()
        out = model.generate(ids[:, :prompt], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        sync()
        decode = (out.shape[1] - prompt) / (time.perf_counter() - t0)
    return prefill, decode


@contextmanager
def stopwatch(into: dict, key: str, sync: Callable[[], None] | None = None):
    """``with stopwatch(timings, "walk_s"):`` records the body's wall seconds as ``into[key]``
    (``sync``, e.g. :func:`device_sync`, runs before the clock starts and before it stops)."""
    if sync is not None:
        sync()
    t0 = time.perf_counter()
    yield
    if sync is not None:
        sync()
    into[key] = time.perf_counter() - t0
