"""``compressor run`` / ``compress`` / ``validate``: a recipe, from a YAML file or from flags."""

from __future__ import annotations

import argparse
import json
import sys

from compressor.cli.common import EXIT_CODES_EPILOG, add_common, add_overrides, recipe_option


def add_parsers(sub) -> None:
    from compressor.recipe.schema import (
        REPLACEMENT_CONFIGS, CalibrationConfig, LowRankReplacement, PolicyConfig,
    )

    p = sub.add_parser("compress", help="profile, select, replace, validate and save (recipe fields from flags)",
                       epilog=EXIT_CODES_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="hub id, local folder, .gguf file, or pkg:PACKAGE")
    p.add_argument("--output", "-o", required=True, help="output folder for the compressed model")
    recipe_option(p, "--data", CalibrationConfig, "dataset")
    p.add_argument("--eval-data", default=None,
                   help="evaluation text the gate holds on: 'embedded', 'embedded-code', 'self' (the model's own "
                   "writing), a file, a save_to_disk folder or a hub dataset (default: prose, code and the model's own "
                   "writing; see docs/gate.md)")
    # None = not given: the recipe default applies (shown in the help).
    recipe_option(p, "--threshold", PolicyConfig, "threshold", type=float, default=None)
    recipe_option(p, "--ppl-budget", PolicyConfig, "ppl_budget", type=float, default=None)
    p.add_argument("--kind", choices=list(REPLACEMENT_CONFIGS), default=None,
                   help="replacement kind: affine, low_rank, prune, hybrid (default: affine)")
    recipe_option(p, "--rank", LowRankReplacement, "rank", type=int, default=None)
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier compressor output in the output folder (other non-empty folders are refused)",
    )
    p.add_argument("--no-cache", action="store_true",
                   help="measure again without reading the statistics cache (profile statistics, a size run's prices)")
    p.add_argument("--report", default=None, help="also write report.json here")
    add_overrides(p)
    add_common(p)
    p.set_defaults(handler=handle)

    p = sub.add_parser("run", help="run a YAML recipe", epilog=EXIT_CODES_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/smollm2-135m.yaml")
    p.add_argument("--output", "-o", default=None, help="output folder (overrides output.path)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier compressor output in the output folder (other non-empty folders are refused)",
    )
    p.add_argument("--dry-run", action="store_true", help="validate and print the resolved plan; load nothing")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run of this recipe and output from its saved state (same result as an "
                   "uninterrupted run); refused when the model, data, recipe or tool version differ, except that "
                   "a change to the policy's gate settings alone keeps the measurements and reruns the gate")
    p.add_argument("--keep-state", action="store_true",
                   help="keep the run state (measurements: pass A statistics, loss gradients, baseline) when the run "
                   "ends, for later runs at other budgets (--measurements-from); it can take tens of GB")
    p.add_argument("--measurements-from", default=None, metavar="OUTPUT",
                   help="start from the measurements an earlier run of this recipe kept (--keep-state) for output "
                   "folder OUTPUT; only the policy's gate settings (ppl_budget, ffn_keep, …) may differ")
    p.add_argument("--no-cache", action="store_true",
                   help="measure again without reading the statistics cache (profile statistics, a size run's prices)")
    p.add_argument("--report", default=None, help="also write report.json here (also written when the gate fails)")
    add_overrides(p)
    add_common(p)
    p.set_defaults(handler=handle)

    p = sub.add_parser("validate", help="check a YAML recipe without loading anything")
    p.add_argument("recipe", help="YAML recipe to check")
    p.add_argument("--output", "-o", default=None, help="output folder to check (overrides output.path)")
    add_overrides(p)
    add_common(p)
    p.set_defaults(handler=handle)



def _recipe_from_args(args):
    from compressor.recipe import apply_overrides, load_recipe, recipe_from_dict

    if args.command == "compress":
        data = {"model": {"source": args.model}, "calibration": {"dataset": args.data}, "output": {"path": args.output}}
        if args.eval_data is not None:  # else the default domains, prose and code
            data["evaluation"] = {"dataset": args.eval_data}
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
    if getattr(args, "output", None) is not None:
        extra.append(f"output.path={json.dumps(_flag_path(args.output, '--output'))}")
    if getattr(args, "overwrite", False):
        extra.append("output.overwrite=true")
    return load_recipe(args.recipe, extra)


def handle(args) -> int:
    from compressor.inputs.validate import run_reads

    recipe = _recipe_from_args(args)
    report_path = None
    if getattr(args, "report", None):
        from compressor.core.errors import RecipeError
        from compressor.inputs.safety import OutputError, check_report_path

        try:  # before anything is loaded: a bad --report must not cost a whole run
            report_path = check_report_path(args.report, reads=run_reads(recipe))
        except OutputError as e:
            raise RecipeError(str(e)) from None
    if args.command == "validate" or getattr(args, "dry_run", False):
        from compressor.pipeline.stages import preflight

        # every check run makes before the model loads, so validate and run agree
        preflight(recipe, output_required=args.command != "validate")
        if args.command == "validate":
            print(f"recipe OK: {args.recipe}")
        else:
            print(recipe.to_yaml(), end="")  # the plan names what will be written (the formats filled in)
        return 0
    from compressor.core.distributed import init_from_env, is_main
    from compressor.core.errors import EXIT_GATE, EXIT_OK, GateFailed
    from compressor.pipeline.runner import oneshot

    init_from_env(recipe.model.device)  # under torchrun / accelerate launch: join the process group
    try:
        res = oneshot(recipe.model.source, recipe, output_dir=recipe.output.path,
                      use_cache=False if args.no_cache else None, resume=getattr(args, "resume", False),
                      keep_state=getattr(args, "keep_state", False),
                      measurements_from=getattr(args, "measurements_from", None))
        report, output, code = res.report, res.output, EXIT_OK
    except GateFailed as failed:  # nothing was written; the report says why
        report, output, code = failed.report, None, EXIT_GATE
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (compressor.core.signals)
        from compressor.core.errors import exit_code_for

        if not is_main():
            raise
        print(_stopped_message(recipe, stop, cache=recipe.measure.cache and not args.no_cache), file=sys.stderr)
        return exit_code_for(stop)
    if not is_main():  # rank 0 prints and writes
        return code
    _print_summary(report, output)
    if report_path is not None:
        try:
            report_path.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as e:
            published = f"the model was published at {output}, but " if output is not None else ""
            print(f"error: {published}the report could not be written to {report_path}: {e}", file=sys.stderr)
            return 1
    return code


def _stopped_message(recipe, stop: KeyboardInterrupt, *, cache: bool) -> str:
    """What a stopped run left and how to go on: a size run starts over (it records nothing to resume: its
    statistics are measured again, and its work folder is gone); a structural run with finished steps kept
    resumes from them."""
    from compressor.core.errors import stop_name
    from compressor.engine.runstate import state_dir

    what = stop_name(stop)
    if recipe.output.size is not None:
        cached = (" (unless an earlier run of this model and calibration text stored its prices in the statistics "
                  "cache, measure.cache)" if cache else "")
        return (f"{what}: nothing was written, and the size run's work folder and staging folder were removed. "
                "A size run does not resume: its statistics are not kept, so run the same command again, without "
                f"--resume, to start over; the statistics are measured again{cached}")
    kept = state_dir(recipe.output.path)
    if kept.is_dir() and any(kept.iterdir()):
        return (f"{what}: the finished steps are kept in {kept}; run the same command with --resume to "
                "continue where it stopped (the result is the same as an uninterrupted run)")
    return f"{what}: nothing was written"


def _print_summary(r: dict, output) -> None:
    """What the report says of the run (:meth:`compressor.reports.schema.Report.summary_lines`), printed."""
    from compressor.output.registry import formats
    from compressor.reports.schema import Report

    formats()  # every format's words registered (compressor.reports.wording)
    for line in Report.of(r).summary_lines(output):
        print(line)


def _flag_path(value: str, flag: str) -> str:
    """A path given on the command line: not empty, and text that a recipe can hold."""
    from compressor.core.errors import RecipeError

    if not value.strip():
        raise RecipeError(f"{flag}: empty; give a folder, e.g. {flag} out/model")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RecipeError(f"{flag}: the path {value.encode('utf-8', 'surrogateescape')!r} is not valid UTF-8; "
                          "choose a name in UTF-8") from None
    return value
