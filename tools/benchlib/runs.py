"""Steps run as separate processes: a command log (what ran, for the result JSON), and the two
independent checks, ``tools/checks/independent_check.py`` (plain transformers) and
``tools/checks/llamacpp_perplexity.py`` (llama.cpp), neither of which imports compressor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import REPO_ROOT, TOOLS_DIR

PY = sys.executable
CHECKS_DIR = TOOLS_DIR / "checks"  # the independent checks, run by path (a process of their own)


def run_logged(cmd: list, log: Path) -> float:
    """Run ``cmd`` (any items, made strings), appending ``$ cmd`` and its output to ``log``; its seconds.
    Raises ``SystemExit`` naming the command and the log on failure."""
    cmd = [str(c) for c in cmd]
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
    if rc:
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}); see {log}")
    return time.perf_counter() - t0


def launch_ranks(script: list[str], processes: int, threads: int) -> tuple[float, float]:
    """``script`` (a tool and its worker arguments) as one process, or under ``torchrun --standalone`` with
    ``processes`` ranks, each on ``threads`` intra-op threads, with this checkout's compressor on the path
    (whatever is installed); its wall seconds and the 5-minute load average after it (how many cores were free)."""
    from .machine import load_average

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONPATH=str(REPO_ROOT))
    if processes == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", *script]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=REPO_ROOT)
    return time.perf_counter() - t0, load_average()[1]


def logged_commands(log: Path) -> list[str]:
    """The commands :func:`run_logged` wrote to ``log``, in order, as run."""
    return [line[2:] for line in Path(log).read_text().splitlines() if line.startswith("$ ")]


class WorkFolder:
    """A benchmark's work folder: what a step made is kept there, so a run interrupted picks up where it
    stopped; each command run is logged in ``log.txt`` and its seconds recorded in ``seconds``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.log = self.path / "log.txt"
        self._kept = self.path / "seconds.json"  # kept across invocations: a step made earlier keeps its time
        self.seconds: dict[str, float] = json.loads(self._kept.read_text()) if self._kept.exists() else {}

    def make(self, key: str, product: Path, cmd: list) -> Path:
        """``product``, made by running ``cmd`` unless it exists (its seconds then under ``key``)."""
        if not product.exists():
            self.seconds[key] = run_logged(cmd, self.log)
            self._kept.write_text(json.dumps(self.seconds, indent=1))
        return product

    def commands(self) -> list[str]:
        return logged_commands(self.log)


def llamacpp_perplexity_cmd(ggufs: list, text, windows: int, output, threads: int | None = None,
                            kld: bool = False, reference_dir=None) -> list:
    """The command scoring ``ggufs`` on ``text`` in llama.cpp alone (the first file is the reference),
    ``windows`` windows of 512 tokens, the result JSON at ``output`` (read it with :func:`scores`); ``kld``:
    also every file's KL divergence from the first, token by token; ``reference_dir``: the first file's scores
    kept there and reused by a later call."""
    return [PY, CHECKS_DIR / "llamacpp_perplexity.py", *ggufs, "--text", text, "--windows", windows,
            *(["--threads", threads] if threads is not None else []), "--output", output,
            *(["--kld"] if kld else []), *(["--reference-dir", reference_dir] if reference_dir else [])]


def scores(path) -> list[dict]:
    """The rows of a ``tools/checks/llamacpp_perplexity.py`` result: ``file``, ``ppl``, ``scored_tokens``…"""
    return json.loads(Path(path).read_text())["results"]


def independent_check_cmd(compressed, original: str, text, tokens: int, output, *extra) -> list:
    """The command measuring ``compressed`` against ``original`` in plain transformers on ``tokens``
    tokens of ``text`` (``extra``: more flags, e.g. ``--seq-len``), the result JSON at ``output``."""
    return [PY, CHECKS_DIR / "independent_check.py", compressed, "--original", original, "--text", text,
            "--tokens", tokens, *extra, "--json", output]


def independent_change(result: dict) -> dict:
    """The perplexities and the change (± its paired SE) of a ``tools/checks/independent_check.py`` result."""
    return {"ppl_original": result["ppl_original"], "ppl_compressed": result["ppl_compressed"],
            "relative_change": result["relative_delta"], "relative_change_se": result["relative_delta_se"]}
