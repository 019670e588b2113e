"""Optional extras: which are installed, and the refusal (exit 2) that names the install line.

The bottom layer (it imports only :mod:`compressor.core.errors`), so the input checks and the
stages that use an extra ask the same question the same way."""

from __future__ import annotations

import importlib.util

from compressor.core.errors import MissingExtraError

#: module → the install line of the extra that provides it
EXTRAS = {"lm_eval": "pip install 'compressor[eval]'  (lm-evaluation-harness)"}


def have(module: str) -> bool:
    """Is ``module`` importable here (without importing it)?"""
    return importlib.util.find_spec(module) is not None


def require(module: str, what: str) -> None:
    """Raise :class:`MissingExtraError` naming ``what`` needs ``module`` and how to install it."""
    if not have(module):
        raise MissingExtraError(f"{what} needs {module}, which is not installed; install it with "
                                f"{EXTRAS.get(module, 'pip install ' + module)}")
