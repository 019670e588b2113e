"""The size stage: a GGUF of a given size with the least predicted loss (``output.size``).

budget → measure → plan, then the GGUF writer writes the plan and the llama.cpp
check gates it:

1. **budget**: the model is written once as F16 (the file a deployer would
   quantize); a preset name (``Q3_K_M``) is made from it by llama.cpp's own
   quantizer and its bytes are the budget, and the preset file is kept to be
   measured beside the output on the same windows; ``750MB`` / ``4.5bpw`` are
   bytes directly (bits per weight over every weight the file stores). What is
   not tensor data (metadata, tokenizer, norms) is read off the F16 file.
2. **measure**: one forward + backward and one forward pass over the calibration
   windows (:mod:`compressor.engine.tensorstats`).
3. **plan**: every 2-D weight priced in each GGML type by ggml's quantizer, with
   the run's importance matrix or without (the cheaper), then allocated under the
   bytes (``smallest``: the fewest bytes predicted within the gate, stepped back
   while llama.cpp measures it over)
   (:mod:`compressor.policy.quantplan`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compressor.core.errors import InputError
from compressor.core.params import count_params
from compressor.engine.tensorstats import input_moments, linear_names, output_fisher
from compressor.evaluation.evaluate import Evaluator, gate_ppl_limit
from compressor.output.base import WriteRequest
from compressor.policy.compress import CompressionResult
from compressor.policy.quantplan import (DEFAULT_TYPES, MAX_PRICED_ELEMENTS, Priced, SizePlan, from_tensors, plan,
                                          price_all, sites, smallest_within, to_tensors)
from compressor.recipe.schema import Recipe, parse_size

logger = logging.getLogger(__name__)

#: Bytes of alignment padding GGUF puts after each tensor's data, at most.
GGUF_ALIGNMENT = 32
#: Each re-plan after a file came out over its budget shrinks the tensor budget by the excess and this much more.
REPLAN_MARGIN = 4096


@dataclass
class Sizing:
    """The size stage's result: the plan and what the writer and its check need."""

    plan: SizePlan
    budget_bytes: int
    size: str
    preset: dict | None
    workdir: Path
    overhead_bytes: int
    timings: dict = field(default_factory=dict)
    units: dict = field(default_factory=dict, repr=False)
    """Every tensor's priced options (what a re-plan allocates again)."""
    priced: list[Priced] = field(default_factory=list, repr=False)
    cached: bool = False
    """Whether the prices came from the statistics cache."""
    search: "SmallestSearch | None" = None
    """``output.size: smallest``: the predicted change planned for, and the attempts the gate measured."""

    def writer_options(self) -> dict:
        return {"size_plan": self.plan, "size_budget": self.budget_bytes, "preset": self.preset}

    def to_json(self) -> dict:
        return {"size": self.size, "budget_bytes": self.budget_bytes, "non_tensor_bytes": self.overhead_bytes,
                "prices_from_cache": self.cached,
                **({"search": self.search.to_json()} if self.search is not None else {}),
                "preset": None if self.preset is None else {k: v for k, v in self.preset.items() if k != "path"},
                **self.plan.to_json(), "timings": self.timings}

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def back_off(self, measured: dict) -> bool:
        """``output.size: smallest`` after the gate failed on the written file (``measured``: the llama.cpp
        check): plan again for half the predicted change (True), unless no back-off is left (False)."""
        if self.search is None:
            return False
        self.search.attempts.append(_attempt(self.plan, measured, passed=False))
        if self.search.backoffs_left <= 0:
            return False
        self.search.backoffs_left -= 1
        self.search.target_nll /= 2
        self.plan = smallest_within(self.units, self.priced, self.budget_bytes - self.overhead_bytes,
                                    self.search.target_nll)
        logger.warning("size plan: over the budget in llama.cpp; planned again for a predicted %+.2f %% "
                       "(%.1f MB of tensor data)", 100 * math.expm1(self.search.target_nll),
                       self.plan.tensor_bytes / 1e6)
        return True

    def passed(self, measured: dict) -> None:
        if self.search is not None:
            self.search.attempts.append(_attempt(self.plan, measured, passed=True))


#: ``output.size: smallest`` first plans for this share of the gate's limit on the change (predicted, in
#: nats), and halves it after each file the gate rejects: the gate measures the upper confidence bound of
#: the change, so a plan predicted right at the limit fails about half the time.
SMALLEST_START_SHARE = 0.6


@dataclass
class SmallestSearch:
    target_nll: float
    backoffs_left: int
    attempts: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"mode": "smallest", "start_share": SMALLEST_START_SHARE,
                "target_predicted_ppl_change": math.expm1(self.target_nll), "attempts": self.attempts}


def _attempt(plan: SizePlan, measured: dict, passed: bool) -> dict:
    return {"tensor_bytes": plan.tensor_bytes, "predicted_ppl_change": math.expm1(plan.predicted_nll_increase),
            "file_bytes": measured.get("file_bytes"), "passed": passed,
            "measured": {d["name"]: {"relative_change": d.get("relative_change"),
                                     "upper_bound": d.get("relative_delta_upper")}
                         for d in measured.get("domains", [])}}


def baseline_only(model, recipe: Recipe, streams: dict[str, torch.Tensor]) -> CompressionResult:
    """No structural change: the original model's evaluation on the gate's domains (teacher caches), as a
    :class:`CompressionResult` whose final is its baseline."""
    cfgs = {c.domain_name(): c for c in recipe.evaluation_domains()}
    t0 = time.perf_counter()
    ev = Evaluator.build(model, streams, seq_len={n: cfgs[n].seq_len for n in streams},
                         stride={n: cfgs[n].stride for n in streams},
                         batch_size={n: cfgs[n].batch_size for n in streams},
                         top_k=min(c.kl_top_k for c in cfgs.values()))
    base = ev.baseline
    pol = recipe.policy
    params = count_params(model)
    return CompressionResult(
        model=model, profiles=[], decisions=[], baseline=base, final=base,
        budget_ppl=gate_ppl_limit(base.ppl, pol), params_before=params, params_after=params,
        gate_passed=True, gate_message="no structural change (output.size plans the tensor types)",
        strategy="size", timings={"baseline_s": time.perf_counter() - t0},
        teacher_windows={t.name: (t.window_nll, t.window_counts) for t in ev.teachers})


F16_OPTIONS = {"quant": "f16", "from_source": True}


def _f16_request(request: WriteRequest) -> WriteRequest:
    return WriteRequest(model=request.model, tokenizer=request.tokenizer, compression=request.compression,
                        source=request.source, dtype=torch.float16, options=dict(F16_OPTIONS))


def _tensor_bytes(path: Path) -> tuple[int, int, int, int]:
    """(file bytes, bytes of 2-D tensors, bytes of the others, number of tensors) of a GGUF."""
    import gguf

    reader = gguf.GGUFReader(path)
    two_d = sum(int(t.n_bytes) for t in reader.tensors if len([d for d in t.shape if d > 1]) >= 2)
    rest = sum(int(t.n_bytes) for t in reader.tensors) - two_d
    return path.stat().st_size, two_d, rest, len(reader.tensors)


def budget(size: str, request: WriteRequest, workdir: Path) -> tuple[int, int, dict | None]:
    """(file bytes allowed, bytes that are not planned tensor data, the preset file when ``size`` names one)."""
    from compressor.output.gguf import PRESETS, quantize_file, write_gguf

    f16 = workdir / "f16.gguf"
    write_gguf(_f16_request(request), f16, dict(F16_OPTIONS))
    total, planned, other, n_tensors = _tensor_bytes(f16)
    overhead = total - planned + GGUF_ALIGNMENT * n_tensors
    kind, value = parse_size(size)
    preset = None
    if kind == "preset":
        path = workdir / f"{value}.gguf"
        quantize_file(f16, path, PRESETS[value])
        preset = {"name": value, "path": str(path), "file_bytes": path.stat().st_size}
        limit = preset["file_bytes"]
    elif kind == "smallest":
        limit = total  # at most the F16 file; the plan itself is searched (:func:`plan_size`)
    elif kind == "bpw":
        weights = sum(p.numel() for p in {id(p): p for p in request.model.parameters()}.values())
        limit = int(value * weights / 8) + (total - planned - other)
    else:
        limit = int(value)
    if limit <= overhead:
        raise InputError(f"output.size: {size} ({limit:,} bytes) does not even hold what is not weights "
                         f"({overhead:,} bytes: metadata, tokenizer, norms); give a larger size")
    return limit, overhead, preset


#: Bytes of input second moments one pass holds at least (float32 d_in² per input): Qwen2.5-1.5B's 28
#: layers need 9.8 GB at once, so a smaller machine measures and prices them in groups of layers.
MOMENTS_BUDGET_BYTES = 2 << 30


def moments_budget() -> int:
    """Bytes of moments per pass: a third of the memory available now (the model is loaded; pricing a
    group's tensors takes round trips and products beside them), at least :data:`MOMENTS_BUDGET_BYTES`.
    Fewer groups, fewer passes."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return MOMENTS_BUDGET_BYTES
    return max(MOMENTS_BUDGET_BYTES, avail // 3)


def moment_groups(model, names: list[str], budget: int | None = None) -> list[list[str]]:
    """``names`` (in module order) cut into consecutive groups whose moments fit ``budget`` (default:
    :func:`moments_budget`); modules of one parent (q/k/v, gate/up, which share their input) stay in one
    group."""
    budget = moments_budget() if budget is None else budget
    groups: list[list[str]] = [[]]
    used, parent = 0, None
    for n in names:
        size = 4 * model.get_submodule(n).in_features ** 2
        p = n.rsplit(".", 1)[0]
        if groups[-1] and used + size > budget and p != parent:
            groups.append([])
            used = 0
        groups[-1].append(n)
        used += size
        parent = p
    return groups


def gguf_namer(model) -> callable:
    """Hugging Face parameter name → GGUF tensor name (gguf-py's map for the model's architecture)."""
    import gguf

    from compressor.output.gguf import REQUANTIZE_ARCH

    cfg = getattr(model.config, "text_config", None) or model.config
    model_type = str(cfg.model_type).removeprefix("compressed_")
    if model_type not in REQUANTIZE_ARCH:
        raise InputError(f"output.size: no GGUF tensor names are mapped for model type {model_type!r} "
                         f"(mapped: {', '.join(sorted(REQUANTIZE_ARCH))})")
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, REQUANTIZE_ARCH[model_type]), cfg.num_hidden_layers)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))

    def name(hf: str) -> str | None:
        out = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        return None if out is None or (tied and out == "output.weight") else out
    return name


def plan_size(recipe: Recipe, request: WriteRequest, windows: torch.Tensor, out: Path,
              ppl_ratio: float | None = None) -> Sizing:
    """Budget, measure and plan (see the module's docstring); the F16 and preset files live in a work
    folder beside the output until :meth:`Sizing.cleanup`. ``output.size: smallest`` plans the fewest bytes
    whose predicted change is :data:`SMALLEST_START_SHARE` of the gate's limit (``ppl_ratio``: the limit
    over the original's perplexity)."""
    size = recipe.output.size
    workdir = Path(tempfile.mkdtemp(prefix=".compressor-size-", dir=out.parent))
    try:
        t0 = time.perf_counter()
        limit, overhead, preset = budget(size, request, workdir)
        timings = {"budget_s": time.perf_counter() - t0}
        logger.info("output.size %s: %s bytes (%s%d bytes are not weights)", size, f"{limit:,}",
                    f"llama.cpp's {preset['name']} from the same F16; " if preset else "", overhead)
        units, priced, cached = measure_and_price(recipe, request.model, windows, timings)
        search = None
        if parse_size(size)[0] == "smallest":
            if not ppl_ratio or ppl_ratio <= 1:
                raise InputError("output.size: smallest needs a perplexity budget above the original's "
                                 "(policy.ppl_budget > 0); give one, or a size")
            search = SmallestSearch(SMALLEST_START_SHARE * math.log(ppl_ratio), recipe.policy.max_backoff)
            chosen = smallest_within(units, priced, limit - overhead, search.target_nll)
        else:
            chosen = plan(units, priced, limit - overhead)
        if chosen.tensor_bytes > limit - overhead:
            floor = chosen.tensor_bytes + overhead
            raise InputError(f"output.size: {size} ({limit:,} bytes) cannot be met: the smallest types this model's "
                             f"rows take ({', '.join(sorted(set(chosen.types.values())))}) already need {floor:,} "
                             "bytes; give a size of at least that")
        logger.info("size plan: %s MB of tensor data, predicted perplexity %+.2f %%; types %s",
                    f"{chosen.tensor_bytes / 1e6:.1f}", 100 * chosen.to_json()["predicted_ppl_change"],
                    chosen.to_json()["types_used"])
        return Sizing(chosen, limit, size, preset, workdir, overhead, timings, units, priced, cached, search)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise


#: Bump when what a priced option means changes: cached prices of another version are not read.
PRICES_VERSION = 2


def measure_and_price(recipe: Recipe, model, windows: torch.Tensor, timings: dict):
    """Every tensor's options (bytes, predicted cost) and importance matrix: from the statistics cache when
    the same model, calibration windows and pricing settings were priced before (``measure.cache``), else
    measured (a backward pass, then input moments in groups of layers) and priced."""
    from compressor.engine import cache

    key = None
    if recipe.measure.cache:
        settings = {"prices": PRICES_VERSION, "types": [t.name for t in DEFAULT_TYPES],
                    "max_elements": MAX_PRICED_ELEMENTS, "batch_size": recipe.calibration.batch_size}
        data_fp = hashlib.sha256(windows.numpy().tobytes()).hexdigest()
        key = "prices-" + cache.stats_key(cache.model_fingerprint(model), data_fp, settings)
        hit = cache.get(key)
        if hit is not None:
            logger.info("size plan: prices of every tensor type from the cache (%s)", key)
            units, priced = from_tensors(hit[0], json.loads(hit[1]["prices"]))
            return units, priced, True
    bs = recipe.calibration.batch_size
    t0 = time.perf_counter()
    fisher = output_fisher(model, windows, batch_size=bs)
    timings["statistics_s"] = time.perf_counter() - t0
    units, priced, namer = {}, [], gguf_namer(model)
    for group in moment_groups(model, linear_names(model)):
        t0 = time.perf_counter()
        moments = input_moments(model, windows, group, batch_size=bs)
        timings["statistics_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        these = sites(model, fisher, moments, namer, modules=set(group))
        del moments
        units.update(price_all(these))
        priced += [Priced.of(s) for s in these]
        del these  # the statistics go with the sites, before the next group's moments are measured
        timings["pricing_s"] = timings.get("pricing_s", 0.0) + time.perf_counter() - t0
    if key is not None:
        tensors, meta = to_tensors(units, priced)
        cache.put(key, tensors, {"prices": json.dumps(meta)})
    return units, priced, False


def replan(sizing: Sizing, file_bytes: int) -> bool:
    """The written file came out ``file_bytes`` long: when over the budget, shrink the tensor budget by the
    excess and plan again (True: re-planned, write again)."""
    excess = file_bytes - sizing.budget_bytes
    if excess <= 0:
        return False
    tensor_budget = sizing.plan.budget_bytes - excess - REPLAN_MARGIN
    sizing.plan = plan(sizing.units, sizing.priced, tensor_budget)
    logger.info("size plan: the file was %d bytes over; planned again for %.1f MB of tensor data", excess,
                tensor_budget / 1e6)
    return True

