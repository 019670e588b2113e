"""What ran where: the environment record, the load average, and the CPU other processes used.

A timing taken while other processes used the CPU is slower than the code:
:class:`OtherCpu` measures how many cores the *others* used over a region
(all processes' busy time from /proc/stat minus this process's and its
children's), :func:`wait_for_idle` waits for a quiet machine first, and
:func:`contention_note` is the "did not run alone" line for a summary.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from importlib.metadata import PackageNotFoundError, version

logger = logging.getLogger("benchlib")

BUSY_CORES = 0.2  # other processes using more than this many cores → the timing is flagged


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _ram_gib() -> float | None:
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * page_size / 1024**3, 1)


def environment() -> dict:
    """Software versions and machine facts (cpu count, torch threads…) recorded with every result."""
    import torch

    return {
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "transformers": _version("transformers"),
        "compressor": _version("compressor"),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.platform(),
        "processor": _cpu_model(),
        "ram_gib": _ram_gib(),
    }


def load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages: how many cores were busy, this run included."""
    return list(os.getloadavg())


def _busy_cpu_s() -> float:
    """CPU seconds all processes have spent busy since boot (/proc/stat), NaN if unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its finished children."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class OtherCpu:
    """Average CPU cores used by other processes over a region (``.cores``): a contamination flag."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet

    def __enter__(self) -> "OtherCpu":
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_cpu_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        dt = time.perf_counter() - self.t0
        other = (_busy_cpu_s() - self.busy0) - (_own_cpu_s() - self.own0)
        self.cores = max(0.0, other / dt) if dt > 0 else float("nan")
        if self.cores > BUSY_CORES and not self.quiet:
            logger.warning("other processes used %.2f CPU cores during this phase: timing is contaminated", self.cores)


def wait_for_idle(max_wait: float, threshold: float = BUSY_CORES) -> float:
    """Wait (up to ``max_wait`` s) until other processes use < ``threshold`` cores over 5 s."""
    deadline = time.monotonic() + max_wait
    while True:
        with OtherCpu(quiet=True) as oc:
            time.sleep(5.0)
        if oc.cores < threshold or time.monotonic() >= deadline:
            if oc.cores >= threshold:
                logger.warning("machine still busy (%.2f cores used by others); benchmarking anyway", oc.cores)
            return oc.cores
        logger.info("waiting for the machine to go idle (others use %.2f cores)", oc.cores)


def contention_note(cores_by_phase: dict[str, float | None]) -> str | None:
    """None when the run ran alone (others below :data:`BUSY_CORES` in every phase), else a warning line."""
    busy = {k: v for k, v in cores_by_phase.items() if v is not None and v > BUSY_CORES}
    if not busy:
        return None
    return ("WARNING: other processes were using the CPU (cores): "
            + ", ".join(f"{k} {v:.2f}" for k, v in busy.items()) + " -- timings inflated")
