"""The Markdown table of a ``tools/size/bench_size_frontier.py`` result, as the README and docs/size.md quote it.

    python tools/size/frontier_table.py tools/size/results/size_frontier_offgrid_qwen2.5_coder_1.5b_iquants.json

One row per file, smallest first: its bytes, and per domain scored (the evaluation text, and ``--code-text``)
the KL divergence from the F16 (mean ± its standard error over windows, p99, same top token) and the perplexity
change; then one line per planned size with compressor's KLD over the imatrix preset's of that size and over
the best imatrix preset of no more bytes (``kld_ratios``), in domain and out of it side by side.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DOMAINS = (("text", "WikiText-2 test"), ("code", "stdlib"))


def _domain(row: dict, domain: str) -> dict:
    return row if domain == "text" else row.get("code") or {}


def cells(row: dict, domain: str) -> list[str]:
    """KLD mean ± SE, p99, same-top and the perplexity change of ``row`` on ``domain`` (dashes where unscored)."""
    d = _domain(row, domain)
    k = d.get("kld") or {}
    if not k:
        return ["—"] * 4
    se = f" ± {k['mean_se']:.4f}" if k.get("mean_se") is not None else ""
    return [f"{k['mean']:.4f}{se}", f"{k['p99']:.3f}", f"{100 * k['same_top_token']:.1f} %",
            f"{100 * d['change_vs_f16']:+.2f} %"]


def label(row: dict) -> str:
    name = row["file"]
    if name.startswith("compressor-"):
        rest = name.removeprefix("compressor-")
        mix = rest.endswith("-mix")
        return f"**compressor at {rest.removesuffix('-mix')}'s size**" + (" (default calibration)" if mix else "")
    return name.replace("-imatrix", " + imatrix")


def table(result: dict) -> str:
    """The rows, smallest file first, and the ratio lines."""
    domains = [(d, n) for d, n in DOMAINS if any(_domain(r, d).get("kld") for r in result["rows"])]
    head = ["file", "bytes"] + [f"{n} {c}" for _, n in domains for c in ("KLD", "p99", "same top", "ppl")]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for row in sorted((r for r in result["rows"] if r["file"] != "F16"), key=lambda r: r["bytes"]):
        lines.append("| " + " | ".join([label(row), f"{row['bytes']:,}"] + [c for d, _ in domains
                                                                           for c in cells(row, d)]) + " |")
    lines.append("")
    for size, k in result.get("kld_ratios", {}).items():
        parts = [f"{name}: {k[d]['ratio_to_preset']:.2f} × {size.removesuffix('-mix')} + imatrix, "
                 f"{k[d]['ratio_to_best']:.2f} × the best preset of no more bytes ({k[d]['best_preset']})"
                 for d, name in domains if d in k]
        lines.append(f"- at {size}'s size ({'no larger' if k['no_larger'] else 'LARGER'}): " + "; ".join(parts))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a tools/size/bench_size_frontier.py JSON")
    print(table(json.loads(Path(ap.parse_args().result).read_text())))


if __name__ == "__main__":
    main()
