"""``compressor`` command line: a thin layer over the public verbs.

One module per command family (:mod:`.profile`, :mod:`.run`, :mod:`.cache`),
each with ``add_parsers(sub)`` that adds its sub-commands and sets
``handler``; a new command is a new module named in :data:`COMMANDS`.

Logs go to stderr; stdout gets a short summary. Exit codes: 0 success,
1 runtime error, 2 invalid recipe or input, 3 perplexity gate failed, 130 interrupted (Ctrl-C),
143 terminated (SIGTERM, which unwinds the run as Ctrl-C does: :mod:`compressor.core.signals`).
Nothing heavy (torch, transformers) is imported until a command needs it, so
``compressor --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from compressor.cli.common import launched_rank, logger, setup_logging

#: Modules that add sub-commands, in the order ``--help`` lists them.
COMMANDS = ("compressor.cli.profile", "compressor.cli.run", "compressor.cli.export", "compressor.cli.cache",
            "compressor.cli.analyze", "compressor.cli.launch")


def build_parser() -> argparse.ArgumentParser:
    from compressor.core.version import __version__

    parser = argparse.ArgumentParser(
        prog="compressor",
        description="Measure how linear each FFN block is (held-out R²_lin), replace near-linear blocks with "
        "closed-form affine maps, validate perplexity, save a loadable checkpoint.",
    )
    parser.add_argument("--version", action="version", version=f"compressor {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(name).add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Under a launcher only rank 0 talks: the other ranks show warnings and errors, no progress bars.
    setup_logging(args.quiet or launched_rank() != 0, args.verbose, heavy=getattr(args, "heavy", True))
    if not getattr(args, "heavy", True):  # e.g. `compressor cache info`: no torch, no error mapping needed
        return args.handler(args)
    from compressor.core.distributed import RankFailed
    from compressor.core.errors import (EXIT_ERROR, EXIT_GATE, EXIT_INVALID, INVALID_INPUT_ERRORS, GateFailed,
                                        NonFiniteActivationError, exit_code_for, stop_name)
    from compressor.core.signals import stop_signals_raise

    try:
        with stop_signals_raise():  # SIGTERM (timeout, docker, Slurm) cleans up as Ctrl-C does
            return args.handler(args)
    except RankFailed as e:  # rank 0 failed while writing and printed why; exit as it does
        return _said(e.exit_code, str(e), shared=True)
    except INVALID_INPUT_ERRORS as e:  # every rank reads the same recipe and inputs: rank 0 says it
        return _said(EXIT_INVALID, f"error: {e}", shared=True)
    except NonFiniteActivationError as e:
        return _said(EXIT_ERROR, f"error: {e}")
    except GateFailed as e:  # every rank reaches the same verdict
        return _said(EXIT_GATE, f"gate failed: {e}", shared=True)
    except KeyboardInterrupt as stop:
        print(stop_name(stop), file=sys.stderr)
        return exit_code_for(stop)
    except Exception as e:  # noqa: BLE001 - the CLI turns every failure into an exit code
        if args.verbose:
            logger.exception("failed")
        return _said(EXIT_ERROR, f"error: {type(e).__name__}: {e}")


def _said(code: int, message: str, *, shared: bool = False) -> int:
    """``message`` on stderr, and ``code`` to exit with. Under a launcher a failure every rank shares (bad input,
    the gate's verdict, rank 0's failure relayed) is said by rank 0 alone, one of a rank's own by that rank,
    named; each rank records it for torchrun's report (:func:`~compressor.core.distributed.record_failure`)."""
    from compressor.core.distributed import record_failure

    rank = launched_rank()
    if rank == 0 or not shared:
        print(message if rank == 0 else f"rank {rank}: {message}", file=sys.stderr)
    record_failure(code, message)
    return code




__all__ = ["COMMANDS", "build_parser", "main"]
