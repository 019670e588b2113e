"""The tool's version, at the bottom of the package so every layer may read it."""

__version__ = "0.1.0"
