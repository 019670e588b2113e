"""Pearson and Spearman correlations across blocks, with a percentile bootstrap interval.

numpy only (no scipy): Spearman is Pearson on average ranks. Pairs with a
missing value on either side are dropped; fewer than three pairs give None.
"""

from __future__ import annotations

import math

import numpy as np


def _pairs(x, y) -> tuple[np.ndarray, np.ndarray]:
    a = np.array([np.nan if v is None else v for v in x], dtype=np.float64)
    b = np.array([np.nan if v is None else v for v in y], dtype=np.float64)
    keep = np.isfinite(a) & np.isfinite(b)
    return a[keep], b[keep]


def ranks(v: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their positions), 0-based."""
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v), dtype=np.float64)
    r[order] = np.arange(len(v), dtype=np.float64)
    for value in np.unique(v):
        tie = v == value
        if tie.sum() > 1:
            r[tie] = r[tie].mean()
    return r


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / den) if den > 0 else float("nan")


def pearson(x, y) -> float | None:
    a, b = _pairs(x, y)
    return None if len(a) < 3 else _nan_none(_pearson(a, b))


def spearman(x, y) -> float | None:
    a, b = _pairs(x, y)
    return None if len(a) < 3 else _nan_none(_pearson(ranks(a), ranks(b)))


def _nan_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


def correlate(x, y, *, reps: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Pearson and Spearman of ``x`` vs ``y`` with percentile bootstrap intervals (resampling pairs).

    >>> c = correlate([1, 2, 3, 4], [1, 3, 2, 4], reps=200)
    >>> round(c["spearman"]["r"], 2)
    0.8
    """
    a, b = _pairs(x, y)
    out = {"n": int(len(a)), "bootstrap": {"reps": reps, "seed": seed, "level": level}}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(reps, len(a))) if len(a) >= 3 and reps else None
    for name, fn in (("pearson", _pearson), ("spearman", lambda p, q: _pearson(ranks(p), ranks(q)))):
        if len(a) < 3:
            out[name] = {"r": None, "ci": None}
            continue
        r = _nan_none(fn(a, b))
        ci = None
        if idx is not None:
            vals = np.array([fn(a[i], b[i]) for i in idx])
            vals = vals[np.isfinite(vals)]
            if len(vals):
                lo, hi = np.quantile(vals, [(1 - level) / 2, (1 + level) / 2])
                ci = [float(lo), float(hi)]
        out[name] = {"r": r, "ci": ci}
    return out


def describe(c: dict, name: str) -> str:
    """``r = 0.12 [−0.25, 0.41]`` for a :func:`correlate` entry."""
    e = c[name]
    if e["r"] is None:
        return "n/a"
    ci = f" [{e['ci'][0]:+.2f}, {e['ci'][1]:+.2f}]" if e.get("ci") else ""
    return f"{e['r']:+.2f}{ci}"


def excludes_zero(c: dict, name: str) -> bool | None:
    e = c[name]
    if e["r"] is None or not e.get("ci"):
        return None
    lo, hi = e["ci"]
    return lo > 0 or hi < 0
