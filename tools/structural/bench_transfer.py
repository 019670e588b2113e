#!/usr/bin/env python
"""Does the gate's promise transfer to other text? SmolLM2-135M, one process.

Compresses the model with several calibration/gate settings (each on a fresh
deep copy of the one loaded model), then measures every output on the same
evaluation texts against the original model:

* ``embedded``  — the odd topics of Python's reference text (the offline default's evaluation);
* ``wiki-valid`` — odd-numbered documents of WikiText-2 ``valid.txt`` (the WikiText recipe's own evaluation);
* ``wiki-test`` — WikiText-2 ``test.txt`` (text none of the recipes saw).

Per output and text: relative perplexity change (± its paired standard error)
and mean KL(original ‖ compressed) in nats/token. Writes
``tools/structural/results/bench_transfer.json`` after each configuration.

Two modes (from the repo root)::

    # measure outputs that `compressor run` wrote (the rows the README quotes)
    python tools/structural/bench_transfer.py --outputs default=out/smollm2-135m-compressed \
        wikitext=out/smollm2-135m-prune
    # or compress in-process with the configurations below, then measure
    python tools/structural/bench_transfer.py --configs embedded mix

In ``--outputs`` mode each output is loaded with :func:`compressor.output.hf.load_compressed`
and its own gate text is read from its ``report.json``.

A third mode traces the *transfer curve* of a calibration source: ``prune`` with
fisher allocation, gated on the embedded text and on WikiText-2 test at once,
with a zero budget so that every bisection step fails and the search visits
fixed cuts (keep 65, 82.5, 91.25, 95.6, 97.8 % of the FFN parameters); at each
cut the change on the gate's text and on the unseen text::

    python tools/structural/bench_transfer.py --curves self mix    # ≈ 10 min per source, alone on the 2-core CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import (MODEL, WIKITEXT_DIR, environment, load_bench_model, paired_change, quiet_offline_env,
                            utc_now, wikitext, write_json)

quiet_offline_env()

import torch  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"

logger = logging.getLogger("bench_transfer")

OUTPUT = RESULTS_DIR / "bench_transfer.json"
CURVES_OUTPUT = RESULTS_DIR / "bench_transfer_curves.json"

# The offline recipe's settings (recipes/smollm2-135m.yaml), made cheaper only in the evaluation size.
BASE = {
    "model": {"source": MODEL},
    "calibration": {"seq_len": 128, "max_tokens": 8192, "batch_size": 16},
    "policy": {"threshold": 0.5, "ppl_budget": 0.05, "order": "swap_ppl", "patience": 6},
    "measure": {"cache": False},
    "output": {"path": "/nonexistent/bench"},
}


def configs(valid: str, test: str, eval_tokens: int) -> dict[str, dict]:
    ev = {"seq_len": 256, "stride": 256, "max_tokens": eval_tokens, "min_tokens": min(1024, eval_tokens)}
    return {
        # the old default: calibration and gate on the embedded text
        "embedded": {"calibration": {"dataset": "embedded"}, "evaluation": {"dataset": "embedded", **ev}},
        # the new default: half embedded, half self-generated; gate on embedded
        "mix": {"calibration": {"dataset": "mix"}, "evaluation": {"dataset": "embedded", **ev}},
        # calibrated and gated on WikiText-2 valid.txt (even / odd documents)
        "wikitext": {"calibration": {"dataset": valid}, "evaluation": {"dataset": valid, **ev}},
        # new default calibration, gate on two domains at once
        "mix+2domains": {"calibration": {"dataset": "mix"},
                         "evaluation": [{"dataset": "embedded", **ev}, {"dataset": valid, "name": "wiki-valid", **ev}]},
    }


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="*", default=["embedded", "mix", "wikitext"])
    ap.add_argument("--outputs", nargs="*", metavar="NAME=FOLDER",
                    help="measure these compressor outputs instead of compressing (--configs is then ignored)")
    ap.add_argument("--curves", nargs="*", metavar="CALIBRATION",
                    help="trace the transfer curve of these calibration sources (self, mix, embedded, a file)")
    ap.add_argument("--cal-tokens", type=int, default=16384, help="--curves: calibration tokens")
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=256, help="evaluation window (stride = window)")
    ap.add_argument("--output", default=str(OUTPUT))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")

    from compressor.evaluation.gate import Evaluator
    from compressor.inputs.calibration import build_calibration
    from compressor.inputs.data import TextSource, evaluation_tokens
    from compressor.policy.compress import compress_model
    from compressor.recipe import recipe_from_dict

    valid, test = wikitext("valid.txt"), wikitext("test.txt")
    if not valid.is_file() or not test.is_file():
        logger.error("WikiText-2 not found under %s", WIKITEXT_DIR)
        return 1
    model, tok, _, load_s = load_bench_model(MODEL)
    if args.curves:
        if args.output == str(OUTPUT):
            args.output = str(CURVES_OUTPUT)
        return _curves(args, model, tok, test, load_s)

    # The three texts every output is measured on, disjoint from every calibration used here.
    texts = {
        "embedded": evaluation_tokens(tok, TextSource("embedded"), None, max_tokens=args.eval_tokens),
        "wiki-valid": evaluation_tokens(tok, TextSource(str(valid)), TextSource(str(valid)), max_tokens=args.eval_tokens),
        "wiki-test": evaluation_tokens(tok, TextSource(str(test)), None, max_tokens=args.eval_tokens),
    }
    t0 = time.perf_counter()
    judge = Evaluator.build(model, texts, seq_len=args.seq_len, stride=args.seq_len, batch_size=8, top_k=64)
    teacher_s = time.perf_counter() - t0
    result = {
        "date": utc_now(), "model": MODEL,
        "environment": environment(), "eval_tokens": args.eval_tokens, "seq_len": args.seq_len, "load_s": load_s,
        "teacher_s": teacher_s,
        "baseline": {k: v.to_json() for k, v in judge.baseline.domains.items()}, "runs": {},
    }
    if args.outputs:
        return _measure_outputs(args, judge, result)
    own = {"embedded": "embedded", "mix": "embedded", "wikitext": "wiki-valid", "mix+2domains": "embedded"}
    for name in args.configs:
        recipe = recipe_from_dict(merge(BASE, configs(str(valid), str(test), args.eval_tokens)[name]))
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        cal, cal_info = build_calibration(recipe, m, tok, use_cache=False)
        cal_s = time.perf_counter() - t0
        streams = {e.domain_name(): texts["wiki-valid" if e.dataset == str(valid) else "embedded"]
                   for e in recipe.evaluation_domains()}
        t0 = time.perf_counter()
        res = compress_model(m, recipe, cal, streams)
        run_s = time.perf_counter() - t0
        row = _row(judge, judge(m, desc=f"judge {name}"))
        result["runs"][name] = {
            "recipe": {"calibration": recipe.calibration.model_dump(), "evaluation": recipe.to_dict()["evaluation"]},
            "own_text": own[name], "calibration": cal_info, "calibration_s": cal_s, "compress_s": run_s,
            "gate_passed": res.gate_passed, "gate_message": res.gate_message,
            "kept": [d.index for d in res.kept], "params_after": res.params_after, "params_before": res.params_before,
            "measured": row,
        }
        logger.info("%s: kept %s; %s", name, result["runs"][name]["kept"],
                    {t: f"{r['relative_delta']:+.2%} KL {r['kl']:.4f}" for t, r in row.items()})
        write_json(args.output, result)
        del m
    print(json.dumps({k: {t: round(r["relative_delta"], 4) for t, r in v["measured"].items()}
                      for k, v in result["runs"].items()}, indent=1))
    return 0


def _curves(args, model, tok, test, load_s: float) -> int:
    """Per calibration source: gate-text and unseen-text change at the cuts a failing bisection visits."""
    from compressor.inputs.calibration import build_calibration, evaluation_streams
    from compressor.policy.compress import compress_model
    from compressor.recipe import recipe_from_dict

    result = {"date": utc_now(), "model": MODEL,
              "environment": environment(), "load_s": load_s, "curves": {}}
    for cal_name in args.curves:
        recipe = recipe_from_dict({
            "model": {"source": MODEL},
            "calibration": {"dataset": cal_name, "seq_len": 128, "max_tokens": args.cal_tokens,
                            "heldout_fraction": 0.125, "batch_size": 16},
            "evaluation": [{"dataset": "embedded", "seq_len": 256, "stride": 256, "max_tokens": 4096},
                           {"dataset": str(test), "name": "wiki-test", "seq_len": 512, "stride": 512,
                            "max_tokens": 8192}],
            # budget 0: every step fails, so the bisection visits fixed cuts, the same for every source
            "policy": {"strategy": "allocate", "allocation": "fisher", "ppl_budget": 0.0, "max_backoff": 5},
            "replacement": {"kind": "prune"},
            "output": {"path": "/nonexistent/bench"},
        })
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        cal, cal_info = build_calibration(recipe, m, tok, use_cache=True)
        cal_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = compress_model(m, recipe, cal, evaluation_streams(recipe, tok))
        base = {n: ev.ppl for n, ev in res.baseline.domains.items()}
        points = [{"ffn_keep": a["ffn_params_kept"] / a["ffn_params_total"], "blocks_replaced": a["blocks_replaced"],
                   **{n: {"ppl": d["ppl"], "relative_delta": d["ppl"] / base[n] - 1, "kl": d["kl"]}
                      for n, d in a["domains"].items()}}
                  for a in res.attempts]
        for p in points:
            p["ratio_unseen_to_gate"] = p["wiki-test"]["relative_delta"] / max(p["embedded"]["relative_delta"], 1e-9)
            logger.info("%s keep %.1f%%: embedded %+.2f%% (KL %.4f), wiki-test %+.2f%% (KL %.4f)", cal_name,
                        100 * p["ffn_keep"], 100 * p["embedded"]["relative_delta"], p["embedded"]["kl"],
                        100 * p["wiki-test"]["relative_delta"], p["wiki-test"]["kl"])
        result["curves"][cal_name] = {"calibration": cal_info, "calibration_s": cal_s,
                                      "compress_s": time.perf_counter() - t0, "baseline": base, "points": points}
        write_json(args.output, result)
        del m
    return 0


def _row(judge, after) -> dict:
    row = {}
    for text, ev in after.domains.items():
        b = judge.baseline.domains[text]
        delta, se = paired_change(ev, b)
        row[text] = {"ppl_before": b.ppl, "ppl_after": ev.ppl, "relative_delta": delta,
                     "relative_delta_se": se, "kl": ev.kl, "kl_se": ev.kl_se}
    return row


def _measure_outputs(args, judge, result: dict) -> int:
    """Measure finished outputs on the three texts; the gate's own numbers come from report.json."""
    from pathlib import Path

    from compressor.output.hf import load_compressed

    for spec in args.outputs:
        name, _, folder = spec.partition("=")
        folder = Path(folder or name)
        report = json.loads((folder / "report.json").read_text())
        m = load_compressed(folder, dtype=torch.float32)
        m.eval()
        row = _row(judge, judge(m, desc=f"judge {name}"))
        ev = report.get("evaluation", {})
        result["runs"][name] = {
            "output": str(folder), "recipe": report.get("recipe"), "calibration": report.get("calibration"),
            "gate": {"evaluation": ev.get("domains", ev), "perplexity": report.get("perplexity")},
            "kept": [b["index"] for b in report.get("blocks", []) if b.get("decision") == "kept"],
            "params_before": report.get("params", {}).get("before"), "params_after": report.get("params", {}).get("after"),
            "measured": row,
        }
        logger.info("%s: %s", name, {t: f"{r['relative_delta']:+.2%} KL {r['kl']:.4f}" for t, r in row.items()})
        write_json(args.output, result)
        del m
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
