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
    from compressor.engine.cache import human_bytes
    from compressor.reports.card import planned_check

    ppl = r["perplexity"]
    kept = [d["index"] for d in r["blocks"] if d["decision"] == "kept"]
    print(f"status: {r['status']} — {r['message']}")
    fmt, planned = planned_check(r)
    if fmt is not None:  # output.size: the file is what was gated, where it runs
        _print_size_plan(r, fmt, planned)
        if output is not None:
            print(f"model:  {output / 'model.gguf' if fmt == 'gguf' else output}")
            print(f"report: {output / 'report.json'}")
        return
    if r["status"] == "rejected" and not kept:
        # nothing is replaced: the gate's lines would describe the original model ("+0.00 % — within
        # budget"); what was tried and what it cost is in the message above
        print(f"perplexity: {ppl['baseline']['ppl']:.4f}, the original's: nothing replaced, no model written "
              f"({ppl['final']['tokens']} tokens, window {ppl['final']['seq_len']})")
        return
    print(f"perplexity: {ppl['baseline']['ppl']:.4f} → {ppl['final']['ppl']:.4f} (gate limit {ppl['budget']:.4f}, "
          f"{ppl['final']['tokens']} tokens, window {ppl['final']['seq_len']}, stride {ppl['final']['stride']})")
    ev = r.get("evaluation") or {}
    for d in ev.get("domains", []):
        if d.get("relative_delta_upper") is None:
            continue
        print(_gate_line(d, ev["confidence"], ev.get("headroom") or 0.0))
    print(f"parameters: {r['params']['before']:,} → {r['params']['after']:,} (blocks replaced: {kept})")
    size = r.get("size") or {}
    agree = r.get("agreement") or {}
    if agree.get("next_token") is not None:
        c = agree.get("continuations")
        print(f"greedy agreement with the original: {agree['next_token']:.1%} of next tokens" + (
              f"; {c['identical']:.0%} of {c['prompts']} continuations of {c['tokens']} tokens identical "
              f"({c['matching_prefix']:.0%} of tokens before the first difference)" if c else ""))
    for row in (r.get("tasks") or {}).get("tasks", []):
        print(f"task {row['task']}: {row['metric']} {_num(row['original'])} → {_num(row['compressed'])}"
              + (f" (±{row['stderr']:.4f})" if row.get("stderr") is not None else ""))
    if output is not None and size:
        same = size.get("like_with_like")
        if same:  # like with like first: the same quantization on both sides
            print(f"size: {human_bytes(same['output_bytes'])} against the source's {human_bytes(same['source_bytes'])} "
                  f"({same['ratio']:.3f}x; {same['what']})")
        gguf = (r.get("verification") or {}).get("gguf") or {}
        if gguf.get("source_perplexity") is not None:
            print(f"llama.cpp: perplexity {gguf['perplexity']:.4f} against the source GGUF's "
                  f"{gguf['source_perplexity']:.4f} ({100 * gguf['source_relative_change']:+.2f} %, same windows)")
        elif size.get("gguf_bytes") is not None:
            q = gguf.get("quantization_change")
            note = (f", {100 * q:+.2f} % against the float model: quantizing costs this, not judged"
                    if gguf.get("compared_with") is None and q is not None else "")
            print(f"gguf: {human_bytes(size['gguf_bytes'])} ({gguf.get('file_type', '?')}; llama.cpp perplexity "
                  f"{gguf.get('perplexity', float('nan')):.4f}{note})")
        wrote_hf = size.get("output_bytes") is not None
        if wrote_hf and (not same or "Hugging Face" not in same["what"]):
            source = "GGUF file" if r["model"]["resolved"].endswith(".gguf") else "weights"
            print(f"Hugging Face folder: {human_bytes(size.get('output_bytes'))} of {size.get('output_dtype')} weights "
                  f"(source {source}: {human_bytes(size.get('source_bytes'))}, another format)")
    if output is not None:
        print(f"model:  {output}")
        print(f"report: {output / 'report.json'}")


def _gate_line(d: dict, confidence: float, headroom: float = 0.0) -> str:
    """One domain's gate: its change and bound, on the search's windows and on the held-out
    confirmation windows when the run kept some (``policy.confirm_fraction``), against the limit the
    bound is held to (the budget less ``headroom``)."""
    kl = d.get("metric") == "kl"

    def bound(row: dict) -> str:
        if kl:
            return f"KL {row['kl']:.4f}, {confidence:.0%} bound {row['kl_upper']:.4f}"
        return f"{row['relative_delta']:+.2%}, {confidence:.0%} bound {row['relative_delta_upper']:+.2%}"

    from compressor.evaluation.gate import headroom_note

    limit = (f"{d['limit']:.4f}" if kl else f"{d['limit'] / d['baseline_ppl'] - 1:+.2%}") + headroom_note(headroom)
    verdict = "within" if d["passed"] else "over"
    if d.get("confirmation") is None:
        return f"gate [{d['name']}]: {bound(d)} vs {limit} over {d['windows']} windows — {verdict} budget"
    s, c = d["search"], d["confirmation"]
    return (f"gate [{d['name']}]: search {bound(s)} over {s['windows']} windows; confirmation {bound(c)} over "
            f"{c['windows']} held-out windows; vs {limit} — {verdict} budget")


def _num(v) -> str:
    return "—" if v is None else f"{v:.4f}"




def _print_size_plan(r: dict, fmt: str, gguf: dict) -> None:
    """``output.size``: the planned file beside the anchor of that size (llama.cpp's preset; the uniform
    scheme), same windows, per domain."""
    from compressor.engine.cache import human_bytes

    plan = r.get("size_plan") or {}
    types = ", ".join(f"{t} ×{n}" for t, n in plan.get("types_used", {}).items())
    where = "llama.cpp" if fmt == "gguf" else "transformers"
    print(f"{fmt}: {human_bytes(gguf['file_bytes'])} (budget {human_bytes(gguf['budget_bytes'])}, output.size "
          f"{plan.get('size')}); {'tensor types' if fmt == 'gguf' else 'layer schemes'}: {types}")
    search = plan.get("search")
    if search:  # output.size: smallest — the plans the gate measured, smallest first
        tried = ", ".join(f"{a['file_bytes'] / 1e6:.1f} MB {'passed' if a['passed'] else 'over'}"
                          for a in search["attempts"])
        print(f"smallest within the budget: planned for a predicted {100 * search['target_predicted_ppl_change']:+.2f} "
              f"%; files measured: {tried}")
    preset, best = gguf.get("preset"), gguf.get("best_preset")
    called = (preset.get("called") or f"llama.cpp's {preset['name']}") if preset else ""
    anchor = (f"{called} from the same F16" if fmt == "gguf" else f"the uniform {preset['name']} checkpoint"
              ) if preset else ""
    print(f"predicted: {100 * gguf['predicted_relative_change']:+.2f} % perplexity"
          + (f"; beside it: {anchor}, {human_bytes(preset['file_bytes'])}" if preset else ""))
    for d in gguf.get("domains", []):
        bound = (f" ({d['confidence']:.0%} bound {100 * d['relative_delta_upper']:+.2f} %)"
                 if d.get("relative_delta_upper") is not None else "")
        tail = f", p99.9 {d['kl_p999']:.3f}" if d.get("kl_p999") is not None else ""
        kl = (f"; KL {d['kl_mean']:.4f} (p99 {d['kl_p99']:.3f}{tail}), same top token {d['same_top_token']:.1%}"
              if d.get("kl_mean") is not None else "")
        beside = f" | {preset['name']}: {100 * d['preset_relative_change']:+.2f} %" if preset else ""
        if preset and d.get("preset_kl_mean") is not None:
            beside += f", KL {d['preset_kl_mean']:.4f}"
        if best and d.get("best_preset_relative_change") is not None:  # a smaller preset that is better here
            beside += f" | {best['name']}: {100 * d['best_preset_relative_change']:+.2f} %"
            beside += f", KL {d['best_preset_kl_mean']:.4f}" if d.get("best_preset_kl_mean") is not None else ""
        print(f"{where} [{d['name']}]: perplexity {d['perplexity']:.4f}, {100 * d['relative_change']:+.2f} %{bound} "
              f"against the original's {d['reference_perplexity']:.4f}{kl}{beside}")
    if best:
        print(f"better of no more bytes: {best['called']}, {human_bytes(best['file_bytes'])}; the gate compares "
              "with it")
    if gguf.get("gate_rule") == "preset":
        print(f"gate: over the default budget, written as at least as good as {best['called'] if best else anchor} "
              "on every domain (set policy.ppl_budget in the recipe to hold the file to it)")


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
