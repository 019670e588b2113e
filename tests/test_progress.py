"""Progress where stderr is not a terminal: periodic log lines with a rate and the time left."""

from __future__ import annotations

import logging

import pytest

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


def test_the_run_says_how_long_it_expects_to_take(caplog, monkeypatch):
    """A forward probe and the recipe's counts give a per-stage estimate, logged before the heavy work."""
    import logging

    from tiny import tiny_model

    from compressor.pipeline.estimate import estimate_run, say_estimate
    from compressor.recipe import recipe_from_dict

    model = tiny_model("llama")
    base = {"model": {"source": "unused"}, "output": {"path": "unused"}, "replacement": {"kind": "prune"},
            "policy": {"strategy": "allocate", "allocation": "fisher"}}  # as recipes/smollm2-135m.yaml
    recipe = recipe_from_dict(base)
    est = estimate_run(recipe, model, self_text_cached=False, hidden=True)
    assert list(est.stages)[:3] == ["self-calibration", "loss gradients", "pass A"]
    assert all(v > 0 and v == v for v in est.stages.values()) and est.total_s == sum(est.stages.values())
    cached = estimate_run(recipe, model, self_text_cached=True, hidden=True)
    assert "self-calibration" not in cached.stages
    more = recipe_from_dict({**base, "calibration": {"max_tokens": 16384 * 4}})
    # the same forward speed for both (a timing probe on a shared machine is noisy): more tokens, more time
    import compressor.pipeline.estimate as estimate
    speed = est.forward_s_per_token
    monkeypatch.setattr(estimate, "forward_seconds_per_token", lambda *a, **k: speed)
    assert (estimate_run(more, model, self_text_cached=True, hidden=True).stages["pass A"]
            > estimate_run(recipe, model, self_text_cached=True, hidden=True).stages["pass A"])
    # a resumed run: what its state holds is not counted again
    full = estimate_run(recipe, model, self_text_cached=True, hidden=True)
    n = model.config.num_hidden_layers
    half = estimate_run(recipe, model, self_text_cached=True, hidden=True, recorded={"gradients": True, "layers": n // 2})
    assert "loss gradients" not in half.stages
    assert half.stages["pass A"] == pytest.approx(full.stages["pass A"] * (n - n // 2) / n)
    done = estimate_run(recipe, model, self_text_cached=True, hidden=True, recorded={"gradients": True, "layers": n})
    assert done.stages["pass A"] == 0 and done.stages["gate"] == full.stages["gate"]
    # a fixed cut is expected to take one gate attempt, not the bisection's
    fixed = recipe_from_dict({**base, "policy": {**base["policy"], "ffn_keep": 0.8}})
    assert estimate_run(fixed, model, self_text_cached=True, hidden=True).stages["gate"] < full.stages["gate"]
    with caplog.at_level(logging.INFO, logger="compressor.pipeline.estimate"):
        assert say_estimate(recipe, model, self_text_cached=True, hidden=True) is not None
    assert "expected run time: about" in caplog.text
    assert say_estimate(recipe, object(), self_text_cached=True, hidden=True) is None  # never fails a run
