"""What ``analyze`` measures and on how many tokens: one validated dataclass.

Every field has a command-line flag of the same name (``probe_rank`` ↔
``--probe-rank``); a bad value raises :class:`~compressor.core.errors.InputError`
naming the flag, the allowed values and the fix, before any model is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from compressor.core.errors import InputError

#: Corpus-robustness domains that are not files: the ``--data`` text, the running
#: Python's standard-library sources, and text the model writes itself.
DOMAIN_NAMES = ("data", "stdlib", "self")
PARTS = ("probe", "trained", "corpora", "crossfeed", "control")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class AnalysisConfig:
    """Sizes and switches of every part of the analysis (defaults: ≤ 3× ``profile`` on SmolLM2-135M)."""

    # -- calibration (as `compressor profile`) --------------------------------
    seq_len: int = 128
    """Tokens per window."""
    max_tokens: int = 16384
    """Tokens of the ``--data`` text (fit + held-out): the main pass, as ``profile`` reads them."""
    heldout_fraction: float = 0.2
    """Share of whole windows held out for scoring."""
    seed: int = 0
    """Seed of the window split, the stdlib file order, self-written text, the random control and the bootstrap."""
    batch_size: int = 8
    """Windows per forward."""
    precision: str = "float32"
    """Products of the statistics: float32 (summed in float64) or float64."""

    # -- parts ----------------------------------------------------------------
    parts: tuple[str, ...] = PARTS
    """Which parts to run (the profile and the two-regimes figure always are)."""
    probe_rank: int = 16
    """Top principal components of x whose pairwise products (r(r+1)/2 of them) the bilinear probe adds."""
    probe_pca_rows: int = 4096
    """Fit rows (the first ones) the principal components are taken from; bounded memory."""
    trained_steps: int = 300
    """Full-batch optimiser steps of the trained linear layer, per optimiser and block."""
    adam_lr: float = 1e-3
    """Adam's learning rate (betas 0.9, 0.999). Gradient descent uses 1/L, L the loss's smoothness constant."""
    crossfeed_blocks: tuple[int, ...] | int = 6
    """Blocks of the cross-feeding matrix: a count (evenly spaced, first and last included) or indices."""
    crossfeed_tokens: int = 4096
    """Tokens (first windows of fit and held-out, in proportion) every cross-fed pair is measured on."""
    domain_tokens: int = 4096
    """Tokens per corpus domain (stdlib, self); the --data domain and the random control use as many fit rows."""
    domains: tuple[str, ...] = DOMAIN_NAMES
    """Corpus domains: ``data``, ``stdlib``, ``self`` or text files."""
    bootstrap: int = 2000
    """Bootstrap resamples (over blocks) for correlation intervals."""

    def __post_init__(self) -> None:
        def bad(name: str, value, want: str, fix: str = "") -> InputError:
            return InputError(f"{name} ({flag(name)}) must be {want}, got {value!r}" + (f"; {fix}" if fix else ""))

        def integer(name: str, lo: int, fix: str = "") -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise bad(name, v, f"an integer ≥ {lo}", fix)

        integer("seq_len", 4)
        integer("max_tokens", 2 * self.seq_len if isinstance(self.seq_len, int) else 8,
                "give at least two windows of --seq-len tokens")
        integer("seed", 0)
        integer("batch_size", 1)
        integer("probe_rank", 1, "the probe needs at least one principal component (r=16 adds 136 products)")
        integer("probe_pca_rows", 2)
        integer("trained_steps", 1, "leave the part out with --parts instead of 0 steps")
        integer("crossfeed_tokens", 2 * self.seq_len, "give at least two windows of --seq-len tokens")
        integer("domain_tokens", 2 * self.seq_len, "give at least two windows of --seq-len tokens")
        integer("bootstrap", 0)
        hf = self.heldout_fraction
        if isinstance(hf, bool) or not isinstance(hf, (int, float)) or not 0 < hf < 1:
            raise bad("heldout_fraction", hf, "a number strictly between 0 and 1", "e.g. 0.2")
        lr = self.adam_lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
            raise bad("adam_lr", lr, "a positive finite number", "e.g. 1e-3")
        if self.precision not in ("float32", "float64"):
            raise bad("precision", self.precision, "one of float32, float64")
        unknown = [p for p in self.parts if p not in PARTS]
        if unknown:
            raise bad("parts", ",".join(self.parts), f"a comma-separated subset of {','.join(PARTS)}",
                      f"unknown: {unknown}")
        cf = self.crossfeed_blocks
        if isinstance(cf, int) and not isinstance(cf, bool):
            if cf < 2:
                raise bad("crossfeed_blocks", cf, "a count ≥ 2 or a list of ≥ 2 block indices",
                          "leave the part out with --parts instead")
        elif not (isinstance(cf, tuple) and len(set(cf)) >= 2
                  and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in cf)):
            raise bad(
                "crossfeed_blocks", cf, "a count ≥ 2 or ≥ 2 distinct non-negative block indices", "e.g. 6 or 0,5,10"
            )
        if not self.domains:
            raise bad("domains", "", f"a comma-separated list of {', '.join(DOMAIN_NAMES)} or text files")
        for d in self.domains:
            if d in DOMAIN_NAMES:
                continue
            from pathlib import Path

            if not Path(d).expanduser().is_file():
                raise bad("domains", d, f"one of {', '.join(DOMAIN_NAMES)} or an existing text file",
                          "check the path")

    def wants(self, part: str) -> bool:
        return part in self.parts

    def to_json(self) -> dict:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}
