#!/usr/bin/env python
"""Is a pruned model faster in proportion to the work it removed? (CPU, float32)

A SmolLM2-135M-shaped Llama built from its config (random weights: speed does
not depend on the values) against the same model with every FFN replaced by a
``prune`` module keeping a fraction of its hidden units, and by a ``hybrid``
module (plus the d×d bypass). Prefill of 1×512 tokens and greedy decoding of
64 tokens, median of repeated runs, interleaved so machine noise hits both;
compared with the ratio of multiply-adds in the forward pass.

    python tools/speed/bench_speed.py                  # → tools/speed/results/bench_speed.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import environment, interleaved, prefill_decode, quiet_offline_env, ratio_of_medians, write_json

quiet_offline_env()

import torch  # noqa: E402
import transformers  # noqa: E402

from compressor.core.modeling import HiddenUnitFFN  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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
    # interleaved rounds: noise hits every variant alike; per round the median prefill of --reps runs
    rounds = interleaved(variants, lambda m: prefill_decode(m, ids, args.reps), args.rounds)
    res = {name: {"prefill": [p for p, _ in r], "decode": [d for _, d in r]} for name, r in rounds.items()}
    base_macs = macs_per_token(base, 512)
    out = {"schema": "compressor.bench_speed/v1", "environment": environment(), "args": vars(args), "variants": {}}
    for name, m in variants.items():
        pre, dec = statistics.median(res[name]["prefill"]), statistics.median(res[name]["decode"])
        macs = macs_per_token(m, 512)
        out["variants"][name] = {
            "params": sum(p.numel() for p in m.parameters()), "linear_macs_per_token": macs,
            "prefill_512_s": pre, "decode_tok_s": dec,
            "prefill_speedup": ratio_of_medians(res["original"]["prefill"], res[name]["prefill"]),
            "macs_ratio": base_macs / macs,
        }
        v = out["variants"][name]
        print(f"{name:12s} prefill {pre * 1000:7.1f} ms  speed-up {v['prefill_speedup']:.3f}  "
              f"MAC ratio {v['macs_ratio']:.3f}  decode {dec:6.1f} tok/s")
    write_json(args.output, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
