"""Would a narrower FFN enter a size plan? The marginal rates, measured.

A size plan spends bytes where they buy the most predicted loss. Removing FFN hidden units saves the
bytes of their gate and up rows and their down column, at the plan's types, and costs (closed form,
from the same statistics: the down projection's input moments Ĥ and its output loss weights F)

    ½ Σ_o F_o (W_S (Ĥ⁻¹_SS)⁻¹ W_Sᵀ)_oo     (units S removed, the down projection re-solved by least squares)

— the optimal-brain-surgeon cost of the prune kind. Quantization's marginal rate at a plan is the
cheapest predicted loss per byte saved by moving any one tensor to its next smaller type. Pruning
enters a plan only where its rate (loss per byte saved) is below quantization's.

The same comparison for R²_lin's own option, the whole FFN replaced by its least-squares affine map (or a
reduced-rank one), fitted on the calibration windows and scored on held-out windows of the same text:

    ½ Σ_o F_o · SSE_o / n     (SSE_o: the held-out squared residual of output o; F at the block's output)

with the map stored in Q8_0 and its own rounding error not counted — an optimistic rate for structure: if
even it loses to quantization's, the option cannot enter a plan.

    python tools/size/bench_structural_rates.py --model /tmp/offgrid-smollm2 --sizes Q4_K_M Q3_K_M Q2_K 2.5bpw \\
        --presets-from /tmp/fr-smol --output tools/size/results/structural_rates_offgrid_smollm2.json --alone

``--presets-from``: the work folder of ``tools/size/bench_size_frontier.py`` (its preset files give the
byte budgets; a size in bits per weight, ``2.5bpw``, needs only its F16). Run it alone.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import load_bench_model, wikitext, write_json
from tools.benchlib.cli import add_alone, add_model, tool_parser
from tools.benchlib.planner import planner_statistics


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


def affine_costs(model, fit: torch.Tensor, heldout: torch.Tensor, fisher, ranks: list[int]) -> dict[int, dict]:
    """Per FFN block: predicted loss of replacing it by its least-squares affine map (key None) and by the
    reduced-rank maps of ``ranks``, ``½ Σ_o F_o SSE_o / n`` on the held-out windows."""
    from compressor.engine.measure import collect
    from compressor.fitting.solve import low_rank, solve_affine

    stats = collect(model, fit, heldout, batch_size=4)
    out = {}
    for i, st in sorted(stats.items()):
        f = fisher.grad_sq[f"model.layers.{i}.mlp.down_proj"].double()
        held = st.heldout_total()
        full = solve_affine(st.fit)
        costs = {None: 0.5 * float((f * held.sse(full.W, full.b)).sum()) / held.n}
        for r in ranks:
            lr = low_rank(full, st.fit, r)
            costs[r] = 0.5 * float((f * held.sse(lr.W, lr.b)).sum()) / held.n
        out[i] = costs
    return out


def ffn_bytes(model, choice: dict[str, str], i: int) -> int:
    """Bytes of block ``i``'s FFN weights at the plan's types."""
    from compressor.core.ggml import GGMLType, bytes_per_row

    d, ff = model.config.hidden_size, model.config.intermediate_size
    return sum(rows * bytes_per_row(GGMLType[choice[f"blk.{i}.ffn_{r}.weight"]], width)
               for r, rows, width in (("gate", ff, d), ("up", ff, d), ("down", d, ff)))


def affine_bytes(model, rank: int | None) -> int:
    """Bytes of an FFN's affine map (``rank`` None) or reduced-rank map: its weights in Q8_0, its bias in float32."""
    from compressor.core.ggml import GGMLType, bits_per_weight
    from compressor.fitting.solve import affine_params

    d = model.config.hidden_size
    weights = affine_params(d, d, rank) - d  # less the bias
    return int(weights * bits_per_weight(GGMLType.Q8_0) / 8) + 4 * d


def size_budget(size: str, presets: Path, model, layout) -> int:
    """File bytes of ``size``: a preset's file in the frontier's work folder, or bits per weight (``2.5bpw``)
    over every weight the model stores plus the F16's header, as ``output.size`` reads it."""
    from compressor.sizing.budget import bpw_bytes
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
    ap.add_argument("--heldout-windows", type=int, default=8,
                    help="windows after the calibration's that score the affine maps")
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--output", required=True)
    add_alone(ap)
    args = ap.parse_args()

    from compressor.core.ggml import GGMLType, bits_per_weight, bytes_per_row
    from compressor.output.gguf.budget import read_layout
    from compressor.sizing.plan import Priced, plan
    from compressor.output.gguf.pricing import price_all

    t0 = time.perf_counter()
    model, tok, _, _ = load_bench_model(args.model, dtype="float32")
    text = wikitext("valid.txt").read_text(encoding="utf-8")[:240_000]
    all_ids = tok(text).input_ids
    ids = torch.tensor(all_ids[: args.cal_windows * 512]).reshape(args.cal_windows, 512)
    held = torch.tensor(all_ids[args.cal_windows * 512:(args.cal_windows + args.heldout_windows) * 512])
    held = held.reshape(args.heldout_windows, 512)
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
    maps = affine_costs(model, ids, held, fisher, args.ranks)
    rows = []
    for size in args.sizes:
        budget = size_budget(size, Path(args.presets_from), model, layout)
        p = plan(units, priced, budget - overhead)
        choice = {r["tensor"]: r["type"] for r in p.rows}
        if p.tensor_bytes > budget - overhead:  # below every tensor's smallest type: only structure gets there
            smallest_map = min([None, *args.ranks], key=lambda r: affine_bytes(model, r))
            saved = sum(ffn_bytes(model, choice, i) - affine_bytes(model, smallest_map) for i in range(layers))
            rows.append({"size": size, "budget_bytes": budget, "below_quantization_floor": True,
                         "floor_file_bytes": p.tensor_bytes + overhead, "types_used": p.to_json()["types_used"],
                         "every_ffn_replaced_saves_bytes": saved, "every_ffn_replaced_rank": smallest_map,
                         "every_ffn_replaced_predicted_nll": sum(maps[i][smallest_map] for i in range(layers)),
                         "reachable_by_replacing_every_ffn": p.tensor_bytes + overhead - saved <= budget})
            print(f"{size}: {budget:,} bytes is below the smallest file quantization makes "
                  f"({p.tensor_bytes + overhead:,}); replacing every FFN by a low-rank map saves {saved:,.0f}")
            continue
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
        per_map = []
        for i in range(layers):
            for rank, cost in maps[i].items():
                saved = ffn_bytes(model, choice, i) - affine_bytes(model, rank)
                per_map.append({"layer": i, "rank": rank, "bytes_saved": saved, "predicted_cost": cost,
                                "rate": cost / saved if saved > 0 else float("inf")})
        best_map = min(per_map, key=lambda r: r["rate"])
        rows.append({"size": size, "budget_bytes": budget, "plan_predicted_nll": p.predicted_nll_increase,
                     "types_used": p.to_json()["types_used"],
                     "quant_marginal_rate": q_rates[0][0], "quant_marginal_step": q_rates[0][1:],
                     "quant_rates_p10": q_rates[: max(1, len(q_rates) // 10)][-1][0],
                     "best_prune": best_prune,
                     "prune_cheaper_than_quant": best_prune["rate"] < q_rates[0][0],
                     "prune_rate_over_quant_rate": best_prune["rate"] / max(q_rates[0][0], 1e-30),
                     "prune": per_layer,
                     "best_affine": best_map,
                     "affine_cheaper_than_quant": best_map["rate"] < q_rates[0][0],
                     "affine_rate_over_quant_rate": best_map["rate"] / max(q_rates[0][0], 1e-30),
                     "affine": per_map})
        print(f"{size}: quantization's marginal rate {q_rates[0][0]:.3e} nats/byte; cheapest prune "
              f"(layer {best_prune['layer']}, {best_prune['units_removed']} units) {best_prune['rate']:.3e}; cheapest "
              f"affine map (layer {best_map['layer']}, rank {best_map['rank'] or 'full'}) {best_map['rate']:.3e}")
    write_json(args.output, {
        "model": args.model, "calibration": f"WikiText-2 valid, {args.cal_windows} windows of 512",
        "what": "predicted loss per byte saved: quantization's cheapest next step at each plan vs removing FFN "
                "hidden units (OBS, down projection re-solved) at the plan's types, and vs replacing a whole FFN "
                "by its least-squares affine or reduced-rank map (held-out residual, map in Q8_0, its rounding "
                "not counted)",
        "heldout": f"the next {args.heldout_windows} windows of 512 of WikiText-2 valid", "ran_alone": bool(args.alone),
        "seconds": time.perf_counter() - t0, "sizes": rows})


if __name__ == "__main__":
    main()
