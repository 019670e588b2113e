"""Replacement kinds: one module each, registered by name (see :mod:`.base`)."""

from compressor.fitting.kinds import affine, hybrid, low_rank, prune  # noqa: F401  (registers the kinds)
from compressor.fitting.kinds.base import KINDS, BlockData, Fitted, Kind, Level, get_kind, register

__all__ = ["KINDS", "BlockData", "Fitted", "Kind", "Level", "get_kind", "register"]
