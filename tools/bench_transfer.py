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
``tools/results/bench_transfer.json`` after each configuration.

Usage (from the repo root)::

    python tools/bench_transfer.py                 # ≈ 10-15 min on the 2-core CPU
    python tools/bench_transfer.py --configs mix   # one row
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from datetime import datetime, timezone

from benchlib import MODEL, RESULTS_DIR, WIKITEXT_DIR, environment, quiet_offline_env

quiet_offline_env()

import torch  # noqa: E402

logger = logging.getLogger("bench_transfer")

OUTPUT = RESULTS_DIR / "bench_transfer.json"

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
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--output", default=str(OUTPUT))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")

    from compressor.compress import compress_model
    from compressor.data import TextSource, evaluation_tokens
    from compressor.evaluate import Evaluator
    from compressor.load import load_model
    from compressor.pipeline import _calibration
    from compressor.recipe import recipe_from_dict

    valid, test = (WIKITEXT_DIR / "valid.txt").resolve(), (WIKITEXT_DIR / "test.txt").resolve()
    if not valid.is_file() or not test.is_file():
        logger.error("WikiText-2 not found under %s", WIKITEXT_DIR)
        return 1
    t0 = time.perf_counter()
    model, tok, _ = load_model(MODEL)
    load_s = time.perf_counter() - t0

    # The three texts every output is measured on, disjoint from every calibration used here.
    texts = {
        "embedded": evaluation_tokens(tok, TextSource("embedded"), None, max_tokens=args.eval_tokens),
        "wiki-valid": evaluation_tokens(tok, TextSource(str(valid)), TextSource(str(valid)), max_tokens=args.eval_tokens),
        "wiki-test": evaluation_tokens(tok, TextSource(str(test)), None, max_tokens=args.eval_tokens),
    }
    t0 = time.perf_counter()
    judge = Evaluator.build(model, texts, seq_len=256, stride=256, batch_size=8, top_k=64)
    teacher_s = time.perf_counter() - t0
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": MODEL,
        "environment": environment(), "eval_tokens": args.eval_tokens, "load_s": load_s, "teacher_s": teacher_s,
        "baseline": {k: v.to_json() for k, v in judge.baseline.domains.items()}, "runs": {},
    }
    own = {"embedded": "embedded", "mix": "embedded", "wikitext": "wiki-valid", "mix+2domains": "embedded"}
    for name in args.configs:
        recipe = recipe_from_dict(merge(BASE, configs(str(valid), str(test), args.eval_tokens)[name]))
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        cal, cal_info = _calibration(recipe, m, tok, use_cache=False)
        cal_s = time.perf_counter() - t0
        streams = {e.domain_name(): texts["wiki-valid" if e.dataset == str(valid) else "embedded"]
                   for e in recipe.evaluation_domains()}
        t0 = time.perf_counter()
        res = compress_model(m, recipe, cal, streams)
        run_s = time.perf_counter() - t0
        after = judge(m, desc=f"judge {name}")
        row = {}
        for text, ev in after.domains.items():
            b = judge.baseline.domains[text]
            row[text] = {"ppl_before": b.ppl, "ppl_after": ev.ppl, "relative_delta": ev.ppl / b.ppl - 1,
                         "relative_delta_se": ev.nll_delta_se * ev.ppl / b.ppl, "kl": ev.kl, "kl_se": ev.kl_se}
        result["runs"][name] = {
            "recipe": {"calibration": recipe.calibration.model_dump(), "evaluation": recipe.to_dict()["evaluation"]},
            "own_text": own[name], "calibration": cal_info, "calibration_s": cal_s, "compress_s": run_s,
            "gate_passed": res.gate_passed, "gate_message": res.gate_message,
            "kept": [d.index for d in res.kept], "params_after": res.params_after, "params_before": res.params_before,
            "measured": row,
        }
        logger.info("%s: kept %s; %s", name, result["runs"][name]["kept"],
                    {t: f"{r['relative_delta']:+.2%} KL {r['kl']:.4f}" for t, r in row.items()})
        OUTPUT.parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
        del m
    print(json.dumps({k: {t: round(r["relative_delta"], 4) for t, r in v["measured"].items()}
                      for k, v in result["runs"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
