"""Block-wise error-compensating rounding against ggml's nearest rounding, in every codebook i-quant, at the same bytes.

For a few 256-multiple-wide tensors of a real model (SmolLM2-135M's 1,536-wide FFN down projections: its other
rows are 576 wide and take no 256-block type), Ĥ is measured on WikiText-2 valid text, and each IQ type's bytes
are made three ways from the same importance matrix ``diag Ĥ``: ggml's own rounding (what llama-quantize with an
imatrix writes), and :func:`compressor.fitting.gridround.blockwise_quantize` handing ggml the importance matrix or
the block's conditioned weights (``BLOCK_WEIGHTS``). The score is the Ĥ-weighted output error
``tr(ΔW Ĥ ΔWᵀ)``: in-sample (the rounding fitted to and scored on the same Ĥ) and held out (fitted to the Ĥ of the
odd windows, scored on the even ones' — what pricing's cross-fitting does). Every error is of the bytes decoded
by gguf-py. A few minutes on two cores.

    python tools/size/bench_blockwise_iquant.py --output tools/size/results/blockwise_iquant_smollm2.json
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import numpy as np

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import load_bench_model, wikitext, write_json
from tools.benchlib.cli import add_alone, add_model, log_to_stderr, tool_parser

logger = logging.getLogger("bench_blockwise_iquant")

TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")


def main() -> None:
    ap = tool_parser(__doc__)
    add_model(ap)
    ap.add_argument("--layers", default="0,10,20", help="the layers whose FFN down projection is measured")
    ap.add_argument("--rows", type=int, default=256, help="rows of each tensor (its first), 0: all")
    ap.add_argument("--windows", type=int, default=16, help="windows of 512 tokens of WikiText-2 valid")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--output", required=True)
    add_alone(ap)
    args = ap.parse_args()
    log_to_stderr()
    import torch

    from compressor.core.ggml import GGMLType, dequantize, quantize
    from compressor.engine.tensorstats import input_moments
    from compressor.fitting import gridround as gr
    from compressor.sizing.sites import _imatrix

    t_start = time.perf_counter()
    model, tok, _, _ = load_bench_model(args.model, dtype="float32")
    text = wikitext("valid.txt").read_text(encoding="utf-8")
    ids = torch.tensor(tok(text[: 40 * 512 * args.windows]).input_ids[: 512 * args.windows]).reshape(-1, 512)
    names = [f"model.layers.{int(i)}.mlp.down_proj" for i in args.layers.split(",")]
    both = input_moments(model, ids, names, batch_size=4)
    halves = [input_moments(model, ids[k::2], names, batch_size=4) for k in (0, 1)]
    types = [GGMLType[t] for t in args.types.split(",")]
    rows_out, timings = [], {"nearest_s": 0.0, "blockwise_s": 0.0}
    for name in names:
        w = model.get_submodule(name).weight.detach().float().numpy()
        w = np.ascontiguousarray(w[: args.rows] if args.rows else w)
        h, fit, score = (both[name].double().numpy(), halves[1][name].double().numpy(),
                         halves[0][name].double().numpy())
        im = _imatrix(torch.from_numpy(np.diag(h).copy()))
        im_fit = _imatrix(torch.from_numpy(np.diag(fit).copy()))
        f_all, f_fit = gr.blockwise_factor(h.astype(np.float32)), gr.blockwise_factor(fit.astype(np.float32))
        for t in types:
            n = w.shape[1]
            t0 = time.perf_counter()
            near, near_fit = quantize(w, t, im), quantize(w, t, im_fit)
            timings["nearest_s"] += time.perf_counter() - t0
            err = {"nearest": gr.output_error(w, dequantize(near, t, n), h),
                   "nearest_held_out": gr.output_error(w, dequantize(near_fit, t, n), score)}
            for weights in ("imatrix", "conditioned"):
                t0 = time.perf_counter()
                raw = gr.blockwise_quantize(w, f_all, t, im, weights=weights)
                raw_fit = gr.blockwise_quantize(w, f_fit, t, im_fit, weights=weights)
                timings["blockwise_s"] += time.perf_counter() - t0
                assert raw.shape == near.shape  # the same bytes
                err[f"blockwise_{weights}"] = gr.output_error(w, dequantize(raw, t, n), h)
                err[f"blockwise_{weights}_held_out"] = gr.output_error(w, dequantize(raw_fit, t, n), score)
            row = {"tensor": name, "type": t.name, "shape": list(w.shape), "bytes": int(near.nbytes), **err,
                   **{f"ratio_{k}": err[f"blockwise_{k}"] / err["nearest"] for k in ("imatrix", "conditioned")},
                   **{f"ratio_{k}_held_out": err[f"blockwise_{k}_held_out"] / err["nearest_held_out"]
                      for k in ("imatrix", "conditioned")}}
            rows_out.append(row)
            logger.info("%s %s: block-wise/nearest %.3f (imatrix) %.3f (conditioned); held out %.3f / %.3f",
                        name, t.name, row["ratio_imatrix"], row["ratio_conditioned"],
                        row["ratio_imatrix_held_out"], row["ratio_conditioned_held_out"])
    summary = {}
    for t in types:
        mine = [r for r in rows_out if r["type"] == t.name]
        summary[t.name] = {k: float(np.exp(np.mean(np.log([r[k] for r in mine]))))
                           for k in ("ratio_imatrix", "ratio_conditioned", "ratio_imatrix_held_out",
                                     "ratio_conditioned_held_out")}
    write_json(args.output, {
        "model": args.model, "tensors": names, "rows": args.rows or "all",
        "calibration": f"{ids.numel()} tokens of WikiText-2 valid ({ids.shape[0]} windows of 512); held out: fitted "
                       "to the odd windows' Ĥ, scored on the even windows'",
        "metric": "tr(ΔW Ĥ ΔWᵀ) of gguf-py's decoding; ratio = block-wise / ggml's nearest (same type, same bytes, "
                  "same importance matrix diag Ĥ)",
        "block_weights_default": gr.BLOCK_WEIGHTS, "seconds": time.perf_counter() - t_start, **timings,
        "ran_alone": bool(args.alone), "geomean_by_type": summary, "results": rows_out})
    for t, s in summary.items():
        print(f"{t:8s} " + "  ".join(f"{k.removeprefix('ratio_')} {v:.3f}" for k, v in s.items()))


if __name__ == "__main__":
    main()
