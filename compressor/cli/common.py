"""What every command shares: logging setup, common flags, recipe-mirroring options."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing

logger = logging.getLogger("compressor")

EXIT_CODES_EPILOG = """exit codes:
  0  success: the model and report.json are written
  1  runtime error (message on stderr; --verbose for the traceback); also when the
     model was published but --report could not be written afterwards
  2  invalid recipe or input (unknown key, wrong type, missing/empty/non-UTF-8 data
     file, corrupt checkpoint, unsafe or non-empty output, unwritable --report,
     --resume with no saved state or one of a different model/data/recipe…):
     detected before anything is written
  3  perplexity gate failed: nothing is written (the --report file still is)
  130  interrupted (Ctrl-C); 143  terminated (SIGTERM: timeout, docker, Slurm),
     cleaned up as Ctrl-C is (docs/exit-codes.md)
"""


def launched_rank() -> int:
    """The rank a launcher (torchrun, accelerate launch) gave this process; 0 without one."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def setup_logging(quiet: bool, verbose: bool, heavy: bool = True) -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose else logging.INFO)
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s", force=True)
    if quiet:
        os.environ["TQDM_DISABLE"] = "1"
    if not heavy:  # e.g. `compressor cache info`: no need to import transformers
        return
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        if quiet:
            transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass
    if quiet:
        try:
            import datasets

            datasets.disable_progress_bars()
        except ImportError:
            pass


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true", help="only warnings and errors on stderr; no progress bars")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging and tracebacks")


def add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a recipe field, e.g. --set policy.threshold=0.95 (repeatable)")


def recipe_option(p: argparse.ArgumentParser, flag: str, section, name: str, **kwargs) -> None:
    """An option mirroring recipe field ``section.name``: its help, choices and
    default come from the recipe schema, so the CLI and recipes cannot drift."""
    field = section.model_fields[name]
    if typing.get_origin(field.annotation) is typing.Literal:
        kwargs.setdefault("choices", typing.get_args(field.annotation))
    kwargs.setdefault("default", field.default)
    text = (field.description or name.replace("_", " ")).replace("%", "%%")
    p.add_argument(flag, help=f"{text} (default: {field.default})", **kwargs)


