"""``hybrid``: keep ``k`` hidden units plus an affine bypass, ``y = D_K h_K + A x + b``,
all solved jointly in closed form."""

from __future__ import annotations

from compressor.fitting.kinds.base import register
from compressor.fitting.kinds.hidden import HiddenUnitKind


@register
class Hybrid(HiddenUnitKind):
    name = "hybrid"
    format = "compressor.kind.hybrid/v1"
    bypass = True
