"""Pure statistics: paired perplexity change, Spearman ρ with bootstrap intervals (no torch)."""

from __future__ import annotations

import math
import random


def paired_change(ev, base) -> tuple[float, float | None]:
    """Relative perplexity change of evaluation ``ev`` against ``base`` (same windows) and its
    standard error, paired by window (``Evaluation.nll_delta_se`` × the perplexity ratio)."""
    ratio = ev.ppl / base.ppl
    return ratio - 1, None if ev.nll_delta_se is None else ev.nll_delta_se * ratio


def paired_window_change(nll_after: list[float], nll_before: list[float]) -> tuple[float, float, float, float | None]:
    """From mean NLL per window (same windows, same order): ``(ppl_after, ppl_before, relative change,
    its standard error)``, the SE paired by window (SE of the mean NLL difference × the perplexity ratio)."""
    p1, p0 = math.exp(sum(nll_after) / len(nll_after)), math.exp(sum(nll_before) / len(nll_before))
    d = [a - b for a, b in zip(nll_after, nll_before, strict=True)]
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) * (len(d) - 1))) if len(d) > 1 else None
    return p1, p0, p1 / p0 - 1, None if se is None else se * p1 / p0


def average_ranks(values: list[float]) -> list[float]:
    """1-based ranks of ``values``; tied values share the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for j in range(start, end + 1):
            ranks[order[j]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def spearman(x: list[float | None], y: list[float | None]) -> float | None:
    """Spearman's ρ: the Pearson correlation of average ranks (as ``scipy.stats.spearmanr``).

    Pairs where either value is missing or not finite are dropped; None when
    fewer than 3 pairs remain or one side is constant.

    >>> spearman([1, 2, 3, 4], [10, 20, 40, 30])
    0.8
    """
    pairs = [(a, b) for a, b in zip(x, y, strict=True) if _finite(a) and _finite(b)]
    if len(pairs) < 3:
        return None
    rx, ry = average_ranks([a for a, _ in pairs]), average_ranks([b for _, b in pairs])
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def bootstrap_interval(x: list[float | None], y: list[float | None], *, resamples: int = 1000,
                       level: float = 0.95, seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of :func:`spearman`, resampling (x, y) pairs with replacement."""
    pairs = [(a, b) for a, b in zip(x, y, strict=True) if _finite(a) and _finite(b)]
    if len(pairs) < 3:
        return None
    rng = random.Random(seed)
    rhos = []
    for _ in range(resamples):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        rho = spearman([a for a, _ in sample], [b for _, b in sample])
        if rho is not None:
            rhos.append(rho)
    if not rhos:
        return None
    rhos.sort()
    tail = (1 - level) / 2
    pick = lambda q: rhos[min(len(rhos) - 1, max(0, round(q * (len(rhos) - 1))))]  # noqa: E731
    return pick(tail), pick(1 - tail)


def correlations(rows: list[dict], statistics: tuple[str, ...], targets: tuple[str, ...]) -> dict:
    """``{statistic: {target: {"rho", "ci95", "n"}}}`` over ``rows`` (one dict per block)."""
    out: dict = {}
    for s in statistics:
        out[s] = {}
        for t in targets:
            if s == t:
                continue
            x, y = [r.get(s) for r in rows], [r.get(t) for r in rows]
            ci = bootstrap_interval(x, y)
            out[s][t] = {"rho": spearman(x, y), "ci95": list(ci) if ci else None,
                         "n": sum(_finite(a) and _finite(b) for a, b in zip(x, y))}
    return out
