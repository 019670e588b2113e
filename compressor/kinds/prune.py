"""``prune``: keep ``k`` hidden units, re-solve the down projection in closed form (no bypass)."""

from __future__ import annotations

from .base import register
from .hidden import HiddenUnitKind


@register
class Prune(HiddenUnitKind):
    name = "prune"
    format = "compressor.kind.prune/v1"
    bypass = False
