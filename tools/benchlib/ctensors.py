"""Helpers of ``tools/size/bench_ctensors.py`` (compressed-tensors against llm-compressor's GPTQ).

Nothing here imports torch, transformers or compressor at import time: the same module is read
by the three interpreters the benchmark uses (the project's ``.venv``, the ``llmc`` venv that runs
llm-compressor, the ``eval`` venv that scores folders without compressor).

* the two venvs: their pinned requirements and the commands that make them;
* calibration windows: cutting a token stream into consecutive windows, the text stream compressor
  reads from a ``.txt`` file (re-done here without compressor), and the recipe seed under which
  compressor's held-out split leaves exactly these windows to fit on;
* scoring: KL divergence statistics as ``llama-perplexity --kl-divergence`` reports them, weight bytes
  in memory and on disk, a summary of ``quantization_config``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TORCH_SPEC = "torch==2.13.0"  # the CPU build this project is benchmarked on (a wheel on local disk here)
VENV_ROOT = Path("/tmp/ct-venvs")


@dataclass(frozen=True)
class VenvSpec:
    """A venv the benchmark runs a step in: its name (a folder under the venv root), the packages
    installed after torch, and a check that the installed versions are the ones asked for."""

    name: str
    packages: tuple[str, ...]
    check: str  # Python run in the venv: exits 0 when the venv is complete
    purpose: str


VENVS = {
    "llmc": VenvSpec(
        name="llmc",
        # llmcompressor pins transformers (<=5.17) and compressed-tensors (==0.19.0): pip resolves
        # those; the constraints file keeps torch at TORCH_SPEC.
        packages=("llmcompressor==0.14.0.1",),
        check="import torch, llmcompressor, importlib.metadata as m; "
              "assert m.version('llmcompressor') == '0.14.0.1', m.version('llmcompressor'); "
              f"assert torch.__version__.split('+')[0] == '{TORCH_SPEC.split('==')[1]}', torch.__version__",
        purpose="llm-compressor's oneshot GPTQ",
    ),
    "eval": VenvSpec(
        name="eval",
        packages=("transformers==5.24.0", "compressed-tensors==0.20.0", "numpy", "safetensors"),
        check="import importlib.util as u, importlib.metadata as m, torch; "
              "assert m.version('transformers') == '5.24.0' and m.version('compressed-tensors') == '0.20.0'; "
              f"assert torch.__version__.split('+')[0] == '{TORCH_SPEC.split('==')[1]}', torch.__version__; "
              "assert u.find_spec('compressor') is None, 'compressor is installed in the eval venv'",
        purpose="scoring in plain transformers, compressor not installed",
    ),
}


def venv_python(root: Path, name: str) -> Path:
    """The interpreter of venv ``name`` under ``root``."""
    return Path(root) / name / "bin" / "python"


def setup_commands(root: Path, name: str, python: str = "python3") -> list[list[str]]:
    """The commands that make venv ``name`` under ``root`` from nothing (what the module docstring of
    ``tools/size/bench_ctensors.py`` lists): the venv, pinned torch, then the rest under a constraints file
    that holds torch where it is."""
    spec = VENVS[name]
    py = str(venv_python(root, name))
    constraints = str(Path(root) / "constraints.txt")
    return [
        [python, "-m", "venv", str(Path(root) / name)],
        [py, "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [py, "-m", "pip", "install", "-q", TORCH_SPEC],
        [py, "-m", "pip", "install", "-q", "-c", constraints, *spec.packages],
    ]


def venv_ready(root: Path, name: str) -> bool:
    """Does venv ``name`` exist with the versions asked for (its :attr:`VenvSpec.check` passes)?"""
    py = venv_python(root, name)
    if not py.exists():
        return False
    return subprocess.run([str(py), "-c", VENVS[name].check], cwd="/", capture_output=True).returncode == 0


def make_venv(root: Path, name: str, python: str = "python3", log=None) -> list[str]:
    """Make venv ``name`` under ``root`` unless it is ready; the commands run (shell-quoted)."""
    import shlex

    root = Path(root)
    if venv_ready(root, name):
        return []
    root.mkdir(parents=True, exist_ok=True)
    (root / "constraints.txt").write_text(TORCH_SPEC + "\n")
    ran = []
    for cmd in setup_commands(root, name, python):
        if cmd[1:3] == ["-m", "venv"] and venv_python(root, name).exists():
            continue
        ran.append(shlex.join(cmd))
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT if log else None)
    check = subprocess.run([str(venv_python(root, name)), "-c", VENVS[name].check], cwd="/",
                           capture_output=True, text=True)
    if check.returncode:
        raise SystemExit(f"venv {name} at {root / name} was made but its check failed:\n{check.stderr}"
                         f"\nremove {root / name} and run setup again")
    return ran


def pip_freeze(python: Path) -> dict[str, str]:
    """``{distribution: version}`` of the venv whose interpreter is ``python``."""
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                         check=True).stdout
    return {d["name"].lower(): d["version"] for d in json.loads(out)}


# ---------------------------------------------------------------------------------------------- windows


def cut_windows(ids: list[int], n: int, seq_len: int, start: int | None = None) -> list[list[int]]:
    """The first ``n`` consecutive, non-overlapping windows of ``seq_len`` ids from ``ids``; with
    ``start`` (a tokenizer that puts BOS in front of text) each window is ``start`` then ``seq_len - 1``
    ids, as compressor lays out windows. Raises ``ValueError`` when ``ids`` is too short.

    >>> cut_windows(list(range(7)), 2, 3)
    [[0, 1, 2], [3, 4, 5]]
    >>> cut_windows(list(range(7)), 2, 3, start=9)
    [[9, 0, 1], [9, 2, 3]]
    """
    body = seq_len - (start is not None)
    if body < 1:
        raise ValueError(f"seq_len {seq_len} leaves no room for text")
    if len(ids) < n * body:
        raise ValueError(f"{len(ids)} tokens make {len(ids) // body} windows of {seq_len}; {n} were asked for. "
                         "Give a longer text or fewer windows")
    head = [] if start is None else [start]
    return [head + ids[i * body:(i + 1) * body] for i in range(n)]


LINES_PER_DOCUMENT = 32  # compressor.inputs.data: a .txt file is read as documents of 32 lines
CHARS_PER_CALL = 200_000  # compressor.inputs.data.tokenize_stream: characters per tokenizer call


def text_file_stream(tokenizer, path: Path, max_tokens: int) -> list[int]:
    """The id stream compressor reads from a ``.txt`` calibration file, re-done without compressor:
    documents of :data:`LINES_PER_DOCUMENT` lines joined by ``\\n``, each tokenized alone (no special
    tokens) and followed by the ids of ``\\n\\n``, cut at ``max_tokens``.
    :func:`check_compressor_windows` asserts that compressor agrees."""
    ids: list[int] = []
    sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # a final newline ends the last line, it starts none
    for d in range(0, len(lines), LINES_PER_DOCUMENT):
        doc = "\n".join(lines[d:d + LINES_PER_DOCUMENT])
        for s in range(0, len(doc), CHARS_PER_CALL):
            ids += tokenizer(doc[s:s + CHARS_PER_CALL], add_special_tokens=False)["input_ids"]
            if len(ids) >= max_tokens:
                return ids[:max_tokens]
        ids += sep
    return ids[:max_tokens]


def heldout_seed(n_fit: int, n_extra: int, heldout_fraction: float, limit: int = 100_000) -> int:
    """The smallest seed under which compressor's fit / held-out split of ``n_fit + n_extra`` windows
    holds out exactly the last ``n_extra`` (``compressor.inputs.data.split_windows``: a seeded
    ``torch.randperm``; its first ``max(1, ceil(fraction × n))`` are held out), so that compressor fits
    on the first ``n_fit`` windows, the ones the other method calibrates on. Needs torch."""
    import torch

    n = n_fit + n_extra
    n_held = min(n - 1, max(1, math.ceil(heldout_fraction * n)))
    if n_held != n_extra:
        raise ValueError(f"heldout_fraction {heldout_fraction} holds out {n_held} of {n} windows, not {n_extra}")
    want = list(range(n_fit, n))
    for seed in range(limit):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        if sorted(perm[:n_held].tolist()) == want:
            return seed
    raise ValueError(f"no seed below {limit} holds out the last {n_extra} of {n} windows")


def compressor_calibration(text: Path, seq_len: int, n_fit: int, n_extra: int = 1, body: int | None = None) -> dict:
    """The recipe ``calibration:`` section under which compressor fits on the first ``n_fit`` windows of
    ``text`` and holds out the next ``n_extra`` for its own scoring (its held-out share cannot be 0).
    ``body``: text ids per window (``seq_len - 1`` when BOS heads every window; compressor's
    ``max_tokens`` counts text ids before BOS is put in front).

    >>> c = compressor_calibration(Path("v.txt"), 512, 32)
    >>> c["max_tokens"], c["heldout_fraction"], math.ceil(c["heldout_fraction"] * 33)
    (16896, 0.027273, 1)
    """
    n = n_fit + n_extra
    # a fraction just under n_extra / n: ceil() of it times n is n_extra, float rounding aside
    fraction = round((n_extra - 0.1) / n, 6)
    return {"dataset": str(text), "seq_len": seq_len, "max_tokens": n * (body or seq_len),
            "heldout_fraction": fraction, "seed": heldout_seed(n_fit, n_extra, fraction)}


def check_compressor_windows(windows, tokenizer, calibration: dict, recipe: Path | None = None) -> dict:
    """Assert that compressor fits on exactly ``windows`` (an [n, seq_len] int64 tensor) under the recipe
    ``calibration`` section (:func:`compressor_calibration`): the recipe is compressor's defaults with that
    section, or the recipe file ``recipe`` with its ``calibration:`` replaced by it (its evaluation
    domains kept: one reading the same file would change the calibration's documents). Runs compressor's
    own calibrate-stage input (``build_calibration``); imports compressor (the project's venv)."""
    import torch
    from compressor.inputs.calibration import build_calibration
    from compressor.recipe.loader import load_recipe, recipe_from_dict

    if recipe is None:
        r = recipe_from_dict({"version": 1, "calibration": calibration})
    else:
        r = load_recipe(recipe)
        r = recipe_from_dict({**r.model_dump(mode="json", exclude_unset=True), "calibration": calibration})
    if r.calibration.writes_self():
        raise ValueError("the calibration section must read the text file, not 'mix' / 'self'")
    cal, _ = build_calibration(r, None, tokenizer, use_cache=False)
    same = cal.fit.shape == windows.shape and torch.equal(cal.fit, windows.to(cal.fit.dtype))
    if not same:
        raise AssertionError(f"compressor fits on {tuple(cal.fit.shape)} windows that differ from the "
                             f"{tuple(windows.shape)} calibration windows: the two methods would not see the same "
                             "tokens (did compressor's .txt reading change? see text_file_stream)")
    return {"identical": True, "fit_windows": int(cal.fit.shape[0]), "heldout_windows": int(cal.heldout.shape[0]),
            "recipe": str(recipe) if recipe else "compressor's defaults with this calibration section",
            "via": "compressor.inputs.calibration.build_calibration", "fingerprint": cal.fingerprint()}


# ---------------------------------------------------------------------------------------------- scoring


def _mean_se(xs: list[float]) -> tuple[float, float | None]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def _quantile(sorted_xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def kl_summary(kl_by_window: list[list[float]], same_top_by_window: list[list[bool]]) -> dict:
    """KL divergence statistics as ``llama-perplexity --kl-divergence`` prints them, from per-token
    KL(original ‖ candidate) and whether the two agree on the top token, window by window: the mean
    with its standard error over windows (windows, not tokens, are the independent units), median,
    99th percentile and maximum over tokens, the same-top-token rate (± SE over windows).

    >>> s = kl_summary([[0.0, 0.2], [0.2, 0.4]], [[True, True], [True, False]])
    >>> round(s["mean"], 3), round(s["mean_se"], 3), round(s["median"], 3), s["same_top"]
    (0.2, 0.1, 0.2, 0.75)
    """
    per_window = [sum(w) / len(w) for w in kl_by_window]
    top_per_window = [sum(w) / len(w) for w in same_top_by_window]
    flat = sorted(x for w in kl_by_window for x in w)
    mean, se = _mean_se(per_window)
    top, top_se = _mean_se(top_per_window)
    return {"mean": mean, "mean_se": se, "median": _quantile(flat, 0.5), "p99": _quantile(flat, 0.99),
            "p999": _quantile(flat, 0.999), "max": flat[-1], "same_top": top, "same_top_se": top_se,
            "tokens": len(flat), "windows": len(per_window)}


def safetensors_bytes(folder: Path) -> dict:
    """Bytes on disk of a folder's ``*.safetensors`` files (each and in all) and of the whole folder."""
    folder = Path(folder)
    files = {p.name: p.stat().st_size for p in sorted(folder.glob("*.safetensors"))}
    return {"safetensors": sum(files.values()), "files": files,
            "folder": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())}


def module_bytes(model) -> dict:
    """Bytes of a loaded model's parameters and buffers (each storage counted once: tied weights are
    one tensor), with the bytes per dtype."""
    seen, by_dtype, params, buffers = set(), {}, 0, 0
    for kind, tensors in (("param", model.parameters()), ("buffer", model.buffers())):
        for t in tensors:
            key = (t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape))
            if key in seen:
                continue
            seen.add(key)
            n = t.numel() * t.element_size()
            by_dtype[str(t.dtype).removeprefix("torch.")] = by_dtype.get(str(t.dtype).removeprefix("torch."), 0) + n
            if kind == "param":
                params += n
            else:
                buffers += n
    return {"total": params + buffers, "parameters": params, "buffers": buffers, "by_dtype": by_dtype}


def quantization_summary(config: dict) -> dict | None:
    """What a folder's ``config.json`` says about its quantization: method, format, and each config
    group's targets and weight scheme (bits, type, strategy, group size, symmetric, actorder)."""
    q = config.get("quantization_config") or config.get("compression_config")
    if not q:
        return None
    groups = {}
    for name, g in (q.get("config_groups") or {}).items():
        w = g.get("weights") or {}
        groups[name] = {"targets": g.get("targets"), "format": g.get("format"),
                        "weights": {k: w.get(k) for k in ("num_bits", "type", "strategy", "group_size",
                                                          "symmetric", "actorder", "observer") if k in w},
                        "input_activations": g.get("input_activations")}
    return {"quant_method": q.get("quant_method"), "format": q.get("format"),
            "quantization_status": q.get("quantization_status"), "ignore": q.get("ignore"),
            "version": q.get("version"), "config_groups": groups}


def load_average() -> list[float]:
    """The 1, 5, 15-minute load averages (recorded at the start and end of each timed arm)."""
    return [round(x, 2) for x in os.getloadavg()]


def this_python() -> str:
    return sys.executable
