"""``prune``: keep ``k`` hidden units, re-solve the down projection in closed form (no bypass)."""

from __future__ import annotations

from compressor.fitting.kinds.base import register
from compressor.fitting.kinds.hidden import HiddenUnitKind


@register
class Prune(HiddenUnitKind):
    name = "prune"
    format = "compressor.kind.prune/v1"
    bypass = False
    snaps = True
