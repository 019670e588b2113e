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

    python tools/structural/diagnose_fisher.py /root/.cache/compressor-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --selfcal ~/.cache/compressor/selfcal/<entry>.safetensors --blocks 0 5 6 12 18 24 27 \\
        --json tools/structural/results/fisher_diagnosis_qwen2.5_coder_1.5b.json
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import quiet_offline_env, write_json
from tools.benchlib.cli import tool_parser
from tools.benchlib.machine import environment

RESULTS_DIR = Path(__file__).resolve().parent / "results"

PREDICTORS = ("factorized", "paired_diag", "paired_full")


def parse_args():
    ap = tool_parser(__doc__)
    ap.add_argument("model", help="a .gguf file, folder or pkg:NAME")
    ap.add_argument("--selfcal", required=True, help="a self-calibration cache entry (.safetensors with 'ids')")
    ap.add_argument("--blocks", type=int, nargs="+", required=True)
    ap.add_argument("--units", type=int, default=256, help="hidden units removed per block")
    ap.add_argument("--windows", type=int, default=16, help="calibration windows (gradients, and the first KL)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--gate-windows", type=int, default=8, help="windows of 256 tokens of the gate's text")
    ap.add_argument("--slice", type=int, default=4, help="windows per forward + backward")
    ap.add_argument("--json", default=str(RESULTS_DIR / "fisher_diagnosis.json"))
    return ap.parse_args()


def texts(args, tok):
    """The calibration windows (the self-written text) and the gate's text in windows of 256."""
    import torch
    from safetensors.torch import load_file

    from compressor.inputs.data import _embedded_documents

    ids = load_file(args.selfcal)["ids"]
    cal = ids[: args.windows * args.seq_len].view(args.windows, args.seq_len)
    text = "\n\n".join(_embedded_documents("evaluation"))
    gate_ids = tok(text, add_special_tokens=False)["input_ids"][: args.gate_windows * 256]
    return cal, torch.tensor(gate_ids).view(args.gate_windows, 256)


class GradientRows:
    """While open, per block and every token: the hidden units ``h`` (the down projection's input) of the
    ``blocks`` asked for, and the loss gradient ``g`` and the sum of ``y²`` at every block's output."""

    def __init__(self, layers, blocks) -> None:
        self.h = {i: [] for i in blocks}
        self.g = {i: [] for i in range(len(layers))}
        self.y_sq = {}
        self.layers, self.blocks = layers, blocks

    def _keep_h(self, i):
        def hook(module, inp, out):
            self.h[i].append(inp[0].detach().reshape(-1, inp[0].shape[-1]).double())
        return hook

    def _keep_g(self, i):
        def hook(module, inp, out):
            y = out.detach().reshape(-1, out.shape[-1]).double()
            self.y_sq[i] = self.y_sq.get(i, 0) + y.pow(2).sum(0)
            out.register_hook(lambda g: self.g[i].append(g.detach().reshape(-1, g.shape[-1]).double()))
        return hook

    @contextmanager
    def hooked(self):
        hooks = []
        try:
            for i, layer in enumerate(self.layers):
                hooks.append(layer.mlp.register_forward_hook(self._keep_g(i)))
                if i in self.blocks:
                    hooks.append(layer.mlp.down_proj.register_forward_hook(self._keep_h(i)))
            yield self
        finally:
            for h in hooks:
                h.remove()


def gradient_pass(model, cal, blocks, slice_: int) -> tuple[GradientRows, float]:
    """One forward + backward over the calibration windows, ``slice_`` at a time; the rows and its seconds."""
    import torch.nn.functional as F

    rows = GradientRows(model.model.layers, blocks)
    t0 = time.perf_counter()
    with rows.hooked():
        for b in range(0, cal.shape[0], slice_):
            w = cal[b:b + slice_]
            logits = model(input_ids=w, use_cache=False).logits[:, :-1]
            # the sum over tokens / the whole batch's count: the per-token loss the gradient pass takes
            loss = (F.cross_entropy(logits.float().transpose(1, 2), w[:, 1:], reduction="sum")
                    / (cal.shape[0] * (cal.shape[1] - 1)))
            loss.backward()
            model.zero_grad(set_to_none=True)
    return rows, time.perf_counter() - t0


def log_probs(model, w, slice_: int) -> list:
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        return [F.log_softmax(model(input_ids=w[b:b + slice_], use_cache=False).logits.float(), dim=-1)
                for b in range(0, w.shape[0], slice_)]


def kl(model, base: list, w, slice_: int) -> float:
    """Mean KL(original ‖ now) per token over ``w``; ``base``: the original's log-probabilities."""
    new = log_probs(model, w, slice_)
    tot = sum(float((p.exp() * (p - q)).sum()) for p, q in zip(base, new))
    return tot / sum(p.shape[0] * p.shape[1] for p in base)


def predictions(down, rows: GradientRows, i: int, units: int, tokens: int):
    """The units removed (smallest ``‖W_down[:, j]‖ · rms(h_j)``), and the row of predicted costs."""
    import torch

    w_down = down.weight.detach().double()
    h = torch.cat(rows.h[i])
    g = torch.cat(rows.g[i])  # one gradient per slice, in slice order, as the h rows
    score = w_down.norm(dim=0) * h.pow(2).mean(0).sqrt()
    removed = torch.topk(score, units, largest=False).indices
    e = -(h[:, removed] @ w_down[:, removed].T)  # the output change when the units are removed
    m = g.pow(2).mean(0)
    ey = rows.y_sq[i] / tokens
    rel = float(e.pow(2).sum() / (ey.sum() * tokens))
    return removed, {"block": i, "units_removed": units, "relative_error": rel,
                     "factorized": float((m * ey).sum()) * rel,
                     "paired_diag": float((g.pow(2) * e.pow(2)).sum(1).mean()),
                     "paired_full": float((g * e).sum(1).pow(2).mean()),
                     # the change in the calibration loss, to first order
                     "first_order_loss_change": float((g * e).sum(1).sum())}


def measured_kl(model, down, removed, args, windows: dict, base: dict) -> dict:
    """KL on each text with the units' down-projection columns zeroed, then the weights restored."""
    import torch

    saved = down.weight.detach().clone()
    with torch.no_grad():
        down.weight[:, removed] = 0
    out = {"kl_calibration": kl(model, base["calibration"], windows["calibration"], args.slice),
           "kl_gate_text": kl(model, base["gate"], windows["gate"], args.slice)}
    with torch.no_grad():
        down.weight.copy_(saved)
    return out


def block_row(model, rows: GradientRows, i: int, args, windows: dict, base: dict) -> dict:
    down = model.model.layers[i].mlp.down_proj
    removed, row = predictions(down, rows, i, args.units, windows["calibration"].numel())
    row.update(measured_kl(model, down, removed, args, windows, base))
    for name in PREDICTORS:
        for text, value in (("calibration", row["kl_calibration"]), ("gate", row["kl_gate_text"])):
            row[f"kl_{text}_over_{name}"] = value / row[name] if row[name] > 0 else math.nan
    print(f"block {i:2d}: rel {row['relative_error']:.2e}  KL cal {row['kl_calibration']:.2e} "
          f"gate {row['kl_gate_text']:.2e}  KL/prediction, cal | gate: "
          + "  ".join(f"{k} {row[f'kl_calibration_over_{k}']:.3g} | {row[f'kl_gate_over_{k}']:.3g}"
                      for k in PREDICTORS), flush=True)
    return row


def spread(rows: list[dict], name: str, text: str = "gate") -> float:
    r = [row[f"kl_{text}_over_{name}"] for row in rows]
    return max(r) / min(r)


def main() -> None:
    args = parse_args()
    quiet_offline_env()
    from tools.benchlib.models import load_bench_model

    t_start = time.perf_counter()
    model, tok, src, load_s = load_bench_model(args.model, dtype="float32")
    model.eval()
    cal, gate = texts(args, tok)
    grad_rows, grad_s = gradient_pass(model, cal, args.blocks, args.slice)
    windows = {"calibration": cal, "gate": gate}
    base = {name: log_probs(model, w, args.slice) for name, w in windows.items()}
    rows = [block_row(model, grad_rows, i, args, windows, base) for i in args.blocks]
    write_json(args.json, {
        "what": "per block: remove the same hidden units (smallest ||W_down[:,j]||·rms(h_j), no re-solve), measure the KL "
                "from the original on the calibration windows and on the gate's text, and compare with three "
                "loss-gradient predictions of that cost (see the tool's docstring)",
        "model": src.describe(), "selfcal": args.selfcal, "calibration_tokens": cal.numel(),
        "gate_text_tokens": int(gate.numel()), "rows": rows,
        "max_over_min_of_kl_gate_over": {k: spread(rows, k) for k in PREDICTORS},
        "max_over_min_of_kl_calibration_over": {k: spread(rows, k, "calibration") for k in PREDICTORS},
        "seconds": {"load": load_s, "gradients": grad_s, "total": time.perf_counter() - t_start},
        "run_alone": True, "environment": environment(),
    })


if __name__ == "__main__":
    main()
