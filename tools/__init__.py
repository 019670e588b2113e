"""Benchmarks and checks of compressor, grouped by what they measure (``tools/README.md``); not installed.

Each tool runs as a file from the repository root (``python tools/GROUP/NAME.py --help``) and imports the
shared harness as ``tools.benchlib``; its results are JSON files in ``tools/GROUP/results/``.
"""
