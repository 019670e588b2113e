"""Turn per-block statistics into the per-block linearity profile (R²_lin etc.)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from compressor.fitting.solve import AffineFit, effective_rank, score, solve_affine
from compressor.engine.measure import PARTS, BlockStats

PROFILE_SCHEMA = "compressor.profile/v1"


@dataclass
class BlockProfile:
    index: int
    r2_lin: float
    """Held-out 1 − SSE/SST pooled over output features (the paper's R²_lin)."""
    r2_median_feature: float
    r2_bulk: float
    """R²_lin of the same fit scored on held-out rows that are neither sink nor spike."""
    outlier_sst_share: float
    """Share of held-out SST (about the held-out mean) carried by sink + spike rows."""
    sink_sst_share: float
    spike_sst_share: float
    outlier_rows: int
    outlier_dominated: bool
    explained_effective_rank: float
    output_effective_rank: float | None
    input_condition_number: float | None
    input_effective_rank: float
    input_dynamic_range: float
    n_fit: int
    n_heldout: int
    d_in: int
    d_out: int
    damping: float
    dead_inputs: int
    ffn_params: int = 0
    affine_params: int = 0
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {k: _finite_or_none(v) for k, v in asdict(self).items()}


def _finite_or_none(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def block_profile(
    st: BlockStats, fit: AffineFit | None = None, *, outlier_share_flag: float = 0.5
) -> tuple[BlockProfile, AffineFit]:
    """Score the closed-form fit of one block on its held-out statistics."""
    fit = fit or solve_affine(st.fit)
    held = st.heldout_total()
    warnings = list(fit.warnings)
    if held.n == 0:
        warnings.append("no held-out rows: raise calibration max_tokens or heldout_fraction")
    s = score(held, fit.W, fit.b)
    bulk = st.heldout["bulk"]
    s_bulk = score(bulk, fit.W, fit.b)
    sst_total = held.sst()
    part_sst = {p: st.heldout[p].sst(about=held.my) if st.heldout[p].n else 0.0 for p in PARTS}
    share = {p: part_sst[p] / sst_total if sst_total > 0 else float("nan") for p in PARTS}
    outlier_share = share["sink"] + share["spike"]

    cxx = st.fit.cxx / max(st.fit.n, 1)
    eig_in = torch.linalg.eigvalsh((cxx + cxx.T) / 2).clamp_min(0)
    cond = float(eig_in.max() / eig_in.min()) if float(eig_in.min()) > 0 else None
    if cond is None:
        warnings.append("input covariance is singular (condition number infinite)")
    out_rank = None
    if st.fit.cyy is not None:
        cyy = st.fit.cyy / max(st.fit.n, 1)
        out_rank = effective_rank(torch.linalg.eigvalsh((cyy + cyy.T) / 2).clamp_min(0).sqrt())
    median_in = st.in_norms.quantile(0.5)
    flagged = bool(outlier_share >= outlier_share_flag) if outlier_share == outlier_share else False
    prof = BlockProfile(
        index=st.index,
        r2_lin=s.r2,
        r2_median_feature=s.r2_median_feature,
        r2_bulk=s_bulk.r2,
        outlier_sst_share=outlier_share,
        sink_sst_share=share["sink"],
        spike_sst_share=share["spike"],
        outlier_rows=st.heldout["sink"].n + st.heldout["spike"].n,
        outlier_dominated=flagged,
        explained_effective_rank=effective_rank(fit.explained_eigvals.sqrt()),
        output_effective_rank=out_rank,
        input_condition_number=cond,
        input_effective_rank=effective_rank(eig_in.sqrt()),
        input_dynamic_range=st.in_norms.max / median_in if median_in > 0 else float("nan"),
        n_fit=st.fit.n,
        n_heldout=held.n,
        d_in=fit.d_in,
        d_out=fit.d_out,
        damping=fit.damping,
        dead_inputs=fit.dead_inputs,
        warnings=warnings,
    )
    return prof, fit


@dataclass
class Profile:
    """The per-block profile of one model on one calibration set."""

    model: str
    model_type: str
    blocks: list[BlockProfile]
    settings: dict = field(default_factory=dict)
    tool_version: str = ""

    def to_json(self) -> dict:
        return {
            "schema": PROFILE_SCHEMA,
            "tool_version": self.tool_version,
            "model": self.model,
            "model_type": self.model_type,
            "settings": self.settings,
            "blocks": [b.to_json() for b in self.blocks],
        }

    def block(self, index: int) -> BlockProfile:
        for b in self.blocks:
            if b.index == index:
                return b
        raise KeyError(f"block {index} is not in the profile (have {[b.index for b in self.blocks]})")
