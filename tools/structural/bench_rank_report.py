#!/usr/bin/env python
"""The summary of ``results/bench_rank.json``: Spearman tables and the ΔPPL range; run alone, re-prints them.

``tools/structural/bench_rank.py`` measures; :func:`summarise` adds its ``spearman`` and
``summary`` sections and :func:`log_summary` logs the tables.

    python tools/structural/bench_rank_report.py                       # tools/structural/results/bench_rank.json
    python tools/structural/bench_rank_report.py --recompute other.json   # the correlations from the blocks first
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import correlations

RESULTS_DIR = Path(__file__).resolve().parent / "results"

logger = logging.getLogger("bench_rank")

TARGETS = ("wiki_dppl", "wiki_kl")
# Calibration-side statistics (the question of issue 10), then reference rows.
STATISTICS = ("neg_r2_lin", "fisher_cost", "cal_kl", "cal_dppl")
REFERENCE = ("rel_error", "fisher_weight", "neg_r2_bulk", "wiki_kl")
LABELS = {
    "neg_r2_lin": "-R²_lin", "fisher_cost": "fisher cost", "cal_kl": "cal ΔKL", "cal_dppl": "cal ΔPPL",
    "rel_error": "rel. error", "fisher_weight": "fisher weight", "neg_r2_bulk": "-R²_bulk",
    "wiki_kl": "wiki ΔKL", "wiki_dppl": "wiki ΔPPL",
}


def summarise(result: dict, kinds: list[str]) -> None:
    """Add the Spearman tables (``result["spearman"]``) and the ΔPPL range and noise (``result["summary"]``)."""
    result["spearman"] = {}
    for name in kinds:
        table = [{"neg_r2_lin": -b["r2_lin"], "neg_r2_bulk": -b["r2_bulk"], "fisher_weight": b["fisher_weight"],
                  "rel_error": b["kinds"][name]["rel_error"], "fisher_cost": b["kinds"][name]["fisher_cost"],
                  "cal_kl": b["kinds"][name]["cal-heldout"]["kl"], "cal_dppl": b["kinds"][name]["cal-heldout"]["dppl"],
                  "wiki_kl": b["kinds"][name]["wiki-test"]["kl"], "wiki_dppl": b["kinds"][name]["wiki-test"]["dppl"],
                  "outlier_dominated": b["outlier_dominated"]} for b in result["blocks"]]
        result["spearman"][name] = {
            "all": correlations(table, STATISTICS + REFERENCE, TARGETS),
            "not_outlier_dominated": correlations([t for t in table if not t["outlier_dominated"]],
                                                  STATISTICS + REFERENCE, TARGETS),
        }
        wiki = {b["block"]: b["kinds"][name]["wiki-test"] for b in result["blocks"]}
        dppl = {i: w["dppl"] for i, w in wiki.items()}
        se = [w["dppl_se"] for w in wiki.values() if w["dppl_se"] is not None]
        result.setdefault("summary", {})[name] = {
            "wiki_dppl_min": min(dppl.values()), "wiki_dppl_min_block": min(dppl, key=dppl.get),
            "wiki_dppl_max": max(dppl.values()), "wiki_dppl_max_block": max(dppl, key=dppl.get),
            "wiki_dppl_median": statistics.median(dppl.values()),
            "wiki_dppl_se_median": statistics.median(se) if se else None, "wiki_dppl_se_max": max(se, default=None),
            "blocks_within_2se": sum(w["dppl_se"] is not None and abs(w["dppl"]) < 2 * w["dppl_se"]
                                     for w in wiki.values()),
        }


def log_summary(result: dict, kinds: list[str]) -> None:
    """Spearman ρ of each statistic against wiki-test ΔPPL and ΔKL, per kind and block subset."""
    for subset in ("all", "not_outlier_dominated"):
        head = "".join(f"{k + ' ' + LABELS[t]:>22}" for k in kinds for t in TARGETS)
        lines = [f"Spearman ρ, {subset.replace('_', ' ')} blocks (n = "
                 f"{', '.join(str(result['spearman'][k][subset]['fisher_cost']['wiki_dppl']['n']) for k in kinds)})",
                 f"{'statistic':<16}{head}"]
        for s in STATISTICS + REFERENCE:
            cells = []
            for k in kinds:
                for t in TARGETS:
                    rho = (result["spearman"][k][subset][s].get(t) or {}).get("rho")
                    cells.append(f"{'—' if rho is None else format(rho, '+.3f'):>22}")
            lines.append(f"{LABELS[s]:<16}{''.join(cells)}")
        logger.info("\n%s", "\n".join(lines))
    for k, s in result["summary"].items():
        logger.info("%s: wiki ΔPPL from %+.2f%% to %+.2f%% (median %+.2f%%); paired SE median %.2f%%, max %.2f%%; "
                    "%d blocks within 2 SE of 0", k, 100 * s["wiki_dppl_min"], 100 * s["wiki_dppl_max"],
                    100 * s["wiki_dppl_median"], 100 * s["wiki_dppl_se_median"], 100 * s["wiki_dppl_se_max"],
                    s["blocks_within_2se"])



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", nargs="?", type=Path, default=RESULTS_DIR / "bench_rank.json",
                    help="a bench_rank.py result (default %(default)s)")
    ap.add_argument("--recompute", action="store_true", help="recompute the tables from the per-block rows")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    result = json.loads(args.result.read_text(encoding="utf-8"))
    kinds = result["args"]["kinds"]
    if args.recompute:
        summarise(result, kinds)
    log_summary(result, kinds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
