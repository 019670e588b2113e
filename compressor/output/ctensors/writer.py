"""The :class:`CompressedTensorsWriter` (the format is described in the package's docstring)."""

from __future__ import annotations

import gc
import json
import logging
import time
from pathlib import Path

import torch
from torch import nn

from compressor.core.onload import input_device, is_offloaded
from compressor.output.base import VerificationError, WriteRequest, Writer, Written
from compressor.output.ctensors.grids import IntScheme, Rounded, get_scheme
from compressor.output.ctensors.rounding import _compress, _replaced, _rounded, _with_weights, alone, base_model
from compressor.output.ctensors.stream import check_reload, write_streamed
from compressor.output.ctensors.schemes import (
    CTENSORS_FORMAT, PACK_FORMAT, SchemePlan, _PLAIN_KINDS, _require_library, head_scheme, layer_schemes,
    library_missing, scheme_counts, tensor_bytes,
)
from compressor.output.hf.folder import (
    cast_state_dict, computes_on_gpu, finish_folder, folder_weight_bytes, logit_tolerance, rounded_copy,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# The writer
# --------------------------------------------------------------------------------------------------


class CompressedTensorsWriter(Writer):
    """``compressed-tensors``: the base class with integer ``pack-quantized`` linears (W4A16, W8A16…), loaded
    by plain transformers with the compressed-tensors package and served by vLLM. Options
    (``request.options``): ``ct_scheme``, ``ct_schemes``, ``ct_hessians`` (module docstring)."""

    format = "compressed-tensors"
    description = ("Hugging Face folder of the base class with int4/int8 weights in compressed-tensors' pack-quantized "
                   "format (llm-compressor's W4A16/W8A16; vLLM serves it); kind prune or none")

    def unsupported(self, model_type: str, kind: str) -> str | None:
        if (why := library_missing()) is not None:
            return why
        from compressor.core.archs import ARCHITECTURES

        spec = ARCHITECTURES.get(model_type)
        if spec is not None and spec.int_refusal:
            return (f"model type {model_type!r} cannot be written as compressed-tensors: {spec.int_refusal}; use "
                    "output.formats: [hf] for this model")
        if kind not in _PLAIN_KINDS:
            return (f"the compressed-tensors format stores the base model's own class, which has no place for "
                    f"{kind} replacements: only kind prune (saved at the pruned width) or none; use kind: prune, or "
                    "the hf format")
        if kind == "prune":
            from compressor.output.hf.standard import StandardWriter

            return StandardWriter().unsupported(model_type, kind)
        return None

    def check_options(self, options: dict) -> str | None:
        try:
            if "ct_scheme" in options and get_scheme(options["ct_scheme"]) is None:
                return "output ct_scheme: none quantizes nothing; name a scheme, or write hf / hf-standard"
            mapping = options.get("ct_schemes")
            if mapping is not None:
                if not isinstance(mapping, dict):
                    return f"output ct_schemes must map module names to scheme names, got {type(mapping).__name__}"
                for scheme in mapping.values():
                    get_scheme(scheme)
            hessians = options.get("ct_hessians")
            if hessians is not None and not isinstance(hessians, dict):
                return f"output ct_hessians must map module names to [in, in] tensors, got {type(hessians).__name__}"
        except ValueError as e:
            return f"output: {e}"
        return None

    def plan(self, request: WriteRequest) -> SchemePlan:
        """The writer's options as a plan: schemes from ``ct_scheme`` / ``ct_schemes``, GPTQ where
        ``ct_hessians`` gives an Ĥ."""
        return SchemePlan(hessians=request.options.get("ct_hessians"))

    def write(self, request: WriteRequest, folder: Path, plan=None) -> Written:
        _require_library()
        from compressed_tensors import __version__ as ct_version

        model = request.model
        if (why := self.check_options(request.options)) is not None:
            raise ValueError(why)
        dtype = request.dtype or model.dtype
        plan = self.plan(request) if plan is None else plan
        if is_offloaded(model):  # never whole in memory: tensor by tensor from the offload store
            if _replaced(model):
                raise ValueError("an onloaded model with replaced blocks cannot be written as compressed-tensors "
                                 "(it is rebuilt as its base class in memory); use model.offload: none")
            schemes = layer_schemes(model, plan.options(request.options))
            write_streamed(model, plan, schemes, dtype, folder)
        else:
            base = base_model(model)
            schemes = layer_schemes(base, plan.options(request.options))
            rounded = _rounded(plan, base, schemes, dtype)
            compressor = _compress(base, schemes, rounded)
            base.save_pretrained(folder, safe_serialization=True, state_dict=cast_state_dict(base, dtype))
            del base, rounded
            compressor.update_config(str(folder))
        cfg_path, cfg = finish_folder(folder, request.tokenizer, dtype)
        cfg.pop("auto_map", None)
        counts = scheme_counts(schemes)
        head = head_scheme(model, schemes)
        cfg["compression"] = {**request.compression, "format": CTENSORS_FORMAT,
                              "quantization": {"library": f"compressed-tensors {ct_version}", "format": PACK_FORMAT,
                                               "schemes": counts, "gptq_layers": _gptq_layers(plan, schemes),
                                               "output_head": head}}
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for name, text in request.extra_files.items():
            (folder / name).write_text(_card(text, counts, head) if name == "README.md" else text)
        logger.info("compressed-tensors: %s, %d layer(s) rounded by GPTQ", counts, _gptq_layers(plan, schemes))
        return Written(Path(folder), sorted(folder.iterdir()), plan)

    def verify(self, request: WriteRequest, written: Written) -> dict:
        """Reload with plain transformers in the compute dtype; its logits must equal, to the compute dtype's
        tolerance, those of the in-memory model whose quantized weights are the values the file decodes to
        and whose other tensors are rounded through the saved dtype. Records the reload's perplexity."""
        _require_library()
        t0 = time.perf_counter()
        model = request.model
        dtype = request.dtype or model.dtype
        folder, plan = written.folder, written.plan
        if is_offloaded(model):
            return self._verify_streamed(request, folder, plan, t0)
        base = base_model(model)
        schemes = layer_schemes(base, plan.options(request.options))
        rounded = _rounded(plan, base, schemes, dtype)
        plan.codes = None  # verified once: the codes are not needed again
        stored_bytes = tensor_bytes(base, schemes, dtype)
        base_cls = type(base)
        probe, expected = _reference_logits(request, base, rounded, dtype)
        del base, rounded  # before the reload: never three models in memory at once
        reloaded, cls = _reload(folder, base_cls, model.dtype)
        diff = float((expected - _logits(reloaded, probe)).abs().max())
        tol = logit_tolerance(model.dtype, computes_on_gpu(model) or computes_on_gpu(reloaded))
        if diff > tol:
            raise VerificationError(
                f"compressed-tensors reload check failed: max |Δlogit| {diff:.3g} against the in-memory model with the "
                f"decoded weights (tolerance {tol:g}); the folder was not published"
            )
        check = _measured(request, folder, reloaded, cls, plan, schemes, dtype, stored_bytes, t0, {
            "max_abs_logit_diff": diff, "logit_tolerance": tol,
            "compared_with": "the in-memory model with the decoded weights"})
        # freed now: reference cycles in a reloaded model wait for a full collection, and the next model (the
        # anchor; Qwen2.5-1.5B: 7 GB in float32) must not be loaded beside it
        del reloaded
        gc.collect()
        return check

    def _verify_streamed(self, request: WriteRequest, folder: Path, plan: SchemePlan, t0: float) -> dict:
        """An onloaded model's folder: reloaded by plain transformers and checked tensor by tensor
        (:func:`~compressor.output.ctensors.stream.check_reload`), not against a second model's logits: the model
        is never whole in memory."""
        model = request.model
        dtype = request.dtype or model.dtype
        schemes = layer_schemes(model, plan.options(request.options))
        stored_bytes = tensor_bytes(model, schemes, dtype)
        reloaded, cls = _reload(folder, type(model), reload_dtype(model, dtype))
        tensors = check_reload(model, reloaded, plan, schemes, dtype)
        if not tensors["passed"]:
            raise VerificationError(f"compressed-tensors reload check failed: {tensors['failed_at']}; the folder "
                                    "was not published")
        check = _measured(request, folder, reloaded, cls, plan, schemes, dtype, stored_bytes, t0, {
            "reloaded_in": str(reload_dtype(model, dtype)).removeprefix("torch."),
            **{k: v for k, v in tensors.items() if k != "failed_at"}})
        del reloaded
        gc.collect()
        return check


def _reload(folder: Path, cls: type, dtype: torch.dtype) -> tuple[nn.Module, str]:
    """The folder reloaded by plain ``AutoModelForCausalLM`` in ``dtype``, and its class's name; it must be
    transformers' ``cls`` (the base class), else :class:`VerificationError`."""
    from transformers import AutoModelForCausalLM

    with alone():
        reloaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    name = f"{type(reloaded).__module__}.{type(reloaded).__name__}"
    if not type(reloaded).__module__.startswith("transformers.") or type(reloaded) is not cls:
        raise VerificationError(f"the compressed-tensors folder reloaded as {name}, not the base class "
                                f"{cls.__name__}; the folder was not published")
    return reloaded, name


def _measured(request: WriteRequest, folder: Path, reloaded: nn.Module, cls: str, plan: SchemePlan,
              schemes: dict[str, IntScheme | None], dtype: torch.dtype, stored_bytes: int, t0: float,
              compared: dict) -> dict:
    """The report entry of a reload that passed its comparison (``compared``: how, and what it found): the folder's
    facts, the reload's perplexity on the probe, and for a size's plan its scores on every gate domain."""
    from compressed_tensors import __version__ as ct_version

    from compressor.core.params import count_params
    from compressor.evaluation.perplexity import perplexity

    again = perplexity(reloaded, request.probe_tokens, seq_len=request.probe_seq_len, stride=request.probe_stride,
                       batch_size=request.probe_batch_size, desc="compressed-tensors reload check", shard=False)
    ref_ppl = request.expected_ppl
    check = {"runtime": "transformers", "compressed_tensors": ct_version, "class": cls, "format": PACK_FORMAT,
             "saved_dtype": str(dtype).removeprefix("torch."), "schemes": scheme_counts(schemes),
             "gptq_layers": _gptq_layers(plan, schemes), "tensor_bytes": stored_bytes,
             "file_bytes": folder_weight_bytes(Path(folder)), "params": count_params(reloaded), **compared,
             "perplexity": again.ppl, "expected_perplexity": ref_ppl,
             "quantization_change": again.ppl / ref_ppl - 1.0 if ref_ppl else None,
             "passed": True, "seconds": time.perf_counter() - t0}
    if plan.measured:  # a plan's file is measured where it runs, for the size stage's gate
        check.update(quant="plan", disk_bytes=check["file_bytes"], file_bytes=stored_bytes,
                     domains=_score(reloaded, _gate_domains(request)))
    return check


def reload_dtype(model: nn.Module, saved: torch.dtype) -> torch.dtype:
    """The dtype a written folder is reloaded, checked and scored in: the model's compute dtype, or for an onloaded
    model the saved one — as a user loads it (``from_pretrained`` takes the config's dtype), and never the whole
    model in float32 (the library decompresses every layer on the first forward: a 1.5B's 6.2 GB)."""
    return saved if is_offloaded(model) else model.dtype


def _gate_domains(request: WriteRequest) -> list[dict]:
    """Every gate domain (``options['gate_domains']``), else the verification probe."""
    return request.options.get("gate_domains") or [
        {"name": "probe", "tokens": request.probe_tokens, "seq_len": request.probe_seq_len,
         "stride": request.probe_stride, "reference_ppl": request.expected_ppl}]


def _score(model: nn.Module, domains: list[dict]) -> list[dict]:
    """A reloaded checkpoint on every gate domain: its rows (perplexity, change, KL from the original's teacher
    where the domain carries it) with each window's scores for the size gate."""
    from compressor.evaluation.external import model_scores

    return [model_scores(model, d["tokens"], d["seq_len"], d["stride"], d.get("teacher")).row(
        d["name"], d.get("reference_ppl")) for d in domains]


def score_folder(folder: Path, domains: list[dict], dtype: torch.dtype) -> dict:
    """A checkpoint folder reloaded by plain transformers, scored on every gate domain (``name →
    WindowScores``): the anchor a size plan is measured beside."""
    from transformers import AutoModelForCausalLM

    with alone():
        reloaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    scores = {row["name"]: row["scores"] for row in _score(reloaded, domains)}
    del reloaded  # as in verify: before another model is loaded
    gc.collect()
    return scores


def _gptq_layers(plan: SchemePlan, schemes: dict[str, IntScheme | None]) -> int:
    """Quantized layers rounded by GPTQ (:meth:`SchemePlan.gptq_layers`)."""
    return len(plan.gptq_layers() & {n for n, s in schemes.items() if s is not None})


@torch.no_grad()
def _reference_logits(request: WriteRequest, base: nn.Module, rounded: dict[str, Rounded],
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe windows (at most 2) and the logits of ``base`` with every tensor rounded through the saved
    ``dtype`` and each quantized weight its decoded values (what the reload computes with)."""
    tokens, seq_len = request.probe_tokens, request.probe_seq_len
    if tokens is None:
        raise ValueError("the compressed-tensors reload check needs probe tokens (request.probe_tokens)")
    n = min(2, max(1, tokens.numel() // seq_len))
    probe = tokens[: n * min(seq_len, tokens.numel() // n)].view(n, -1)
    compute = next(base.parameters()).dtype
    # base's tensors are shared with the model: rounding copies them, all but the weights replaced below
    ref = base if dtype == compute else rounded_copy(base, dtype, [base.get_submodule(n).weight for n in rounded])
    _with_weights(ref, rounded, compute)
    logits = _logits(ref, probe)
    del ref
    return probe, logits


@torch.no_grad()
def _logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    device = input_device(model)
    return model(input_ids=input_ids.to(device)).logits.float().cpu()


def _card(card: str, counts: dict[str, int], head: str) -> str:
    """The model card with its Load section for a compressed-tensors folder (no custom code)."""
    schemes = ", ".join(f"{k} × {v}" for k, v in counts.items())
    serve = ("vLLM serves it as it is (`vllm serve path/to/this/folder`)" if head.startswith("unquantized") else
             f"the output head is quantized too ({head}), which a runtime must read: vLLM routes a quantized "
             "`lm_head` to its compressed-tensors kernels since its PR #37291 (not checked by compressor); for a "
             "runtime that does not, write the folder again with `output.ct_head: keep`")
    note = (f"Saved in the compressed-tensors `{PACK_FORMAT}` format (linear layers: {schemes}): plain transformers "
            "loads it with the `compressed-tensors` package installed (`pip install compressed-tensors`), no custom "
            f"code and no flags; {serve}.\n\n## Load\n")
    from compressor.output.hf.standard import plain_load_card

    return plain_load_card(card, note)
