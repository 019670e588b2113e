"""Peak memory: of a region of this process, per forward batch, and of a child process (Linux /proc)."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

logger = logging.getLogger("benchlib")

MiB = 1024 * 1024
CHILD_MARKER = "BENCH_CHILD_RESULT "


def proc_status(pid: int | str = "self", keys=("VmRSS", "VmHWM", "RssAnon", "RssFile")) -> dict[str, int]:
    """Those of ``keys`` that /proc/PID/status has, in bytes (VmHWM: the peak RSS); {} if unreadable."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in keys:
                    out[key] = int(val.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def current_rss() -> int:
    return proc_status().get("VmRSS", 0)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    st = proc_status()
    return "VmHWM" in st and st["VmHWM"] <= st.get("VmRSS", 0) + 4 * MiB


class RssSampler:
    """Background RSS sampler: the fallback (and cross-check) when VmHWM cannot be reset."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak = current_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss())
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss())


class PeakMeter:
    """Peak RSS growth over a region, relative to the RSS at entry."""

    def __enter__(self) -> "PeakMeter":
        gc.collect()
        self.hwm_reset = reset_peak_rss()
        self.baseline = current_rss()
        self.sampler = RssSampler().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.sampler.__exit__(*exc)
        self.hwm = proc_status().get("VmHWM")
        if self.hwm_reset and self.hwm is not None:
            self.peak, self.method = self.hwm, "VmHWM after clear_refs reset"
        else:
            self.peak, self.method = self.sampler.peak, "RSS sampled every 20 ms"

    def report(self) -> dict:
        return {
            "rss_after_load_mib": self.baseline / MiB,
            "peak_rss_mib": self.peak / MiB,
            "peak_growth_mib": (self.peak - self.baseline) / MiB,
            "sampled_peak_growth_mib": (self.sampler.peak - self.baseline) / MiB,
            "method": self.method,
        }


class PeakTrajectory:
    """Peak RSS growth seen at the start of every forward batch (a forward pre-hook on the
    input embeddings): shows *within one process* whether the peak keeps growing with tokens."""

    def __init__(self, model, baseline: int) -> None:
        self.baseline = baseline
        self.points: list[tuple[int, float]] = []
        self.tokens = 0
        self._h = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.mark()
        self.tokens += args[0].numel()

    def mark(self) -> None:
        hwm = proc_status().get("VmHWM")
        if hwm is not None:
            self.points.append((self.tokens, (hwm - self.baseline) / MiB))

    def close(self) -> None:
        self._h.remove()
        self.mark()

    def growth_at(self, tokens: int) -> float:
        """Peak growth over the first ``tokens`` tokens (the first reading taken once they were done)."""
        return next(g for t, g in self.points if t >= tokens)

    def summary(self, max_points: int = 41) -> list[tuple[int, float]]:
        pts = self.points
        if len(pts) <= max_points:
            return pts
        step = (len(pts) - 1) / (max_points - 1)
        return [pts[round(k * step)] for k in range(max_points)]


def emit_child_result(result: dict) -> None:
    """A child's answer to :func:`json_child`: one marked JSON line on stdout."""
    sys.stdout.write(CHILD_MARKER + json.dumps(result) + "\n")


def json_child(cmd: list[str], env: dict[str, str] | None = None, *, name: str = "child", cwd=None) -> dict:
    """Run ``cmd`` (stderr passes through), return the last JSON line it marked with :func:`emit_child_result`."""
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed with exit code {proc.returncode}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_MARKER)]
    if not lines:
        raise RuntimeError(f"{name} printed no result")
    return json.loads(lines[-1][len(CHILD_MARKER):])


def measure_child(code: str, *args: str, pythonpath: str | None = None) -> dict:
    """Run ``code`` in a fresh interpreter: its peak RSS (``wait4``), its peak *anonymous* RSS
    (sampled every 20 ms from /proc: the memory that must fit, without the clean, reclaimable
    file pages of memory-mapped checkpoints), wall time and last JSON line."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, stdout=out,
                                stderr=err, text=True)
        anon = file = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            st = proc_status(proc.pid, ("VmRSS", "RssAnon", "RssFile"))
            anon, file = max(anon, st.get("RssAnon", 0)), max(file, st.get("RssFile", 0))
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{stderr[-4000:]}")
    last = [line for line in stdout.splitlines() if line.startswith("{")]
    return {"peak_rss_bytes": usage.ru_maxrss * 1024, "peak_anon_bytes": anon, "peak_file_bytes": file,
            "wall_s": round(wall, 1), "result": json.loads(last[-1]) if last else None}
