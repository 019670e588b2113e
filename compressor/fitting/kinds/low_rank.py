"""``low_rank``: closed-form reduced-rank regression ``y = U (V x) + b`` (Izenman 1975)."""

from __future__ import annotations

from compressor.fitting.solve import affine_params, fit_r2_at_rank, low_rank, rank_for_fraction, score
from compressor.core.params import count_params
from compressor.fitting.kinds.base import BlockData, Fitted, Kind, Level, register


@register
class LowRank(Kind):
    name = "low_rank"
    format = "compressor.kind.low_rank/v1"

    def levels(self, data: BlockData, cfg) -> list[Level]:
        f = data.affine()
        top = min(data.d, data.d_out)
        ranks = sorted({max(1, round(top * q / 16)) for q in range(1, 17)}, reverse=True)
        out = []
        for r in ranks:
            lr = low_rank(f, data.fit, r)
            out.append(Level(r, affine_params(data.d, data.d_out, r), 1.0 - score(data.heldout, lr.W, lr.b).r2))
        return out

    def default_level(self, data: BlockData, cfg) -> int:
        f = data.affine()
        top = min(data.d, data.d_out)
        if cfg.rank is not None:
            return min(cfg.rank, top)
        if cfg.rank_fraction is not None:
            return rank_for_fraction(f, cfg.rank_fraction)
        budget = cfg.max_params_fraction * count_params(data.ffn)
        fits = [r for r in range(1, top + 1) if affine_params(data.d, data.d_out, r) <= budget]
        return max(fits) if fits else 1

    def fit(self, data: BlockData, cfg, size: int) -> Fitted:
        f = data.affine()
        lr = low_rank(f, data.fit, size)
        return Fitted(
            kind=self.name, index=data.index,
            config={"in_features": data.d, "out_features": data.d_out, "rank": size},
            tensors={"down.weight": lr.A.T, "up.weight": lr.B.T, "up.bias": lr.b},
            params=affine_params(data.d, data.d_out, size), heldout_r2=score(data.heldout, lr.W, lr.b).r2,
            warnings=list(f.warnings) + [f"fit-row R² at rank {size}: {fit_r2_at_rank(f, size):.4f}"],
        )
