"""Threads side by side on numpy work (:mod:`compressor.core.threads`)."""

from __future__ import annotations

import threading

import pytest

from compressor.core.threads import side_by_side


def test_side_by_side_keeps_the_order_and_gives_each_thread_one_blas_thread():
    from threadpoolctl import threadpool_info

    def work(i):
        return i * i, threading.get_ident(), [x["num_threads"] for x in threadpool_info() if x["user_api"] == "blas"]

    out = list(side_by_side(work, range(24), threads=2))
    assert [o[0] for o in out] == [i * i for i in range(24)]
    assert all(n == 1 for o in out for n in o[2])
    here = threading.get_ident()
    assert all(o[1] != here for o in out)
    # one item, or one thread: run here, as a plain map
    assert list(side_by_side(lambda i: threading.get_ident(), [1])) == [here]
    assert list(side_by_side(lambda i: threading.get_ident(), [1, 2], threads=1)) == [here, here]
    assert list(side_by_side(lambda i: i, [])) == []


def test_side_by_side_passes_a_workers_error_on():
    with pytest.raises(ZeroDivisionError):
        list(side_by_side(lambda i: 1 / i, [1, 0, 2], threads=2))
