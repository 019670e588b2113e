#!/usr/bin/env python
"""Is a pruned model faster in proportion to the work it removed? (CPU, float32)

A SmolLM2-135M-shaped Llama built from its config (random weights: speed does
not depend on the values) against the same model with every FFN replaced by a
``prune`` module keeping a fraction of its hidden units, and by a ``hybrid``
module (plus the d×d bypass). Prefill of 1×512 tokens and greedy decoding of
64 tokens, median of repeated runs, interleaved so machine noise hits both;
compared with the ratio of multiply-adds in the forward pass.

    python tools/bench_speed.py                  # → tools/results/bench_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchlib import RESULTS_DIR, environment, quiet_offline_env

quiet_offline_env()

import torch  # noqa: E402
import transformers  # noqa: E402

from compressor.hf_modeling import HiddenUnitFFN  # noqa: E402


def smollm2_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, hidden_act="silu")


def replace_ffns(model, keep: float, bypass: bool) -> None:
    cfg = model.config
    k = int(round(keep * cfg.intermediate_size))
    for layer in model.model.layers:
        mod = HiddenUnitFFN(cfg.hidden_size, cfg.hidden_size, k, cfg.hidden_act, True, False, bypass)
        layer.mlp = mod.to(torch.float32)


def macs_per_token(model, seq: int) -> float:
    """Multiply-adds of the linear layers per token (attention scores excluded: unchanged by pruning)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


@torch.no_grad()
def timings(model, ids, reps: int) -> tuple[float, float]:
    model(input_ids=ids)
    pre = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model(input_ids=ids)
        pre.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out = model.generate(ids[:, :16], max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    dec = (out.shape[1] - 16) / (time.perf_counter() - t0)
    return statistics.median(pre), dec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.75, 0.5])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", default=str(RESULTS_DIR / "bench_speed.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(smollm2_config()).eval()
    ids = torch.randint(100, 40000, (1, 512), generator=torch.Generator().manual_seed(0))
    variants = {"original": base}
    for keep in args.keeps:
        for bypass in (False, True):
            torch.manual_seed(0)
            m = transformers.LlamaForCausalLM(smollm2_config()).eval()
            replace_ffns(m, keep, bypass)
            variants[f"{'hybrid' if bypass else 'prune'}@{keep}"] = m
    res = {name: {"prefill": [], "decode": []} for name in variants}
    for _ in range(args.rounds):  # interleaved rounds: noise hits every variant alike
        for name, m in variants.items():
            p, d = timings(m, ids, args.reps)
            res[name]["prefill"].append(p)
            res[name]["decode"].append(d)
    base_macs = macs_per_token(base, 512)
    out = {"schema": "compressor.bench_speed/v1", "environment": environment(), "args": vars(args), "variants": {}}
    for name, m in variants.items():
        pre, dec = statistics.median(res[name]["prefill"]), statistics.median(res[name]["decode"])
        macs = macs_per_token(m, 512)
        out["variants"][name] = {
            "params": sum(p.numel() for p in m.parameters()), "linear_macs_per_token": macs,
            "prefill_512_s": pre, "decode_tok_s": dec,
            "prefill_speedup": statistics.median(res["original"]["prefill"]) / pre,
            "macs_ratio": base_macs / macs,
        }
        v = out["variants"][name]
        print(f"{name:12s} prefill {pre * 1000:7.1f} ms  speed-up {v['prefill_speedup']:.3f}  "
              f"MAC ratio {v['macs_ratio']:.3f}  decode {dec:6.1f} tok/s")
    with open(args.output, "w") as f:
        json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
