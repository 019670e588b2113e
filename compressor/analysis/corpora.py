"""Part 3: corpus robustness — is the R²_lin profile the model's, or the text's?

The same model profiled on several domains: the ``--data`` text, the running
Python's standard-library sources (``.py`` files; whole files are held out, so
held-out code was never fitted), text the model writes itself (``self``), or
any text file. Every domain gets the same number of fit windows, so their R²
carry the same finite-sample bias (and about as many held-out windows); the ``--data`` domain's fit rows are the
first ones of the main pass (:class:`SubsetPart`), scored on its held-out rows.
"""

from __future__ import annotations

import logging
import random
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import nn

from compressor.analysis.correlation import spearman
from compressor.core.stats import Moments
from compressor.engine.profiling import BlockProfile, block_profile
from compressor.engine.walker import LayerWalker
from compressor.fitting.solve import score, solve_affine
from compressor.inputs.data import CalibrationSet, TextSource, calibration_set, tokenize_stream

logger = logging.getLogger(__name__)

#: Folders of the standard library that are not library source (tests, vendored packages).
_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files (tests and installed packages excluded), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _SKIP & set(p.relative_to(root).parts[:-1]))


def _windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    return stream[: (stream.numel() // seq_len) * seq_len].view(-1, seq_len)


def stdlib_windows(tokenizer, n_fit: int, n_held: int, seq_len: int, seed: int,
                   root: str | Path | None = None) -> CalibrationSet:
    """``n_fit`` fit and ``n_held`` held-out windows of Python source: files in a seeded order, one file in
    k held out (k ≈ (n_fit + n_held) / n_held), so no held-out window comes from a fitted file."""
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library at {root or sysconfig.get_paths()['stdlib']}")
    random.Random(seed).shuffle(files)
    every = max(2, round((n_fit + n_held) / n_held))
    held = [f for n, f in enumerate(files) if n % every == every - 1]
    fit = [f for n, f in enumerate(files) if n % every != every - 1]

    def stream(paths: list[Path], n: int) -> torch.Tensor:
        # a generator: files are read only until the stream has n tokens
        docs = (p.read_text(encoding="utf-8", errors="replace") for p in paths)
        return tokenize_stream(tokenizer, docs, n)

    return CalibrationSet(fit=_windows(stream(fit, n_fit * seq_len), seq_len),
                          heldout=_windows(stream(held, n_held * seq_len), seq_len))


def self_windows(model: nn.Module, tokenizer, n_fit: int, n_held: int, seq_len: int, seed: int,
                 use_cache: bool = True) -> CalibrationSet:
    """Windows of text the model writes itself (:mod:`compressor.inputs.selfcal`, cached by default),
    a seeded choice of ``n_held`` of them held out."""
    from compressor.inputs.selfcal import SelfCalSettings, self_calibration_tokens

    n_tokens = (n_fit + n_held) * seq_len
    # all sequences in one round where possible: a decoding step costs about the same for 32 or 64 rows
    rows = -(-n_tokens // (seq_len + 2))
    settings = SelfCalSettings(n_tokens=n_tokens, seq_len=seq_len, seed=seed, batch_size=min(64, rows))
    w = _windows(self_calibration_tokens(model, tokenizer, settings, use_cache=use_cache), seq_len)
    perm = torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(seed))
    return CalibrationSet(fit=w[torch.sort(perm[n_held:]).values], heldout=w[torch.sort(perm[:n_held]).values])


def file_windows(tokenizer, path: str, n_fit: int, n_held: int, seq_len: int, seed: int) -> CalibrationSet:
    cal = calibration_set(tokenizer, TextSource(path), seq_len=seq_len, max_tokens=(n_fit + n_held) * seq_len,
                          heldout_fraction=n_held / (n_fit + n_held), seed=seed)
    return CalibrationSet(fit=cal.fit[:n_fit], heldout=cal.heldout)


def profile_windows(model: nn.Module, cal: CalibrationSet, *, batch_size: int = 8,
                    compute_dtype: torch.dtype = torch.float32, desc: str = "profile") -> list[BlockProfile]:
    """Every block's profile on ``cal`` — one layer-sequential pass, as ``compressor profile`` does it."""
    walker = LayerWalker(model, {"fit": cal.fit, "heldout": cal.heldout}, batch_size=batch_size)
    out: list[BlockProfile] = []
    walker.walk(lambda i, st: out.append(block_profile(st.xy)[0]), compute_dtype=compute_dtype, desc=desc)
    return out


class SubsetPart:
    """During the main pass: the fit statistics of the first ``fit_windows`` fit windows, scored per block
    on all held-out rows — the ``--data`` domain at the other domains' size (and the random control's rows)."""

    name = "subset"

    def __init__(self, fit_windows: int, compute_dtype: torch.dtype = torch.float32) -> None:
        self.fit_windows, self.compute_dtype = fit_windows, compute_dtype
        self.fit: Moments | None = None
        self.r2: list[float] = []
        self.n_fit = 0

    def observe(self, i: int, split: str, first: int, x: torch.Tensor, y: torch.Tensor) -> None:
        k = min(self.fit_windows - first, x.shape[0])
        if split != "fit" or k <= 0:
            return
        x2, y2 = x[:k].reshape(-1, x.shape[-1]), y[:k].reshape(-1, y.shape[-1])
        if self.fit is None:
            self.fit = Moments(x2.shape[1], y2.shape[1])
        self.fit.update(x2, y2, self.compute_dtype)

    def finish(self, i: int, held: Moments) -> float:
        fit = solve_affine(self.fit.to("cpu"))
        self.n_fit = self.fit.n
        self.fit = None
        r2 = score(held, fit.W, fit.b).r2
        self.r2.append(r2)
        return r2


def summarize(domains: dict[str, dict]) -> dict:
    """Per-block spread across domains and Spearman between every two domains' profiles."""
    names = list(domains)
    curves = np.array([[np.nan if v is None else v for v in domains[n]["r2_lin"]] for n in names], dtype=float)
    spread = (np.nanmax(curves, 0) - np.nanmin(curves, 0)) if len(names) > 1 else np.zeros(curves.shape[1])
    pairs = {f"{a} vs {b}": spearman(domains[a]["r2_lin"], domains[b]["r2_lin"])
             for k, a in enumerate(names) for b in names[k + 1:]}
    return {
        "spread": [float(v) for v in spread], "std": [float(v) for v in np.nanstd(curves, 0)],
        "median_spread": float(np.median(spread)), "max_spread": float(spread.max()),
        "max_spread_block": int(np.argmax(spread)), "spearman": pairs,
    }


#: Fit rows per regressor below which a domain's held-out R²_lin is visibly biased down by overfitting.
ROWS_PER_REGRESSOR = 5


def reading(domains: dict[str, dict], summary: dict, blocks: list[int], d_in: int | None = None) -> str:
    names = list(domains)
    rhos = [v for v in summary["spearman"].values() if v is not None]
    if len(names) < 2 or not rhos:
        return "Only one domain was profiled; no comparison."
    k = summary["max_spread_block"]
    values = ", ".join(f"{n} {domains[n]['r2_lin'][k]:.3f}" for n in names if domains[n]['r2_lin'][k] is not None)
    lead = (
        f"Across {len(names)} domains ({', '.join(names)}), the profiles rank the blocks alike at Spearman "
        f"{min(rhos):+.2f} to {max(rhos):+.2f}. A block's R²_lin moves by a median of {summary['median_spread']:.3f} "
        f"between domains (largest at block {blocks[k]}: {values}). "
    )
    if min(rhos) >= 0.8 and summary["median_spread"] <= 0.1:
        verdict = "The profile is a property of the model: its shape holds on every domain."
    elif min(rhos) >= 0.6:
        verdict = ("The shape of the profile holds (which blocks are linear), but levels shift with the text: "
                   "a threshold fitted on one domain does not transfer as is.")
    else:
        verdict = "The profile depends on the text: the blocks rank differently on different domains."
    rows = min((d.get("fit_rows") or 0) for d in domains.values())
    if d_in and rows < ROWS_PER_REGRESSOR * (d_in + 1):
        verdict += (f" Caution: {rows:,} fit rows for {d_in + 1:,} regressors per output ({rows / (d_in + 1):.1f} "
                    "per regressor) overfit, which lowers held-out R²_lin most where a block has the least "
                    f"signal; part of the spread is that, not the text. Raise --domain-tokens to ≥ "
                    f"{ROWS_PER_REGRESSOR * (d_in + 1):,} fit rows per domain before reading it.")
    return lead + verdict


def run_domains(model: nn.Module, tokenizer, domains: tuple[str, ...], *, data_name: str, data_profile: dict,
                n_fit: int, n_held: int, seq_len: int, seed: int, batch_size: int, compute_dtype: torch.dtype,
                use_cache: bool, warnings: list[str]) -> tuple[dict, float]:
    """Profile every domain with ``n_fit`` fit and ``n_held`` held-out windows; returns (domains, self-text seconds).

    ``data_profile``: the ``--data`` domain, measured in the main pass (:class:`SubsetPart`)."""
    import time

    out: dict[str, dict] = {}
    self_seconds = 0.0
    for d in domains:
        if d == "data":
            out[Path(data_name).name if data_name != "given windows" else "data"] = data_profile
            continue
        if tokenizer is None:
            warnings.append(f"corpus domain {d!r} needs a tokenizer: skipped")
            continue
        if d == "self":
            if not hasattr(model, "generate"):
                warnings.append("corpus domain 'self' needs a causal language model: skipped")
                continue
            t0 = time.perf_counter()
            cal = self_windows(model, tokenizer, n_fit, n_held, seq_len, seed, use_cache)
            self_seconds = time.perf_counter() - t0
            source = (f"text the model writes itself ({(n_fit + n_held) * seq_len:,} tokens, temperature 1, "
                      f"top-p 0.95, seed {seed})")
        elif d == "stdlib":
            cal = stdlib_windows(tokenizer, n_fit, n_held, seq_len, seed)
            source = "Python standard-library .py files (whole files held out)"
        else:
            cal = file_windows(tokenizer, d, n_fit, n_held, seq_len, seed)
            source = f"text file {d}"
        logger.info(
            "analyze: corpus domain %s (%d fit + %d held-out windows)", d, cal.fit.shape[0], cal.heldout.shape[0]
        )
        profs = profile_windows(model, cal, batch_size=batch_size, compute_dtype=compute_dtype, desc=f"domain {d}")
        out[d if d in ("self", "stdlib") else Path(d).name] = {
            "source": source, "fit_rows": int(cal.fit.numel()), "heldout_rows": int(cal.heldout.numel()),
            "r2_lin": [p.r2_lin for p in profs]}
    return out, self_seconds
