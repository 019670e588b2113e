"""Checks of a written file in llama.cpp beyond the float comparison: a size-planned file measured against its
original (the size stage judges it), and a file at its GGUF source's quantization against that source under the
gate's rule.

The llama.cpp measurements go through :mod:`.read` as module attributes (``read.llama_cpp_window_nll``), so
that one replacement of the function there (a test's) reaches every caller."""

from __future__ import annotations

import math
from pathlib import Path

from compressor.output.base import GateMissed, VerificationError, WriteRequest
from compressor.output.gguf import read
from compressor.output.gguf.encode import _CapturedOutput


def load_failure(path: Path) -> str | None:
    """What llama.cpp says when it does not load the GGUF at ``path`` (its error lines), None when it loads it.
    The model alone is loaded (memory-mapped, no context): what every later step of a size plan needs first."""
    import logging

    import llama_cpp

    # llama-cpp-python's log callback prints what this logger's level lets through: all of it, to be captured
    log = logging.getLogger("llama-cpp-python")
    level = log.level
    log.setLevel(logging.DEBUG)
    try:
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0  # a load check: memory-mapped on the host, nothing copied to a device
        with _CapturedOutput() as out:
            model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
            if model:
                llama_cpp.llama_model_free(model)
    finally:
        log.setLevel(level)
    if model:
        return None
    said = [line.strip() for line in out.text.splitlines() if "error" in line.lower() or "failed" in line.lower()]
    return "; ".join(said[-3:]) or out.tail(3) or "no message"


def planned_check(path: Path, request: WriteRequest, options: dict) -> dict:
    """A size-planned file in llama.cpp, measured: its perplexity on every gate domain (``options['gate_domains']``,
    else the probe) against the in-memory original's there (there is no float original of a mixed file to
    match), with its KL from the original (mean, median, 99th and 99.9th percentiles, same top token) where the domain
    carries the original's teacher, and each window's scores (``scores``) for the gate's paired bound. Raises
    :class:`VerificationError` when llama.cpp's perplexity is not finite; the size and the gate are judged by the
    size stage (:mod:`compressor.pipeline.size`), which measures the preset beside it."""
    import llama_cpp

    measured = []
    for d in _gate_domains(request, options):
        scores = read.read_scores(path, d["tokens"], d["seq_len"], d["stride"], d.get("teacher"))
        measured.append(scores.row(d["name"], d.get("reference_ppl", request.expected_ppl)))
    first = measured[0]
    check = {"runtime": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, **read.gguf_summary(path),
             "quant": "plan", "perplexity": first["perplexity"], "scored_tokens": first["scored_tokens"],
             "reference_perplexity": first["reference_perplexity"], "relative_change": first["relative_change"],
             "domains": measured, "file_bytes": path.stat().st_size,
             "passed": all(math.isfinite(d["perplexity"]) for d in measured)}
    if not check["passed"]:
        raise VerificationError(f"llama.cpp check failed: {path.name} has perplexity {first['perplexity']} in "
                                "llama.cpp; nothing was published")
    return check


class GGUFGateMissed(GateMissed):
    """A GGUF at its source's quantization is over the gate in llama.cpp: nothing is published (the pipeline
    reports it as the gate's failure, exit 3; ``check`` is what was measured)."""


def _gate_domains(request: WriteRequest, options: dict) -> list[dict]:
    """Every gate domain to measure on (``options['gate_domains']``), else the verification probe."""
    return options.get("gate_domains") or [
        {"name": "probe", "tokens": request.probe_tokens, "seq_len": request.probe_seq_len,
         "stride": request.probe_stride}]


def source_quant_check(path: Path, request: WriteRequest, options: dict) -> dict:
    """The output against the source GGUF, both in llama.cpp at the source's quantization, on every gate domain:
    the gate's own rule (:func:`~compressor.evaluation.gate.gate_check`) — the upper confidence bound of the
    change (the policy's ``confidence``, one-sided), paired by window, within the policy's perplexity budget
    (:attr:`WriteRequest.gate`, as the recipe gives it) on every domain. Raises :class:`GGUFGateMissed` when it
    is not."""
    from compressor.evaluation.external import window_evaluation
    from compressor.evaluation.gate import gate_budget, gate_check

    source = Path(request.source.path) / request.source.gguf_file
    base, cand, rows = {}, {}, []
    for d in _gate_domains(request, options):
        ref = read.llama_cpp_window_nll(source, d["tokens"], d["seq_len"], d["stride"])
        out = read.llama_cpp_window_nll(path, d["tokens"], d["seq_len"], d["stride"])
        kw = {"name": d["name"], "seq_len": d["seq_len"], "stride": d["stride"]}
        base[d["name"]] = window_evaluation(*ref, **kw)
        cand[d["name"]] = window_evaluation(*out, teacher=ref, **kw)
        rows.append(d["name"])
    rule = request.gate.model_copy(update={"metric": "ppl"})  # llama.cpp gives NLL per window: perplexity
    ok, why, per = gate_check(base, cand, rule)
    domains = [{"name": n, "perplexity": cand[n].ppl, "source_perplexity": base[n].ppl, "windows": cand[n].windows,
                "scored_tokens": cand[n].tokens, **{k: per[n][k] for k in (
                    "relative_delta", "relative_delta_upper", "limit", "passed", "paired", "confidence")}}
               for n in rows]
    first = domains[0]
    out = {"source_perplexity": first["source_perplexity"], "source_relative_change": first["relative_delta"],
           "domains": domains, "confidence": rule.confidence, "budget": gate_budget(rule),
           "budget_mode": rule.budget_mode, "passed": ok}
    if not ok:
        changes = "; ".join(f"{d['name']} {100 * d['relative_delta']:+.2f} % ({d['confidence']:.0%} bound "
                            f"{100 * d['relative_delta_upper']:+.2f} %)" for d in domains)
        raise GGUFGateMissed(
            f"llama.cpp check failed: {path.name} against the source GGUF at the same quantization: {changes}; "
            f"{why}. Nothing was published; lower policy.ppl_budget to leave room for the runtime, or set "
            "output.gguf_quant: q8_0 or f16", out)
    return out
