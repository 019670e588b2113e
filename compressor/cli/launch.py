"""``compressor launch``: a command on several ranks of this machine, exiting with the run's own exit code
(``torchrun`` exits 1 with its traceback whatever the ranks' codes: :func:`compressor.core.distributed.launch`)."""

from __future__ import annotations

import argparse


def add_parsers(sub) -> None:
    p = sub.add_parser("launch", help="run a command on several ranks (torchrun), exiting with the run's code",
                       description="`compressor launch --nproc-per-node 2 run recipe.yaml` runs `compressor run "
                       "recipe.yaml` on 2 ranks of this machine as `torchrun --standalone --nproc-per-node 2 -m "
                       "compressor run recipe.yaml` does (docs/distributed.md), and exits with the run's exit code "
                       "(2 bad input, 3 gate, …), which torchrun itself reports as 1. Several machines: torchrun "
                       "on each, as usual.")
    p.add_argument("--nproc-per-node", type=int, required=True, metavar="N", help="ranks on this machine")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the compressor command and its arguments")
    p.set_defaults(handler=handle, heavy=False, quiet=False, verbose=False)


def handle(args) -> int:
    import sys

    if args.nproc_per_node < 1 or not args.command:
        what = "--nproc-per-node must be at least 1" if args.nproc_per_node < 1 else "no command given"
        print(f"error: {what}; e.g. compressor launch --nproc-per-node 2 run recipe.yaml", file=sys.stderr)
        return 2
    from compressor.core.distributed import launch

    return launch(args.nproc_per_node, list(args.command))
