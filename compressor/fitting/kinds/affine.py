"""``affine``: the whole FFN becomes one exact least-squares map ``y = W x + b``."""

from __future__ import annotations

from compressor.fitting.solve import affine_params, score
from compressor.fitting.kinds.base import BlockData, Fitted, Kind, Level, register


@register
class Affine(Kind):
    name = "affine"
    format = "compressor.kind.affine/v1"

    def levels(self, data: BlockData, cfg) -> list[Level]:
        f = data.affine()
        return [Level(0, affine_params(data.d, data.d_out), 1.0 - score(data.heldout, f.W, f.b).r2)]

    def default_level(self, data: BlockData, cfg) -> int:
        return 0

    def fit(self, data: BlockData, cfg, size: int = 0) -> Fitted:
        f = data.affine()
        return Fitted(
            kind=self.name, index=data.index, config={"in_features": data.d, "out_features": data.d_out},
            tensors={"proj.weight": f.W.T, "proj.bias": f.b}, params=affine_params(data.d, data.d_out),
            heldout_r2=score(data.heldout, f.W, f.b).r2, warnings=list(f.warnings),
        )
