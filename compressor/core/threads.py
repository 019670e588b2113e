"""Threads side by side on numpy work: each on one BLAS thread.

The size planner runs ggml's scale searches and GPTQ's column loop (numpy, single-threaded but for its BLAS
products) for several tensors at once on a thread pool, one thread per core. numpy's BLAS would split each
product over every core again, and on a 2-core machine two pool threads × two BLAS threads cost more than
they gain (off-grid SmolLM2-135M, pricing: 28 % faster with one BLAS thread each).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


def one_blas_thread_each():
    """A context in which numpy's BLAS (OpenBLAS, MKL, …) runs each product on one thread (threadpoolctl)."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(1, user_api="blas")


def workers() -> int:
    """Threads a pool of numpy work uses: torch's intra-op thread count (the cores the run may use)."""
    return max(1, torch.get_num_threads())


def side_by_side(fn: Callable[[T], R], items: Iterable[T], threads: int | None = None) -> Iterable[R]:
    """``fn`` over ``items`` on :func:`workers` threads, each on one BLAS thread; results in ``items``' order
    (a generator: the pool runs while it is consumed). One item, or one thread: in this thread."""
    items = list(items)
    threads = min(threads or workers(), len(items))
    if threads <= 1:
        yield from map(fn, items)
        return
    with one_blas_thread_each(), ThreadPoolExecutor(threads) as pool:
        yield from pool.map(fn, items)
