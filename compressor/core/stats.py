"""Mergeable sufficient statistics for affine least squares.

Nothing here stores activations. A :class:`Moments` holds the row count, the
means and the *centred* cross-product sums of the inputs ``x`` and outputs
``y`` of one FFN block, in float64. Each update takes one chunk of rows,
centres it on its own mean (so float32 chunk products keep their precision
even when means dwarf the spread, as with attention-sink tokens), and folds it
in with the pairwise update of Chan, Golub & LeVeque (1979). Two ``Moments``
merge the same way, so shards or data-parallel ranks combine with ``+``.

Everything the fit and the held-out score need is a function of these sums:
see :mod:`compressor.fitting.solve`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_F64 = torch.float64


GRAM_BLOCK = 1536
"""Column block of :func:`gram`: below about twice this width one product is as fast."""


def gram(a: torch.Tensor, block: int = GRAM_BLOCK) -> torch.Tensor:
    """``aᵀa`` computing only the blocks on and below the diagonal, mirrored above.

    The product is symmetric, so half of a full matrix product is redundant: with ``d`` columns in
    ``k`` blocks, ``k(k+1)/2`` block products replace ``k²`` (the 10,496 regressors of a 1.5B
    model's hidden-unit statistics, 6 blocks: 2.25 s against 2.95 s per 2,048 rows on a 2-core
    CPU, ``tools/structural/bench_pass_a_pieces.py``)."""
    d = a.shape[1]
    k = d // block
    if k < 2:
        return a.T @ a
    edges = [round(i * d / k) for i in range(k + 1)]
    out = torch.empty(d, d, dtype=a.dtype, device=a.device)
    for i in range(k):
        lo, hi = edges[i], edges[i + 1]
        out[lo:hi, :hi] = a[:, lo:hi].T @ a[:, :hi]
        if lo:
            out[:lo, lo:hi] = out[lo:hi, :lo].T
    return out


@dataclass
class Moments:
    """Running ``n``, means and centred sums of ``x`` (d_in) and ``y`` (d_out).

    ``cxx = Σ (x-μx)(x-μx)ᵀ``, ``cxy = Σ (x-μx)(y-μy)ᵀ``, ``cyy_diag = Σ (y-μy)²``
    per feature, and optionally the full ``cyy`` (for the output's effective
    rank). All float64 on CPU.
    """

    d_in: int
    d_out: int
    full_cyy: bool = False
    n: int = 0
    mx: torch.Tensor = field(default=None)  # type: ignore[assignment]
    my: torch.Tensor = field(default=None)  # type: ignore[assignment]
    cxx: torch.Tensor = field(default=None)  # type: ignore[assignment]
    cxy: torch.Tensor = field(default=None)  # type: ignore[assignment]
    cyy_diag: torch.Tensor = field(default=None)  # type: ignore[assignment]
    cyy: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.mx is None:
            self.mx = torch.zeros(self.d_in, dtype=_F64)
            self.my = torch.zeros(self.d_out, dtype=_F64)
            self.cxx = torch.zeros(self.d_in, self.d_in, dtype=_F64)
            self.cxy = torch.zeros(self.d_in, self.d_out, dtype=_F64)
            self.cyy_diag = torch.zeros(self.d_out, dtype=_F64)
            if self.full_cyy:
                self.cyy = torch.zeros(self.d_out, self.d_out, dtype=_F64)

    @classmethod
    def placeholder(cls, d_in: int, d_out: int, full_cyy: bool = False) -> "Moments":
        """Empty statistics that allocate nothing until rows arrive (a merge or update makes them real):
        per-batch partials of the engine leave the partitions a batch never touches unallocated."""
        e = torch.zeros(0, dtype=_F64)
        return cls(d_in, d_out, full_cyy, n=0, mx=e, my=e, cxx=e, cxy=e, cyy_diag=e, cyy=e if full_cyy else None)

    @property
    def allocated(self) -> bool:
        return self.cxx.numel() > 0 or self.d_in == 0

    def materialize_(self) -> "Moments":
        """Give a placeholder its (zero) sums."""
        if not self.allocated:
            fresh = Moments(self.d_in, self.d_out, self.full_cyy)
            self.mx, self.my, self.cxx, self.cxy = fresh.mx, fresh.my, fresh.cxx, fresh.cxy
            self.cyy_diag, self.cyy = fresh.cyy_diag, fresh.cyy
        return self

    # -- accumulation -----------------------------------------------------
    @torch.no_grad()
    def update(self, x: torch.Tensor, y: torch.Tensor, compute_dtype: torch.dtype = torch.float32) -> None:
        """Fold in a chunk of rows ``x`` [N, d_in], ``y`` [N, d_out].

        Products run in ``compute_dtype`` (float32 is ~2x faster on CPU and
        exact to ~1e-7 relative because the chunk is centred first); the
        result is accumulated in float64.
        """
        n_b = x.shape[0]
        if n_b == 0:
            return
        x = x.to(compute_dtype)
        y = y.to(compute_dtype)
        mx_b = x.mean(0)
        my_b = y.mean(0)
        xc = x - mx_b
        yc = y - my_b
        # The sums stay on the device of the data (a GPU accumulates in place,
        # without a host round trip per chunk); .to("cpu") before solving.
        # The chunk's sums stay in compute_dtype: the merge adds them into the float64 totals in place.
        chunk = Moments(self.d_in, self.d_out, self.full_cyy, n=n_b, mx=mx_b.to(_F64), my=my_b.to(_F64),
                        cxx=gram(xc), cxy=xc.T @ yc, cyy_diag=(yc * yc).sum(0),
                        cyy=gram(yc) if self.full_cyy else None)
        self.merge_(chunk)

    def merge_(self, other: "Moments") -> "Moments":
        """In-place pairwise merge (exact; order-independent up to rounding)."""
        if (other.d_in, other.d_out) != (self.d_in, self.d_out):
            raise ValueError(
                f"cannot merge statistics of shape ({other.d_in}, {other.d_out}) into "
                f"({self.d_in}, {self.d_out}): they come from different blocks or models"
            )
        if other.n == 0:
            return self
        if self.n and other.mx.device != self.mx.device:
            other = other.to(self.mx.device)
        if self.n == 0:
            self.n = other.n
            self.mx, self.my = other.mx.to(_F64, copy=True), other.my.to(_F64, copy=True)
            self.cxx, self.cxy = other.cxx.to(_F64, copy=True), other.cxy.to(_F64, copy=True)
            self.cyy_diag = other.cyy_diag.to(_F64, copy=True)
            if self.full_cyy:
                self.cyy = other.cyy.to(_F64, copy=True) if other.cyy is not None else None
            return self
        if self.full_cyy and other.cyy is None:
            raise ValueError("cannot merge: one side has no full output covariance (output_rank off)")
        n_a, n_b = self.n, other.n
        n = n_a + n_b
        dx = other.mx - self.mx
        dy = other.my - self.my
        w = n_a * n_b / n
        # In place (a d_in² float64 sum is large: no temporaries of its size).
        self.cxx.add_(other.cxx).addr_(dx, dx, alpha=w)
        self.cxy.add_(other.cxy).addr_(dx, dy, alpha=w)
        self.cyy_diag.add_(other.cyy_diag).add_(dy * dy, alpha=w)
        if self.full_cyy:
            self.cyy.add_(other.cyy).addr_(dy, dy, alpha=w)
        self.mx += dx * (n_b / n)
        self.my += dy * (n_b / n)
        self.n = n
        return self

    def to(self, device) -> "Moments":
        """A copy with every sum on ``device`` (self if already there)."""
        if self.mx.device == torch.device(device):
            return self
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Moments(self.d_in, self.d_out, self.full_cyy, n=self.n, mx=mv(self.mx), my=mv(self.my),
                       cxx=mv(self.cxx), cxy=mv(self.cxy), cyy_diag=mv(self.cyy_diag), cyy=mv(self.cyy))

    def __add__(self, other: "Moments") -> "Moments":
        out = Moments(self.d_in, self.d_out, self.full_cyy and other.full_cyy)
        out.merge_(self)
        out.merge_(other)
        return out

    # -- derived ----------------------------------------------------------
    def sst(self, about: torch.Tensor | None = None) -> float:
        """Σ‖y − c‖² pooled over features, about ``c`` (default: own mean)."""
        sst = float(self.cyy_diag.sum())
        if about is not None:
            sst += self.n * float(((self.my - about) ** 2).sum())
        return sst

    def sse(self, W: torch.Tensor, b: torch.Tensor, cxx_w: torch.Tensor | None = None) -> torch.Tensor:
        """Per-feature Σ (y − Wᵀx − b)² for the affine map ``y ≈ Wᵀx + b``.

        ``W`` is [d_in, d_out] float64. Exact in terms of the stored sums:
        centred part ``cyy − 2 Wᵀcxy + Wᵀcxx W`` plus ``n·(mean residual)²``.
        ``cxx_w``: ``cxx @ W`` when the caller has it already (the largest product here).
        """
        cross = (W * self.cxy).sum(0)
        quad = (W * (self.cxx @ W if cxx_w is None else cxx_w)).sum(0)
        mean_res = self.my - W.T @ self.mx - b
        return (self.cyy_diag - 2 * cross + quad).clamp_min(0) + self.n * mean_res**2

    # -- (de)serialisation, for the cache ---------------------------------
    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {
            f"{prefix}.n": torch.tensor([self.n], dtype=torch.int64),
            f"{prefix}.mx": self.mx,
            f"{prefix}.my": self.my,
            f"{prefix}.cxx": self.cxx,
            f"{prefix}.cxy": self.cxy,
            f"{prefix}.cyy_diag": self.cyy_diag,
        }
        if self.cyy is not None:
            out[f"{prefix}.cyy"] = self.cyy
        return out

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor], prefix: str) -> "Moments":
        cyy = sd.get(f"{prefix}.cyy")
        mx, my = sd[f"{prefix}.mx"], sd[f"{prefix}.my"]
        return cls(
            d_in=mx.numel(), d_out=my.numel(), full_cyy=cyy is not None, n=int(sd[f"{prefix}.n"][0]),
            mx=mx.clone(), my=my.clone(), cxx=sd[f"{prefix}.cxx"].clone(), cxy=sd[f"{prefix}.cxy"].clone(),
            cyy_diag=sd[f"{prefix}.cyy_diag"].clone(), cyy=None if cyy is None else cyy.clone(),
        )


class LogHistogram:
    """Counts of positive values in log2 bins of width 1/8 octave (≈9 %).

    Gives streaming medians and quantiles of row norms with bounded memory;
    merges by adding counts. The exact maximum is tracked alongside.
    """

    STEPS_PER_OCTAVE = 8
    LO, HI = -40, 40  # octaves: 2^-40 .. 2^40

    def __init__(self) -> None:
        n_bins = (self.HI - self.LO) * self.STEPS_PER_OCTAVE
        self.counts = torch.zeros(n_bins, dtype=torch.int64)
        self.max = 0.0

    @torch.no_grad()
    def update(self, values: torch.Tensor) -> None:
        v = values.detach().float().flatten().clamp_min(2.0**self.LO)
        idx = ((torch.log2(v) - self.LO) * self.STEPS_PER_OCTAVE).long().clamp(0, self.counts.numel() - 1)
        self.counts += torch.bincount(idx.cpu(), minlength=self.counts.numel())
        if v.numel():
            self.max = max(self.max, float(v.max()))

    def merge_(self, other: "LogHistogram") -> "LogHistogram":
        self.counts += other.counts
        self.max = max(self.max, other.max)
        return self

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def quantile(self, q: float) -> float:
        """Approximate quantile (bin centre); NaN when empty."""
        total = self.total
        if total == 0:
            return float("nan")
        k = int(torch.searchsorted(torch.cumsum(self.counts, 0), torch.tensor(q * total, dtype=torch.int64)))
        return 2.0 ** (self.LO + (k + 0.5) / self.STEPS_PER_OCTAVE)

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.counts": self.counts, f"{prefix}.max": torch.tensor([self.max], dtype=_F64)}

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor], prefix: str) -> "LogHistogram":
        h = cls()
        h.counts = sd[f"{prefix}.counts"].clone()
        h.max = float(sd[f"{prefix}.max"][0])
        return h
