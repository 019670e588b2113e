"""The interpolation of ``tools/structural/bench_frontier_budgets.py`` (no model, no data)."""

from __future__ import annotations

import pytest

from tools.structural import bench_frontier_budgets as fb

POINTS = [{"ffn_removed_share": 0.2, "test_delta": 0.08}, {"ffn_removed_share": 0.1, "test_delta": 0.03},
          {"ffn_removed_share": 0.3, "test_delta": 0.25}]


def test_removed_at_interpolates_between_the_bracketing_cuts():
    assert fb.removed_at(POINTS, 0.05)["ffn_removed_share"] == pytest.approx(0.1 + 0.1 * 0.02 / 0.05)
    assert fb.removed_at(POINTS, 0.05)["bracket"] == [0.1, 0.2]
    assert fb.removed_at(POINTS, 0.20)["ffn_removed_share"] == pytest.approx(0.2 + 0.1 * 0.12 / 0.17)
    # below the first cut's cost: between the original (0 removed, 0 cost) and it
    assert fb.removed_at(POINTS, 0.015)["ffn_removed_share"] == pytest.approx(0.05)


def test_removed_at_says_when_the_frontier_lies_beyond_the_cuts_measured():
    got = fb.removed_at(POINTS, 0.5)
    assert got["ffn_removed_share"] == 0.3 and got["beyond_largest_measured"]
    assert "beyond_largest_measured" not in fb.removed_at(POINTS, 0.05)
