"""The rank statistics of ``tools/benchlib/stats.py`` that ``tools/structural/bench_rank.py`` reports (no model,
no data)."""

from __future__ import annotations

import itertools
import math

import pytest

from tools.benchlib import stats


def test_average_ranks_share_ties():
    assert stats.average_ranks([10, 30, 20, 30, 10, 40]) == [1.5, 4.5, 3.0, 4.5, 1.5, 6.0]
    assert stats.average_ranks([]) == []


def test_spearman_without_ties_is_the_rank_difference_formula():
    x = [0.3, -1.2, 5.0, 2.2, 0.0, 7.5, -3.0]
    y = [1.0, 0.5, 3.0, 4.0, -2.0, 2.5, 0.1]
    rx, ry = stats.average_ranks(x), stats.average_ranks(y)
    n = len(x)
    expected = 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))
    assert stats.spearman(x, y) == pytest.approx(expected, abs=1e-12)


def test_spearman_with_ties_hand_computed():
    # ranks x: 1.5 1.5 3 4, ranks y: 1 3 3 3 (means 2.5): Σdxdy = 2, Σdx² = 4.5, Σdy² = 3
    x, y = [1, 1, 2, 3], [5, 7, 7, 7]
    assert stats.spearman(x, y) == pytest.approx(2.0 / math.sqrt(4.5 * 3.0), abs=1e-12)


def test_spearman_with_ties_against_brute_force_pearson():
    x = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    y = [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]

    def rank(v):  # by definition: mean position among equal values
        s = sorted(v)
        return [sum(i + 1 for i, w in enumerate(s) if w == a) / s.count(a) for a in v]

    rx, ry = rank(x), rank(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    assert stats.spearman(x, y) == pytest.approx(num / den, abs=1e-12)


def test_spearman_edge_cases():
    assert stats.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert stats.spearman([1, 2, 3], [1, 1, 1]) is None  # constant side
    assert stats.spearman([1, 2], [1, 2]) is None  # too few pairs
    # missing and non-finite values drop their pair
    assert stats.spearman([1, None, 2, float("nan"), 3, 4], [1, 9, 2, 0, 4, 3]) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        stats.spearman([1, 2, 3], [1, 2])


def test_bootstrap_interval_brackets_the_estimate_and_is_seeded():
    x = [float(i) for i in range(20)]
    y = [v + (3.0 if i % 4 == 0 else -2.0) * (i % 3) for i, v in enumerate(x)]
    rho = stats.spearman(x, y)
    lo, hi = stats.bootstrap_interval(x, y, resamples=300)
    assert -1.0 <= lo <= rho <= hi <= 1.0
    assert stats.bootstrap_interval(x, y, resamples=300) == (lo, hi)
    assert stats.bootstrap_interval([1, 2], [2, 1]) is None


def test_correlations_skip_the_statistic_against_itself():
    rows = [{"a": float(i), "b": float(-i), "t": float(i * i)} for i in range(6)]
    out = stats.correlations(rows, ("a", "b", "t"), ("t",))
    assert out["a"]["t"]["rho"] == pytest.approx(1.0) and out["a"]["t"]["n"] == 6
    assert out["b"]["t"]["rho"] == pytest.approx(-1.0)
    assert out["t"] == {}


@pytest.mark.parametrize("perm", list(itertools.permutations(range(4))))
def test_spearman_is_the_textbook_value_on_every_permutation(perm):
    x = [0, 1, 2, 3]
    d2 = sum((a - b) ** 2 for a, b in zip(x, perm))
    assert stats.spearman(x, list(perm)) == pytest.approx(1 - 6 * d2 / (4 * 15), abs=1e-12)
