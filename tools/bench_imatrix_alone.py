"""The importance matrix alone: one uniform type everywhere, with and without column weights.

Every 2-D tensor of the F16 re-quantized to one type (default Q4_0, which rows of 32 take) four ways:
compressor's writer without weights, compressor's writer with the run's ``diag(Ĥ)`` (what the size
planner passes to ggml), ``llama-quantize --pure`` without and with ``llama-imatrix`` from the same
calibration text. All four scored on WikiText-2 test by ``tools/llamacpp_perplexity.py`` (a process that
does not import compressor). The token embedding keeps llama.cpp's importance-free treatment here
(``llama-imatrix`` does not cover it), so both sides differ only in the matrices' column weights.

    python tools/bench_imatrix_alone.py --work /tmp/bench-smol --tools /path/to/build/bin \\
        --output tools/results/imatrix_alone_smollm2.json

``--work``: the folder of ``tools/bench_size_frontier.py`` (its F16.gguf, imatrix.gguf, calibration.txt).
Run it alone.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchlib import load_bench_model, wikitext, write_json
from benchlib.cli import add_alone, add_model, tool_parser
from benchlib.runs import llamacpp_perplexity_cmd, scores


def main() -> None:
    ap = tool_parser(__doc__)
    add_model(ap)
    ap.add_argument("--work", required=True)
    ap.add_argument("--tools", required=True)
    ap.add_argument("--type", default="Q4_0")
    ap.add_argument("--cal-tokens", type=int, default=16384)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--output", required=True)
    add_alone(ap)
    args = ap.parse_args()
    import torch

    from compressor.engine.tensorstats import input_moments, linear_names
    from compressor.output.gguf import write_requantized
    from compressor.pipeline.size.prices import gguf_namer
    from compressor.policy.quantplan import _imatrix

    work, tools = Path(args.work), Path(args.tools)
    f16 = work / "F16.gguf"
    model, tok, _, _ = load_bench_model(args.model, dtype="float32")
    text = (work / "calibration.txt").read_text(encoding="utf-8")
    ids = torch.tensor(tok(text).input_ids[: args.cal_tokens]).reshape(-1, 512)
    names = linear_names(model)
    moments = input_moments(model, ids, names, batch_size=4)
    namer = gguf_namer(model)
    imatrix = {namer(f"{n}.weight"): _imatrix(torch.diagonal(moments[n])) for n in names if namer(f"{n}.weight")}
    import gguf

    two_d = [t.name for t in gguf.GGUFReader(f16).tensors if len([d for d in t.shape if d > 1]) >= 2]
    types = {name: args.type for name in two_d}
    files = {}
    files["compressor, no weights"] = work / f"uniform-{args.type}-plain.gguf"
    write_requantized(f16, files["compressor, no weights"], types)
    files["compressor, diag(H) of the run"] = work / f"uniform-{args.type}-ours.gguf"
    write_requantized(f16, files["compressor, diag(H) of the run"], types, imatrix)
    files["llama-quantize --pure"] = work / f"pure-{args.type}.gguf"
    files["llama-quantize --pure --imatrix"] = work / f"pure-{args.type}-imatrix.gguf"
    for label, extra in (("llama-quantize --pure", []),
                         ("llama-quantize --pure --imatrix", ["--imatrix", str(work / "imatrix.gguf")])):
        subprocess.run([str(tools / "llama-quantize"), "--pure", *extra, str(f16), str(files[label]), args.type, "2"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    scored = work / f"imatrix-alone-{args.type}.json"
    cmd = llamacpp_perplexity_cmd([f16, *files.values()], wikitext("test.txt"), args.windows, scored)
    subprocess.run([str(c) for c in cmd], check=True, stdout=subprocess.DEVNULL)
    res = {Path(r["file"]).name: r for r in scores(scored)}
    base = res["F16.gguf"]["ppl"]
    rows = [{"file": label, "bytes": p.stat().st_size, "ppl": res[p.name]["ppl"],
             "change_vs_f16": res[p.name]["ppl"] / base - 1} for label, p in files.items()]
    write_json(args.output, {
        "model": args.model, "type": args.type, "eval": f"WikiText-2 test, {args.windows} windows of 512, llama.cpp",
        "calibration": f"{args.cal_tokens} tokens of {work / 'calibration.txt'} (the first characters of WikiText-2 "
                       "valid), the same text llama-imatrix read", "f16_ppl": base, "ran_alone": bool(args.alone),
        "rows": rows})
    for r in rows:
        print(f"{r['file']:34s} {r['bytes'] / 1e6:7.1f} MB  {100 * r['change_vs_f16']:+6.2f} %")


if __name__ == "__main__":
    main()
