"""Progress where stderr is not a terminal: periodic log lines with a rate and the time left."""

from __future__ import annotations

import logging

from compressor.core.progress import LogProgress, progress


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_log_progress_reports_rate_and_time_left(caplog):
    clock = _Clock()
    caplog.set_level(logging.INFO, logger="compressor.progress")
    with LogProgress(total=100, desc="self-calibration text", unit="tok", interval=30, clock=clock) as bar:
        for _ in range(10):
            clock.t += 1
            bar.update(1)  # 10 s: nothing yet
        assert not caplog.records
        clock.t += 30
        bar.update(30)  # 40 tokens in 40 s
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "self-calibration text: 40/100 tok (1 tok/s), about 1m00s left"
    assert lines[-1].endswith("done in 40s")


def test_short_stage_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="compressor.progress")
    for _ in LogProgress(range(5), desc="quick", interval=30):
        pass
    assert not caplog.records


def test_progress_is_quiet_under_tqdm_disable(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    bar = progress(range(3), desc="x")
    assert list(bar) == [0, 1, 2]
    assert getattr(bar, "disable", False)
