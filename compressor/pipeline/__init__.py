"""The public verbs: :func:`run` (a whole recipe, as named stages) and :func:`profile`."""

from compressor.pipeline.profiler import profile, write_profile
from compressor.pipeline.runner import RunResult, run

__all__ = ["RunResult", "profile", "run", "write_profile"]
