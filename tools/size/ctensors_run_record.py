"""The record of one ``compressor run`` that planned a compressed-tensors size, for ``tools/size/results/``.

Reads the run's ``report.json`` (and, when given, the ``/usr/bin/time -v`` log the run was wrapped in) and
writes what the docs quote: the plan (units and layers per scheme, bytes, prediction), each gate domain's
measurement of the reloaded folder beside the uniform anchor's, the gate's rule, timings and peak memory.

    python tools/size/ctensors_run_record.py OUT/report.json tools/size/results/NAME.json --time-log run.err \\
        --command "how the run was started" --source "what the source folder is"
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path


def record(report: dict, time_log: str | None, command: str, source: str) -> dict:
    plan, check = report["size_plan"], report["verification"]["compressed-tensors"]
    units = Counter(row["type"] for row in plan["tensors"])
    head = next((row["type"] for row in plan["tensors"] if row["tensor"] == "lm_head"), None)
    measured = {}
    for d in check["domains"]:
        measured[d["name"]] = {
            "original_ppl": round(d["reference_perplexity"], 4),
            "plan": {"ppl_change": round(d["relative_change"], 4), "upper_bound": round(d["relative_delta_upper"], 4),
                     "kl_mean": round(d["kl_mean"], 4), "kl_p99": round(d["kl_p99"], 3),
                     "same_top": round(d["same_top_token"], 3)},
            f"uniform_{check['preset']['name']}": {
                "ppl_change": round(d["preset_relative_change"], 4), "kl_mean": round(d["preset_kl_mean"], 4),
                "kl_p99": round(d["preset_kl_p99"], 3), "same_top": round(d["preset_same_top_token"], 3)},
            "against_uniform": d.get("against_preset")}
    out = {"tool": command, "source": source, "recipe": report["recipe"], "exit_code": report["exit_code"],
           "budget_bytes": plan["budget_bytes"], "file_bytes": check["file_bytes"],
           "anchor_file_bytes": check["preset"]["file_bytes"],
           "plan": {"tensor_bytes": plan["tensor_bytes"], "predicted_ppl_change": round(plan["predicted_ppl_change"], 4),
                    "output_head": head, "units": dict(sorted(units.items())), "layers": check["schemes"]},
           "measured_reloaded_in_transformers": measured, "gate_rule": check.get("gate_rule"),
           "gate_passed": check.get("gate_passed"), "timings": {**report["timings"], **plan.get("timings", {})}}
    if time_log:
        text = Path(time_log).read_text(errors="replace")
        rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
        wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
        if rss:
            out["peak_rss_kb"] = int(rss.group(1))
        if wall:
            parts = [float(p) for p in wall.group(1).split(":")]
            out["wall_s"] = round(sum(p * 60 ** i for i, p in enumerate(reversed(parts))), 2)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report")
    p.add_argument("output")
    p.add_argument("--time-log", help="the /usr/bin/time -v log of the run (peak memory, wall time)")
    p.add_argument("--command", required=True, help="how the run was started, in words")
    p.add_argument("--source", required=True, help="what the source folder is")
    args = p.parse_args(argv)
    rec = record(json.loads(Path(args.report).read_text()), args.time_log, args.command, args.source)
    Path(args.output).write_text(json.dumps(rec, indent=2) + "\n")


if __name__ == "__main__":
    main()
