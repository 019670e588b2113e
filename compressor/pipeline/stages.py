"""The named stages of :func:`compressor.run`, in order (the checks in :mod:`.preflight`, writing and publishing in
:mod:`.writing`, the rest here; every stage is importable from here):

check inputs → load → calibrate → compress → report → write → verify → publish.

Each stage is one function that takes what it needs (its config section and
the previous stages' products) and returns what the next ones need. Input
problems surface as :class:`~compressor.core.errors.InputError` (exit 2), as
early as they can be known: everything :func:`check` finds, it finds before
the model loads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from compressor.core import distributed as dist
from compressor.core.archs import arch_for
from compressor.core.errors import EXIT_GATE, InputError, UnsupportedModelError
from compressor.core.finite import check_weights_finite
from compressor.engine.records import ResumeError
from compressor.inputs.calibration import DataInput, build_calibration, self_evaluation_domains, self_evaluation_streams
from compressor.inputs.data import CalibrationSet, OverlapError, check_disjoint
from compressor.inputs.load import ResolvedSource, load_model, object_source, resolve_source  # noqa: F401
from compressor.output import VerificationError
from compressor.output.hf import source_weight_bytes
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import ModelConfig, Recipe
from compressor.reports.report import build_report, evaluation_report
from compressor.pipeline.formats import writer_options  # noqa: F401
from compressor.pipeline.preflight import (  # noqa: F401  (the stages, in one place for the runner and tests)
    Preflight, check, default_formats, output_grid, preflight, workflow_for,
)
from compressor.pipeline.products import Calibrated, Checked, Loaded  # noqa: F401
from compressor.pipeline.writing import (  # noqa: F401
    compression_section, gate_domains, like_with_like, output_sizes, publish_output, remove_tree, save_dtype,
    verify, write, write_request,
)

logger = logging.getLogger(__name__)


def load(mc: ModelConfig) -> Loaded:
    """Load the model and tokenizer; refuse corrupt weights and architectures that cannot be compressed."""
    model, tokenizer, src = load_model(
        mc.source, gguf_file=mc.gguf_file, dtype=mc.dtype, device=mc.device, offload=mc.offload,
        trust_remote_code=mc.trust_remote_code, revision=mc.revision,
    )
    return _loaded(model, tokenizer, src)


def from_object(model: nn.Module, tokenizer) -> Loaded:
    """A model object handed in (:func:`compressor.oneshot`) in place of :func:`load`: used as it is
    (its dtype and placement, ``device_map`` included); the same refusals as a loaded one."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise InputError(f"model: expected a transformers PreTrainedModel (e.g. from "
                         f"AutoModelForCausalLM.from_pretrained) or a source string, got {type(model).__name__}")
    src = object_source(model)
    if tokenizer is None:
        if src.path == "in-memory":
            raise InputError("tokenizer: required with a model object that names no checkpoint; pass "
                             "tokenizer=AutoTokenizer.from_pretrained(...)")
        from compressor.inputs.load import load_tokenizer as load_source_tokenizer

        tokenizer = load_source_tokenizer(src)
    if not getattr(model.config, "architectures", None):
        # a model built from a config names none; save_pretrained writes its class there (and llama.cpp's converter
        # picks its model by it), so the checks before anything is measured see what the saved folder will say
        model.config.architectures = [type(model).__name__]
    model.eval()
    return _loaded(model, tokenizer, src)


def _loaded(model: nn.Module, tokenizer, src: ResolvedSource) -> Loaded:
    check_weights_finite(model)
    try:
        model_type, spec = arch_for(model, structural=False)  # a structural MoE run is refused before loading
    except UnsupportedModelError as e:
        raise InputError(str(e)) from None
    if not spec.causal_lm:
        raise InputError(
            f"{model_type} models are profile-only ({spec.note}); `compress` refuses them. Use `compressor profile`."
        )
    return Loaded(model, tokenizer, src, model_type, spec)


def check_loaded(recipe: Recipe, loaded: Loaded) -> None:
    """What needs the model's shape but no calibration: blocks named by the policy exist, and some are left."""
    from compressor.core.archs import find_blocks

    _, blocks = find_blocks(loaded.model, loaded.spec)
    n = len(blocks)
    pol = recipe.policy
    for name, given in (("policy.include", pol.include), ("policy.exclude", pol.exclude)):
        bad = sorted(i for i in given if i >= n)
        if bad:
            raise InputError(f"{name}: block(s) {bad} do not exist; this model has {n} blocks (0..{n - 1})")
    if set(range(n)) <= set(pol.exclude):
        raise InputError(f"policy.exclude names every block (0..{n - 1}): nothing is left to compress; "
                         "exclude fewer blocks")


def expect(recipe: Recipe, loaded: Loaded, *, use_cache: bool, checked: Checked | None = None) -> str | None:
    """Say how long the run is expected to take (logged; see :mod:`.estimate`). Returns the model's
    fingerprint when it was needed to look up cached calibration text (the calibration reuses it)."""
    from compressor.engine.cache import model_fingerprint
    from compressor.fitting.kinds import get_kind
    from compressor.pipeline.estimate import say_estimate

    writes = recipe.calibration.writes_self() or self_evaluation_domains(recipe)
    fp = model_fingerprint(loaded.model) if writes and use_cache and dist.is_main() else None
    if dist.is_main():
        cached, to_write = _text_to_write(recipe, loaded, fp)
        say_estimate(
            recipe,
            loaded.model,
            self_text_cached=cached,
            hidden=get_kind(recipe.replacement.kind).needs_hidden,
            recorded=checked.state.recorded() if checked is not None else None,
            self_eval_tokens=to_write,
        )
    return fp


def _text_to_write(recipe: Recipe, loaded: Loaded, fp: str | None) -> tuple[bool, int]:
    """Whether the self-written calibration text is in the cache, and how many tokens of ``self`` evaluation
    text are not (``fp``: the model's fingerprint; None: no cache, everything is written)."""
    from compressor.inputs.calibration import self_evaluation_settings, self_settings
    from compressor.inputs.selfcal import is_cached

    written = self_evaluation_domains(recipe)
    if fp is None:
        return False, sum(e.max_tokens for e in written)
    tok, vocab = loaded.tokenizer, loaded.model.get_input_embeddings().weight.shape[0]
    cal_cached = not recipe.calibration.writes_self() or is_cached(fp, tok, self_settings(recipe))
    return cal_cached, sum(e.max_tokens for e in written
                           if not is_cached(fp, tok, self_evaluation_settings(recipe, e, tok, vocab)))


def self_evaluation(recipe: Recipe, loaded: Loaded, checked: Checked, *, use_cache: bool,
                    model_fp: str | None = None) -> float:
    """Write the ``self`` evaluation domains' text with the original model (before anything is replaced) into
    ``checked.eval_streams``, in the recipe's domain order; returns the seconds it took."""
    t0 = time.perf_counter()
    streams = {**checked.eval_streams,
               **self_evaluation_streams(recipe, loaded.model, loaded.tokenizer, use_cache, model_fp)}
    checked.eval_streams = {e.domain_name(): streams[e.domain_name()] for e in recipe.evaluation_domains()}
    return time.perf_counter() - t0


def calibrate(recipe: Recipe, loaded: Loaded, checked: Checked, *, use_cache: bool,
              model_fp: str | None = None) -> Calibrated:
    """The text the model writes (the ``self`` evaluation domains, :func:`self_evaluation`; self-written
    calibration), then the calibration windows, checked disjoint from the evaluation text."""
    written_s = self_evaluation(recipe, loaded, checked, use_cache=use_cache, model_fp=model_fp)
    t0 = time.perf_counter()
    with DataInput("calibration.dataset"):
        cal, info = build_calibration(recipe, loaded.model, loaded.tokenizer, use_cache, model_fp)
    info["calibration_s"] = time.perf_counter() - t0
    if self_evaluation_domains(recipe):
        info["self_evaluation_s"] = written_s
    try:
        overlap = check_disjoint(cal, checked.eval_streams)
        checked.state.bind_calibration(calibration_key(recipe, cal, checked.eval_streams))
    except (OverlapError, ResumeError) as err:
        raise InputError(str(err)) from None
    return Calibrated(cal, info, overlap)


def calibration_key(recipe: Recipe, cal: CalibrationSet, streams: dict[str, torch.Tensor]) -> str:
    """What a resumed run must find unchanged once the model has written text: the calibration windows, and
    the ``self`` evaluation domains' ids (the text read from sources is in the key already, :func:`check`)."""
    from compressor.engine.runkey import tokens_fingerprint

    written = {e.domain_name(): streams[e.domain_name()] for e in recipe.evaluation_domains() if e.self_written()}
    return cal.fingerprint() if not written else f"{cal.fingerprint()}+{tokens_fingerprint(written)}"


def compress(recipe: Recipe, loaded: Loaded, calibrated: Calibrated, checked: Checked) -> CompressionResult:
    """The run's workflow changes the model (:meth:`~compressor.pipeline.workflow.Workflow.compress`): the policy
    engine's measure, fit, select and gate; with ``output.size`` the blocks stay as they are (the original's
    baseline) and the size workflow plans the file when it ships."""
    result = checked.workflow.compress(loaded, calibrated, checked)
    result.timings = {**_text_timings(calibrated), **result.timings}
    return result


def _text_timings(calibrated: Calibrated) -> dict[str, float]:
    """The calibrate stage's seconds, moved from its info into the run's timings."""
    return {k: calibrated.info.pop(k) for k in ("self_evaluation_s", "calibration_s") if k in calibrated.info}


def report(recipe: Recipe, loaded: Loaded, calibrated: Calibrated, checked: Checked,
           result: CompressionResult) -> dict:
    """The run report (``report.json``) as far as it is known before writing."""
    cache_info = {"enabled": False, "hit": False, "key": None}  # the engine measures as it goes
    rep = build_report(recipe, loaded.source, loaded.model_type, result, calibrated.cal, cache_info, checked.out)
    rep["calibration"].update(calibrated.info)
    from compressor.inputs.provenance import source_metadata

    rep["model"].update(source_metadata(loaded.source))
    rep["resumed"] = checked.state.resumed
    # which fits the gate measured on the output file's grid (compressor.fitting.snap)
    rep["snapped"] = {str(i): f.stored["out.weight"][0] for i, f in sorted((result.fitted or {}).items())
                      if "out.weight" in f.stored}
    rep["evaluation"] = evaluation_report(recipe, result, checked.eval_streams, calibrated.overlap)
    for w in rep["evaluation"]["warnings"]:
        logger.warning("%s", w)
    for note in rep["evaluation"]["notes"]:
        logger.info("%s", note)
    dtype = save_dtype(recipe, loaded)
    rep["size"] = {"source_bytes": source_weight_bytes(loaded.source), "output_bytes": None,
                   "output_dtype": str(dtype).removeprefix("torch."),
                   "output_dtype_is_source": recipe.output.dtype == "source" and not loaded.source.gguf_file}
    return rep


@dataclass
class Reference:
    """What only the original model can say, taken before anything is replaced: its greedy
    continuations of a few evaluation prompts, and its task scores (``evaluation.tasks``)."""

    continuations: object
    tasks: dict | None = None


def reference(recipe: Recipe, loaded: Loaded, checked: Checked) -> Reference:
    """The original model's greedy continuations (:mod:`compressor.evaluation.agreement`) and, when the
    recipe names ``evaluation.tasks``, its task scores (:mod:`compressor.evaluation.tasks`)."""
    from compressor.evaluation.agreement import continuation_reference

    e = recipe.evaluation_domains()[0]
    # a size plan leaves the model in memory as it is: its continuations would be compared with themselves (and
    # generating them token by token reads an onloaded model's every layer per token)
    conts = (continuation_reference(loaded.model, checked.eval_streams[e.domain_name()], seq_len=e.seq_len)
             if checked.workflow.changes_blocks else None)
    tasks = None
    section = recipe.task_section()
    if section is not None:
        from compressor.evaluation.tasks import run_tasks

        t0 = time.perf_counter()
        tasks = run_tasks(loaded.model, loaded.tokenizer, section)
        logger.info("tasks on the original model (%.0f s): %s", time.perf_counter() - t0,
                    {t: r.get(r.get("primary")) for t, r in tasks.items()})
    return Reference(conts, tasks)


def compare(recipe: Recipe, loaded: Loaded, ref: Reference, result: CompressionResult, rep: dict) -> None:
    """The compressed model against the original's :class:`Reference`: greedy agreement (next tokens
    from the gate's last evaluation, continuations now) into ``rep["agreement"]``; task scores side by
    side into ``rep["tasks"]``, with ``policy.task_budget`` applied (over it fails the gate)."""
    from compressor.evaluation.agreement import continuation_agreement

    final = result.final
    domains = getattr(final, "domains", None) or {"": final}
    rep["agreement"] = {
        "next_token": getattr(final, "agreement", None), "next_token_se": getattr(final, "agreement_se", None),
        "domains": {n: getattr(ev, "agreement", None) for n, ev in domains.items()},
        "continuations": (continuation_agreement(loaded.model, ref.continuations)
                          if ref.continuations is not None else None),
    }
    if ref.tasks is None:
        return
    from compressor.evaluation.tasks import compare_tasks, run_tasks

    t0 = time.perf_counter()
    after = run_tasks(loaded.model, loaded.tokenizer, recipe.task_section())
    rep["timings"]["tasks_s"] = time.perf_counter() - t0
    rep["tasks"] = compare_tasks(ref.tasks, after, recipe.policy.task_budget)
    if result.gate_passed and not rep["tasks"]["passed"]:
        result.gate_passed = False
        result.gate_message = f"task budget exceeded: {rep['tasks']['message']}"
        rep.update(status="rejected", exit_code=EXIT_GATE, message=result.gate_message)


def adopt(model: nn.Module, compression: dict) -> None:
    """Make the compressed model in memory what a reload of its folder gives: its config becomes the
    ``compressed_<type>`` one carrying ``compression`` (so its own ``save_pretrained`` folder reloads with
    compressor imported), its class the registered compressed class (same forward, same weights)."""
    from compressor.output.hf import adopt_compressed

    adopt_compressed(model, compression)


__all__ = ["Calibrated", "Checked", "Loaded", "Preflight", "Reference", "VerificationError", "adopt", "calibrate",
           "check", "check_loaded", "compare", "compress", "compression_section", "default_formats", "from_object",
           "gate_domains", "load", "output_grid", "preflight", "publish_output", "reference", "remove_tree", "report",
           "save_dtype", "verify", "write", "write_request", "writer_options"]
