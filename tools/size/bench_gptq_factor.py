"""GPTQ's factor of Ĥ in float32 against float64, on a model's own input moments: time and what it changes.

The size planner solves one factor per distinct layer input twice (pricing, then the plan's rounding; three times
with held-out prices, each half's fit): on Qwen2.5-1.5B the 8,960-wide down projection's were the largest. This
measures, on the moments of ``--layers`` (down projections, an attention output and an FFN input) over
``--tokens`` WikiText-2 valid tokens measured as the planner measures them (a bfloat16 autocast, float32 sums):

* the Cholesky's time in float64 and in float32 (``gridround.factor`` takes float32, float64 where float32 finds
  the damped Ĥ not positive definite), and whether float32 found one;
* GPTQ's output error ``Σ (ΔW Ĥ ΔWᵀ)_rr`` on ``--rows`` sampled rows of the layer's own weight in ``--types``,
  through each factor: the relative change float32 makes;
* the damped Ĥ's condition number.

    python tools/size/bench_gptq_factor.py --source /tmp/offgrid-qwen --alone \\
        --output tools/size/results/gptq_factor_offgrid_qwen2.5_coder_1.5b.json

Run it alone (the timings are a 2-core machine's).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import wikitext, write_json
from tools.benchlib.cli import add_alone, log_to_stderr, tool_parser
from tools.benchlib.machine import environment
from tools.benchlib.results import command_line, utc_now


def cholesky_seconds(h: torch.Tensor, dtype: torch.dtype, damp: float) -> tuple[float, bool]:
    a = h.to(dtype).clone()
    a.diagonal().add_(damp * float(h.diagonal().double().mean()))
    t0 = time.perf_counter()
    _, info = torch.linalg.cholesky_ex(a)
    return time.perf_counter() - t0, int(info) == 0


def main() -> None:
    ap = tool_parser(__doc__)
    ap.add_argument("--source", required=True, help="a Hugging Face folder (e.g. tools/size/offgrid.py's)")
    ap.add_argument("--layers", nargs="+", default=["model.layers.1.mlp.down_proj", "model.layers.3.mlp.down_proj",
                                                    "model.layers.14.mlp.down_proj", "model.layers.27.mlp.down_proj",
                                                    "model.layers.3.self_attn.o_proj", "model.layers.3.mlp.gate_proj"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=192)
    ap.add_argument("--types", nargs="+", default=["Q4_K", "IQ4_XS", "Q3_K"])
    ap.add_argument("--output", required=True)
    add_alone(ap)
    args = ap.parse_args()
    log_to_stderr()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compressor.core.ggml import GGMLType
    from compressor.engine.tensorstats import input_moments
    from compressor.fitting import gridround as gr

    tok = AutoTokenizer.from_pretrained(args.source)
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32)
    text = wikitext("valid.txt").read_text(encoding="utf-8")
    seq = 512
    ids = tok(text[: args.tokens * 12], return_tensors="pt").input_ids[0]
    n = min(len(ids), args.tokens) // seq
    ids = ids[: n * seq].view(n, seq)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moments = input_moments(model, ids, args.layers, batch_size=4)
    rows = {}
    for name in args.layers:
        h = moments[name]
        weight = model.get_submodule(name).weight.detach().float().numpy()
        pick = np.sort(np.random.default_rng(0).choice(weight.shape[0], min(args.rows, weight.shape[0]), replace=False))
        w = weight[pick]
        imatrix = np.diag(h.numpy()).astype(np.float32)
        t64, ok64 = cholesky_seconds(h, torch.float64, gr.DAMP)
        t32, ok32 = cholesky_seconds(h, torch.float32, gr.DAMP)
        t0 = time.perf_counter()
        f32 = gr.factor(h)  # float32 where it finds a factor, as the planner takes it
        factor_s = time.perf_counter() - t0
        f64 = gr.factor(h, dtype=torch.float64)
        hd = h.double().numpy()
        errors = {}
        for t in args.types:
            qt = GGMLType[t]
            e64 = gr.output_error(w, gr.dequantize(gr.gptq_quantize(w, f64, qt, imatrix), qt, w.shape), hd)
            e32 = gr.output_error(w, gr.dequantize(gr.gptq_quantize(w, f32, qt, imatrix), qt, w.shape), hd)
            errors[t] = {"float64_factor": e64, "float32_factor": e32, "relative_change": e32 / e64 - 1}
        ev = torch.linalg.eigvalsh(h.double())
        floor = gr.DAMP * float(h.diagonal().double().mean())
        rows[name] = {"width": int(h.shape[0]), "cholesky_float64_s": t64, "cholesky_float32_s": t32,
                      "float32_positive_definite": ok32, "float64_positive_definite": ok64,
                      "factor_s": factor_s, "damped_condition": float((ev[-1] + floor) / (ev[0].clamp(min=0) + floor)),
                      "r_max_abs_difference": float(np.abs(f32.r - f64.r).max()), "gptq_output_error": errors}
        print(name, {k: v for k, v in rows[name].items() if k != "gptq_output_error"},
              {t: round(e["relative_change"], 5) for t, e in errors.items()}, flush=True)
    write_json(args.output, {"what": __doc__.split("\n")[0], "source": args.source, "tokens": int(ids.numel()),
                             "rows": args.rows, "layers": rows, "ran_alone": bool(args.alone),
                             "when": utc_now(), "command": command_line(), "environment": environment()})


if __name__ == "__main__":
    main()
