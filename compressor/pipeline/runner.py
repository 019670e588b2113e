"""``oneshot`` and ``run``: a recipe as a short composition of the named stages in :mod:`.stages`.

:func:`oneshot` takes a model object (or a source string), a recipe (path, dict or
:class:`~compressor.recipe.schema.Recipe`) and returns the compressed model; failures are exceptions
(:class:`~compressor.core.errors.InputError`, :class:`~compressor.core.errors.GateFailed`).
:func:`run` is the same pipeline for a recipe that names its source and output, returning a
:class:`RunResult` with the exit code; the command line is a thin layer over :func:`oneshot`.
"""

from __future__ import annotations

import logging
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compressor.core import distributed as dist
from compressor.core.errors import EXIT_GATE, EXIT_OK, GateFailed, InputError, exit_code_for
from compressor.output.base import staging_path
from compressor.pipeline import stages
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import Recipe

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    exit_code: int
    report: dict
    output: Path | None = None
    result: CompressionResult | None = field(default=None, repr=False)


@dataclass
class OneshotResult:
    """What :func:`oneshot` gives back."""

    model: Any
    """The compressed model: still a ``PreTrainedModel`` (``generate``, ``save_pretrained``; its config
    carries the ``compression`` section, so a saved folder reloads with compressor imported)."""
    tokenizer: Any
    report: dict
    """The run report (``report.json``'s content)."""
    output: Path | None = None
    """The published folder, when ``output_dir`` was given."""
    result: CompressionResult | None = field(default=None, repr=False)


def oneshot(model, recipe: Recipe | dict | str | Path, *, tokenizer=None, dataset=None,
            output_dir: str | Path | None = None, overrides: dict | list[str] | None = None,
            overwrite: bool | None = None, use_cache: bool | None = None, resume: bool = False,
            keep_state: bool = False, measurements_from: str | Path | None = None) -> OneshotResult:
    """Compress ``model`` with ``recipe`` and return the compressed model.

    ``model``: a loaded ``PreTrainedModel`` (compressed in place, as it is: its dtype and placement,
    ``device_map`` included; ``tokenizer`` is then needed unless its ``name_or_path`` has one), or any
    source string a recipe's ``model.source`` takes (then the recipe's ``model`` section loads it).
    ``recipe``: a YAML path, a dict or a :class:`~compressor.recipe.schema.Recipe`; ``overrides``:
    ``{"policy.ppl_budget": 0.1}`` (or ``--set``-style ``"key=value"`` strings), applied on top.
    ``dataset``: the calibration text — a path or hub name (as ``calibration.dataset``), a list of
    strings, or a ``datasets.Dataset`` (its ``calibration.text_column``). ``output_dir``: write the
    Hugging Face folder (and any other ``output.formats``) there (``overrides={"output.path": DIR}`` is the
    same); None writes nothing (a recipe file's own ``output.path`` is not used).

    Raises :class:`~compressor.core.errors.InputError` (bad recipe or input, exit 2 on the command
    line; nothing loaded or written), :class:`~compressor.core.errors.GateFailed` (the gate could not
    be met, exit 3; nothing written; ``.report``, ``.attempts``) and other errors (exit 1).

    >>> from transformers import AutoModelForCausalLM, AutoTokenizer      # doctest: +SKIP
    >>> m = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M")              # doctest: +SKIP
    >>> tok = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M")                    # doctest: +SKIP
    >>> res = compressor.oneshot(m, "recipes/smollm2-135m.yaml", tokenizer=tok)               # doctest: +SKIP
    >>> res.model.generate(**tok("def fib(n):", return_tensors="pt"), max_new_tokens=20)     # doctest: +SKIP
    """
    from compressor.recipe import apply_overrides, load_recipe, recipe_from_dict

    from compressor.inputs.validate import check_path_text

    extra = _override_list(overrides)
    if isinstance(recipe, Recipe):
        source_file = recipe._source_file
        # only what was set: a field left to its default (output.formats) is still filled in by the pipeline
        recipe = (recipe_from_dict(apply_overrides(recipe.model_dump(mode="json", exclude_unset=True), extra))
                  if extra else recipe.model_copy(deep=True))
        recipe._source_file = source_file
    elif isinstance(recipe, dict):
        recipe = recipe_from_dict(apply_overrides(recipe, extra))
    elif isinstance(recipe, (str, Path)):
        recipe = load_recipe(recipe, extra)
    else:
        raise InputError(f"recipe: expected a YAML path, a dict or a Recipe, got {type(recipe).__name__}")
    if output_dir is None and _names_output_path(extra):
        output_dir = recipe.output.path  # named in this call, as output_dir is: the run writes there
    if output_dir is None and recipe.output.path is not None:
        logger.info("oneshot without output_dir writes nothing (the recipe's output.path %s is not used)",
                    recipe.output.path)
    if output_dir is not None:
        check_path_text(str(output_dir), "output_dir")
    recipe.output.path = None if output_dir is None else str(output_dir)
    if overwrite is not None:
        recipe.output.overwrite = bool(overwrite)
    with ExitStack() as stack:
        if dataset is not None:
            recipe.calibration.dataset = _calibration_dataset(dataset, recipe, stack)
        if isinstance(model, (str, Path)):
            recipe.model.source = str(model)
            if recipe.output.path is None:
                raise InputError("output_dir: required with a source string (a model object may be compressed "
                                 "without writing anything)")
            return _execute(recipe, None, use_cache=use_cache, resume=resume, keep_state=keep_state,
                            measurements_from=measurements_from)
        given = stages.from_object(model, tokenizer)
        _describe_object(recipe, given)
        with _restored_on_failure(given.model):
            return _execute(recipe, given, use_cache=use_cache, resume=resume, keep_state=keep_state,
                            measurements_from=measurements_from)


_MISSING = object()


@contextmanager
def _restored_on_failure(model):
    """The caller's model, exactly as handed in, after any exception — a gate's refusal, a bad input found
    late, Ctrl-C (``KeyboardInterrupt``) or a kill signal turned into an exception: every submodule back in
    its place, its class, config and training flag. Replacements swap modules and never edit the originals'
    weights, so putting the originals back is the whole restore."""
    slots = [(parent, name, child) for parent in model.modules() for name, child in parent._modules.items()]
    cls, config, training = model.__class__, model.config, model.training
    section = config.__dict__.get("compression", _MISSING)
    try:
        yield
    except BaseException:
        for parent, name, child in slots:
            if parent._modules.get(name) is not child:
                parent._modules[name] = child
        model.__class__, model.config = cls, config
        if section is _MISSING:  # the one field a run sets on a config in place
            config.__dict__.pop("compression", None)
        else:
            config.compression = section
        model.train(training)
        logger.info("the model handed in is restored as it was (the run did not finish)")
        raise


def _names_output_path(extra: list[str]) -> bool:
    """Whether ``overrides`` set ``output.path`` (a recipe file's own ``output.path`` is not used by oneshot)."""
    return any(o.partition("=")[0].strip() == "output.path" for o in extra)


def _override_list(overrides) -> list[str]:
    import json

    if overrides is None:
        return []
    if isinstance(overrides, dict):
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    if isinstance(overrides, (list, tuple)) and all(isinstance(o, str) for o in overrides):
        return list(overrides)
    raise InputError(f"overrides: expected a dict of dotted keys ({{'policy.ppl_budget': 0.1}}) or a list of "
                     f"'key=value' strings, got {type(overrides).__name__}")


def _calibration_dataset(dataset, recipe: Recipe, stack: ExitStack) -> str:
    """``dataset=`` as a ``calibration.dataset`` value: a path or hub name as it is; a list of strings or
    a ``datasets.Dataset`` as a JSON-lines file in a temporary folder, removed when the run ends."""
    import json

    if isinstance(dataset, (str, Path)):
        return str(dataset)
    column = recipe.calibration.text_column
    try:
        from datasets import Dataset
    except ImportError:  # pragma: no cover - datasets is a dependency
        Dataset = ()
    if isinstance(dataset, Dataset):
        if column not in dataset.column_names:
            raise InputError(f"dataset: the Dataset has no {column!r} column (calibration.text_column); it has "
                             f"{dataset.column_names}")
        texts = list(dataset[column])
    elif isinstance(dataset, (list, tuple)) and all(isinstance(t, str) for t in dataset):
        texts = list(dataset)
    else:
        raise InputError(f"dataset: expected a path, a list of strings or a datasets.Dataset, got "
                         f"{type(dataset).__name__}")
    if not any(t.strip() for t in texts):
        raise InputError("dataset: no text (every string is empty)")
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="compressor-data-")))
    path = folder / "calibration.jsonl"
    path.write_text("".join(json.dumps({column: t}) + "\n" for t in texts), encoding="utf-8")
    return str(path)


def _describe_object(recipe: Recipe, given: stages.Loaded) -> None:
    """The recipe's ``model`` section names the object handed in: where it came from, its dtype and
    placement (nothing is loaded from it; ``recipe.yaml`` and the report say what was run)."""
    model = given.model
    recipe.model.source = given.source.path
    dtype = str(next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32))
    dtype = dtype.removeprefix("torch.")
    recipe.model.dtype = dtype if dtype in ("float32", "bfloat16", "float16") else "auto"
    devices = {str(p.device.type) for p in model.parameters()}
    if len(getattr(model, "hf_device_map", None) or {}) > 1 or len(devices) > 1:
        recipe.model.device = "auto"
    else:
        recipe.model.device = "cuda" if devices == {"cuda"} else "cpu"


def run(recipe: Recipe, *, use_cache: bool | None = None, resume: bool = False, keep_state: bool = False,
        measurements_from: str | Path | None = None) -> RunResult:
    """Run a whole recipe. Raises :class:`~compressor.core.errors.RecipeError` /
    :class:`~compressor.core.errors.InputError` for bad input.

    Returns a :class:`RunResult`; ``exit_code`` is :data:`EXIT_GATE` when the
    perplexity gate failed (then nothing is written).

    Every finished layer and evaluation is checkpointed beside the output
    (:mod:`compressor.engine.runstate`); ``resume=True`` continues a run that was
    interrupted, with the same result as an uninterrupted one. Without it, an
    earlier run's state for this output is discarded. The state is deleted when
    the run ends unless ``keep_state``; a later run whose recipe differs only in
    the policy's gate settings then takes its measurements (pass A, loss
    gradients, baseline) with ``measurements_from=<this output>``, or with
    ``resume=True`` on the same output, and runs only its gate.

    Under a process group (``torchrun``; see :mod:`compressor.core.distributed`) every
    rank calls it: calibration and evaluation are sharded, the decisions come out
    the same on every rank, and rank 0 alone writes; the others wait for it and
    return its report, or raise :class:`~compressor.core.distributed.RankFailed`.

    >>> import compressor                                                          # doctest: +SKIP
    >>> res = compressor.run(compressor.load_recipe("recipes/smollm2-135m.yaml"))  # doctest: +SKIP
    >>> res.exit_code, res.output                                                  # doctest: +SKIP
    """
    try:
        res = _execute(recipe, None, use_cache=use_cache, resume=resume, keep_state=keep_state,
                       measurements_from=measurements_from)
    except GateFailed as failed:
        return RunResult(EXIT_GATE, failed.report, None, failed.result)
    return RunResult(EXIT_OK, res.report, res.output, res.result)


def _execute(recipe: Recipe, given: stages.Loaded | None, *, use_cache: bool | None, resume: bool,
             keep_state: bool, measurements_from: str | Path | None) -> OneshotResult:
    """The stages, shared by :func:`oneshot` and :func:`run`: ``given`` is a model object handed in
    (else the recipe's source is loaded); with ``output.path`` unset nothing is written."""
    t_start = time.perf_counter()
    use_cache = recipe.measure.cache if use_cache is None else use_cache
    checked = stages.check(recipe, resume=resume, measurements_from=measurements_from, given=given)
    checked.keep_state = keep_state
    try:
        return _run_checked(recipe, checked, given, use_cache, t_start)
    except GateFailed:  # the run ended (exit 3): its state goes as on success
        _end_state(checked)
        raise
    except InputError:  # exit 2: a fresh run's state goes; one the user asked to resume stays, for the fix
        if not checked.state.resumed:
            _end_state(checked)
        raise
    except BaseException:  # Ctrl-C, SIGTERM, exit 1: a size run records no step to resume from (it starts over)
        if not checked.workflow.changes_blocks:
            _end_state(checked)
        raise
    finally:
        checked.release()


def _run_checked(recipe: Recipe, checked: stages.Checked, given: stages.Loaded | None, use_cache: bool,
                 t_start: float) -> OneshotResult:
    t = time.perf_counter()
    loaded = given if given is not None else stages.load(recipe.model)
    load_s = time.perf_counter() - t
    stages.check_loaded(recipe, loaded)
    fp = stages.expect(recipe, loaded, use_cache=use_cache, checked=checked)
    calibrated = stages.calibrate(recipe, loaded, checked, use_cache=use_cache, model_fp=fp)
    reference = stages.reference(recipe, loaded, checked)
    result = stages.compress(recipe, loaded, calibrated, checked)
    result.timings = {"check_s": checked.seconds, "load_s": load_s, **result.timings}
    report = stages.report(recipe, loaded, calibrated, checked, result)
    stages.compare(recipe, loaded, reference, result, report)
    if not result.gate_passed:
        report.update(status="rejected", exit_code=EXIT_GATE, message=result.gate_message, output=None)
        logger.error("gate failed: %s; nothing was written", result.gate_message)
        raise GateFailed(result.gate_message, report=report, attempts=result.attempts, result=result)
    if checked.out is None:  # a model object, no output_dir: nothing to write
        report["output"] = None
        report["timings"]["total_s"] = time.perf_counter() - t_start
        stages.adopt(loaded.model, stages.compression_section(loaded, result, report))
        logger.info("%s", result.gate_message)
        return OneshotResult(loaded.model, loaded.tokenizer, report, None, result)
    windows = torch.cat([calibrated.cal.fit, calibrated.cal.heldout])
    if not dist.is_main():  # a size run's statistics, prices and rounding are shared by every rank; rank 0 writes
        request = stages.write_request(recipe, loaded, checked, result, report)
        return _wait_for_main(loaded, result, checked.workflow.follow(request, windows))
    try:
        request = stages.write_request(recipe, loaded, checked, result, report)
        # the verified staging folder: every format written and checked as it is, or the size's planned file
        # (``use_cache``: the run's statistics cache setting; ``--no-cache`` reaches the size plan's prices too)
        tmp = checked.workflow.ship(request, windows, checked, report, result, use_cache=use_cache)
        out = stages.publish_output(tmp, checked.out, report, t_start, recipe)
    except BaseException as err:
        # whatever stopped it (Ctrl-C, SIGTERM, a full disk) between two steps that each clean up after themselves
        stages.remove_tree(staging_path(checked.out))
        dist.broadcast_object(((exit_code_for(err), f"{type(err).__name__}: {err}"), None))
        raise
    dist.broadcast_object((None, report))
    _end_state(checked)
    if checked.workflow.changes_blocks:  # a size plan changed no weight of the model in memory
        stages.adopt(loaded.model, request.compression)
    logger.info("saved compressed model to %s", out)
    logger.info("%s", result.gate_message)
    return OneshotResult(loaded.model, loaded.tokenizer, report, out, result)


def _end_state(checked: stages.Checked) -> None:
    """The run ended: delete its state, or keep it (``keep_state``) for runs at other budgets."""
    state = checked.state
    if not checked.keep_state:
        state.discard()
    elif dist.is_main() and state.enabled:
        nbytes = sum(p.stat().st_size for p in state.folder.iterdir() if p.is_file())
        logger.info("run state kept at %s (%.1f GB): a run of this recipe with other gate settings (policy.ppl_budget, "
                    "ffn_keep, …) takes its measurements with --measurements-from %s; delete the folder when done",
                    state.folder, nbytes / 1e9, checked.out)


def _wait_for_main(loaded: stages.Loaded, result: CompressionResult, last: tuple) -> OneshotResult:
    """A rank other than 0: rank 0's report (or its failure), ``last``: its last word, as the workflow took it."""
    failed, report = last
    if failed is not None:
        raise dist.RankFailed(*failed)
    return OneshotResult(loaded.model, loaded.tokenizer, report, Path(report["output"]), result)
