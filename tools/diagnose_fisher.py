#!/usr/bin/env python
"""Does the fisher allocation weight predict what a block's error costs? Measured per block.

``policy.allocation: fisher`` prices a block's error as ``Σ_o E[g_o²] · E[e_o²]``
(``g``: the loss gradient at the block's output, ``e``: the output error; the
two averaged over tokens *separately*, and ``E[e_o²]`` taken as the block's
relative error times ``E[y_o²]``). Tokens where the loss is sensitive and tokens
where the error lands need not be the same ones. This tool removes the same
units of one block at a time (the 256 with the smallest
``‖W_down[:, j]‖ · rms(h_j)``, no re-solve, so the error is exactly the removed
units' contribution) and puts the measured cost — the KL divergence of the
model's next-token distribution from the original's, per token — next to:

* ``factorized``: the allocation's weight × the relative error (what the product uses);
* ``paired_diag``: ``E_t[Σ_o g_to² e_to²]`` (the same diagonal Fisher, paired per token);
* ``paired_full``: ``E_t[(g_t · e_t)²]`` (the per-token empirical Fisher);

on the calibration text the gradients were taken on (the model's self-written
text from the compressor cache) and on the gate's text (Python's reference
topics, the evaluation half). A predictor is good when ``KL / prediction`` is
about the same for every block.

    python tools/diagnose_fisher.py /root/.cache/compressor-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --selfcal ~/.cache/compressor/selfcal/<entry>.safetensors --blocks 0 5 6 12 18 24 27 \\
        --json tools/results/fisher_diagnosis_qwen2.5_coder_1.5b.json
"""

from __future__ import annotations

import argparse
import math
import time

from benchlib import RESULTS_DIR, quiet_offline_env, write_json
from benchlib.machine import environment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a .gguf file, folder or pkg:NAME")
    ap.add_argument("--selfcal", required=True, help="a self-calibration cache entry (.safetensors with 'ids')")
    ap.add_argument("--blocks", type=int, nargs="+", required=True)
    ap.add_argument("--units", type=int, default=256, help="hidden units removed per block")
    ap.add_argument("--windows", type=int, default=16, help="calibration windows (gradients, and the first KL)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--gate-windows", type=int, default=8, help="windows of 256 tokens of the gate's text")
    ap.add_argument("--slice", type=int, default=4, help="windows per forward + backward")
    ap.add_argument("--json", default=str(RESULTS_DIR / "fisher_diagnosis.json"))
    args = ap.parse_args()
    quiet_offline_env()

    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from benchlib.models import load_bench_model
    from compressor.inputs.data import _embedded_documents

    t_start = time.perf_counter()
    model, tok, src, load_s = load_bench_model(args.model, dtype="float32")
    model.eval()
    layers = model.model.layers
    ids = load_file(args.selfcal)["ids"]
    n = args.windows * args.seq_len
    cal = ids[:n].view(args.windows, args.seq_len)
    text = "\n\n".join(_embedded_documents("evaluation"))
    gate_ids = tok(text, add_special_tokens=False)["input_ids"][: args.gate_windows * 256]
    gate = torch.tensor(gate_ids).view(args.gate_windows, 256)

    # One forward + backward over the calibration windows: per block, the hidden units h (the down
    # projection's input) and the loss gradient g at the block output, every token.
    h_rows: dict[int, list] = {i: [] for i in args.blocks}
    g_rows: dict[int, list] = {i: [] for i in range(len(layers))}
    y_sq: dict[int, torch.Tensor] = {}
    hooks = []

    def keep_h(i):
        def hook(module, inp, out):
            h_rows[i].append(inp[0].detach().reshape(-1, inp[0].shape[-1]).double())
        return hook

    def keep_g(i):
        def hook(module, inp, out):
            y = out.detach().reshape(-1, out.shape[-1]).double()
            y_sq[i] = y_sq.get(i, 0) + y.pow(2).sum(0)
            out.register_hook(lambda g: g_rows[i].append(g.detach().reshape(-1, g.shape[-1]).double()))
        return hook

    for i, layer in enumerate(layers):
        hooks.append(layer.mlp.register_forward_hook(keep_g(i)))
        if i in args.blocks:
            hooks.append(layer.mlp.down_proj.register_forward_hook(keep_h(i)))
    t0 = time.perf_counter()
    for b in range(0, cal.shape[0], args.slice):
        w = cal[b:b + args.slice]
        logits = model(input_ids=w, use_cache=False).logits[:, :-1]
        # the sum over tokens / the whole batch's count: the per-token loss the gradient pass takes
        loss = F.cross_entropy(logits.float().transpose(1, 2), w[:, 1:], reduction="sum") / (cal.shape[0] * (args.seq_len - 1))
        loss.backward()
        model.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    grad_s = time.perf_counter() - t0
    tokens = cal.numel()

    @torch.no_grad()
    def log_probs(w: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for b in range(0, w.shape[0], args.slice):
            out.append(F.log_softmax(model(input_ids=w[b:b + args.slice], use_cache=False).logits.float(), dim=-1))
        return out

    def kl(base: list[torch.Tensor], w: torch.Tensor) -> float:
        new = log_probs(w)
        tot = sum(float((p.exp() * (p - q)).sum()) for p, q in zip(base, new))
        return tot / sum(p.shape[0] * p.shape[1] for p in base)

    base_cal, base_gate = log_probs(cal), log_probs(gate)
    rows = []
    for i in args.blocks:
        down = layers[i].mlp.down_proj
        w_down = down.weight.detach().double()
        h = torch.cat(h_rows[i])
        g = torch.cat(g_rows[i])  # one gradient per slice, in slice order, as the h rows
        score = w_down.norm(dim=0) * h.pow(2).mean(0).sqrt()
        removed = torch.topk(score, args.units, largest=False).indices
        e = -(h[:, removed] @ w_down[:, removed].T)  # the output change when the units are removed
        m = g.pow(2).mean(0)
        ey = y_sq[i] / tokens
        rel = float(e.pow(2).sum() / (ey.sum() * tokens))
        factorized = float((m * ey).sum()) * rel
        paired_diag = float((g.pow(2) * e.pow(2)).sum(1).mean())
        paired_full = float((g * e).sum(1).pow(2).mean())
        first_order = float((g * e).sum(1).sum())  # the change in the calibration loss, to first order
        saved = down.weight.detach().clone()
        with torch.no_grad():
            down.weight[:, removed] = 0
        kl_cal, kl_gate = kl(base_cal, cal), kl(base_gate, gate)
        with torch.no_grad():
            down.weight.copy_(saved)
        row = {"block": i, "units_removed": args.units, "relative_error": rel, "factorized": factorized,
               "paired_diag": paired_diag, "paired_full": paired_full, "first_order_loss_change": first_order,
               "kl_calibration": kl_cal, "kl_gate_text": kl_gate}
        for name in ("factorized", "paired_diag", "paired_full"):
            for text, value in (("calibration", kl_cal), ("gate", kl_gate)):
                row[f"kl_{text}_over_{name}"] = value / row[name] if row[name] > 0 else math.nan
        rows.append(row)
        print(f"block {i:2d}: rel {rel:.2e}  KL cal {kl_cal:.2e} gate {kl_gate:.2e}  KL/prediction, cal | gate: "
              + "  ".join(f"{k} {row[f'kl_calibration_over_{k}']:.3g} | {row[f'kl_gate_over_{k}']:.3g}"
                          for k in ("factorized", "paired_diag", "paired_full")), flush=True)

    def spread(name: str, text: str = "gate") -> float:
        r = [row[f"kl_{text}_over_{name}"] for row in rows]
        return max(r) / min(r)

    write_json(args.json, {
        "what": "per block: remove the same hidden units (smallest ||W_down[:,j]||·rms(h_j), no re-solve), measure the KL "
                "from the original on the calibration windows and on the gate's text, and compare with three "
                "loss-gradient predictions of that cost (see the tool's docstring)",
        "model": src.describe(), "selfcal": args.selfcal, "calibration_tokens": tokens,
        "gate_text_tokens": int(gate.numel()), "rows": rows,
        "max_over_min_of_kl_gate_over": {k: spread(k) for k in ("factorized", "paired_diag", "paired_full")},
        "max_over_min_of_kl_calibration_over": {k: spread(k, "calibration")
                                                for k in ("factorized", "paired_diag", "paired_full")},
        "seconds": {"load": load_s, "gradients": grad_s, "total": time.perf_counter() - t_start},
        "run_alone": True, "environment": environment(),
    })


if __name__ == "__main__":
    main()
