"""The recipe schema: one pydantic model per section (:mod:`.sections`; ``output`` in :mod:`.output_section`),
and the whole :class:`Recipe` here, with the rules between sections. Every name is importable from here.

Every section has ``extra="forbid"``, so a typo fails loudly with the field
path, the bad value and what is allowed — before any model is loaded
(:mod:`compressor.recipe.loader` reads YAML into these models).
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

import yaml
from pydantic import Field, model_validator

from compressor.recipe.output_section import (  # noqa: F401  (the schema's names, in one place)
    CT_SIZE_SCHEMES, GGML_BLOCK, OutputConfig, parse_size, Size, SIZE_FORMS, SIZE_PRESETS, _SIZE_UNITS,
    STANDARD_WIDTH_MULTIPLE, width_multiple,
)
from compressor.recipe.sections import (  # noqa: F401  (the schema's names, in one place)
    AffineReplacement, CalibrationConfig, _Data, DEFAULT_RIDGE, EvaluationConfig, _HiddenUnitReplacement,
    HybridReplacement, LowRankReplacement, MAX_SEED, MAX_TOKENS, MeasureConfig, ModelConfig, PolicyConfig,
    PruneReplacement, RECIPE_VERSION, REPLACEMENT_CONFIGS, ReplacementConfig, _Section, CalibrationSource,
    SIZE_CALIBRATION, size_calibration_default, split_by_weight,
)

#: The default evaluation domains: prose and source code, both shipped with Python, and the model's own
#: writing under a seed the calibration does not use (docs/gate.md). On Gemma-3-270M a cut moved WikiText-2
#: test 1.9-2.4x the prose and code domains, and 1.0x the model's own writing.
DEFAULT_EVALUATION = ("embedded", "embedded-code", "self")

#: Fields each strategy never reads, as ``(section, field)``: setting one to anything but its default is
#: an error naming it (a silent no-op misleads: ``replacement.keep: 0.5`` under allocate kept 31.9 %).
#: ``size`` (``output.size``, which runs no strategy) is added below :data:`SIZE_READS`.
IGNORED_BY = {
    "allocate": (("policy", "threshold"), ("policy", "include"), ("policy", "order"), ("policy", "max_blocks"),
                 ("policy", "target_ratio"), ("policy", "patience"), ("measure", "swap_sweep"),
                 ("replacement", "keep")),
    "greedy": (("policy", "ffn_keep"), ("policy", "drop_failing_blocks")),
}
_INSTEAD = {"allocate": "the allocate strategy splits one global cut across blocks by their error curves "
                        "(policy.ffn_keep, policy.allocation, policy.max_backoff, policy.drop_failing_blocks, "
                        "policy.exclude)",
            "greedy": "the greedy strategy swaps whole blocks one at a time (policy.threshold, include, order, "
                      "max_blocks, target_ratio, patience)"}


#: The policy fields ``output.size`` reads: the gate on the planned file in llama.cpp (its metric, budget,
#: bound and switch), the task budget, and for ``output.size: smallest`` the back-off. A size plan leaves
#: every block as it is (:func:`compressor.pipeline.size.baseline_only`), so every other policy field,
#: the measure settings of the structural search and the whole replacement section go unread.
SIZE_READS = ("metric", "ppl_budget", "kl_budget", "budget_mode", "confidence", "headroom", "gate", "task_budget",
              "max_backoff")
IGNORED_BY["size"] = (
    *(("policy", n) for n in PolicyConfig.model_fields if n not in SIZE_READS),
    ("policy", "max_backoff"),  # read by `smallest` only (see Recipe._fields_a_size_reads)
    *(("measure", n) for n in MeasureConfig.model_fields if n != "cache"),  # cache: the size plan's prices
    ("replacement", "kind"),
    *dict.fromkeys(("replacement", n) for c in REPLACEMENT_CONFIGS.values() for n in c.model_fields if n != "kind"),
)
_INSTEAD["size"] = ("output.size plans tensor types only: it leaves every block as it is, so neither the "
                    "structural search nor a replacement runs")


class Recipe(_Section):
    version: Literal[1] = RECIPE_VERSION
    model: ModelConfig = Field(default_factory=ModelConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    evaluation: EvaluationConfig | list[EvaluationConfig] = Field(
        default_factory=lambda: [EvaluationConfig(dataset=d) for d in DEFAULT_EVALUATION],
        description="one evaluation section, or a list of them (domains; the gate must hold on each); default: "
        "prose (embedded), code (embedded-code) and the model's own writing (self)")
    measure: MeasureConfig = Field(default_factory=MeasureConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    replacement: ReplacementConfig = Field(default_factory=PruneReplacement)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @model_validator(mode="before")
    @classmethod
    def _size_calibration(cls, data):
        """A size run's calibration mixes domains unless the recipe names its dataset (:data:`SIZE_CALIBRATION`)."""
        return size_calibration_default(data)

    @model_validator(mode="after")
    def _fields_a_size_reads(self):
        """With ``output.size`` the structural fields are not read (:data:`IGNORED_BY` ``["size"]``): one
        set to anything but its default is an error naming it, as for a strategy; checked first, so the
        strategy's own checks below never speak of a search that does not run."""
        if self.output.size is None:
            return self
        smallest = self.output.planned.kind == "smallest"
        defaults = Recipe.model_fields["replacement"].get_default(call_default_factory=True)
        for section, name in IGNORED_BY["size"]:
            if (section, name) == ("policy", "max_backoff") and smallest:
                continue
            sec = getattr(self, section)
            if name not in type(sec).model_fields:
                continue
            value = getattr(sec, name)
            default = (defaults.kind if (section, name) == ("replacement", "kind")
                       else type(sec).model_fields[name].get_default(call_default_factory=True))
            if value != default:
                only = (" (policy.max_backoff is read by output.size: smallest only)"
                        if name == "max_backoff" else "")
                raise ValueError(f"{section}.{name}: {value!r} is not read with output.size{only}: "
                                 f"{_INSTEAD['size']}. Remove {section}.{name}, or remove output.size for a "
                                 "structural compression")
        return self

    @model_validator(mode="after")
    def _allocate_needs_a_target(self):
        if self.output.size is not None:  # no search runs (_fields_a_size_reads)
            return self
        if self.strategy() == "allocate" and not self.policy.gate and self.policy.ffn_keep is None:
            raise ValueError("policy.ffn_keep: required when the allocate strategy runs without the gate "
                             "(policy.gate: false); set a fraction of FFN parameters to keep, or turn the gate on")
        if (
            self.policy.strategy == "greedy"
            and self.replacement.kind in ("prune", "hybrid")
            and self.replacement.keep is None
        ):
            raise ValueError(
                f"replacement.keep: required for kind {self.replacement.kind} with policy.strategy: greedy "
                "(the fraction of hidden units each replaced block keeps)"
            )
        return self

    @model_validator(mode="after")
    def _fields_the_strategy_reads(self):
        if self.output.size is not None:  # no strategy runs: _fields_a_size_reads
            return self
        strategy = self.strategy()
        for section, name in IGNORED_BY[strategy]:
            sec = getattr(self, section)
            if name not in type(sec).model_fields:
                continue
            value, default = getattr(sec, name), type(sec).model_fields[name].get_default(call_default_factory=True)
            if value != default:
                why = f"policy.strategy: {self.policy.strategy}" + (
                    f" (for kind {self.replacement.kind}: {strategy})" if self.policy.strategy == "auto" else "")
                other = "greedy" if strategy == "allocate" else "allocate"
                fix = f"set policy.strategy: {other} if that is the search you want"
                if "replacement" not in self.model_fields_set and strategy == "allocate":
                    # a recipe written when the default kind was affine (greedy through auto)
                    fix = ("set replacement.kind: affine for whole-block swaps (the greedy search; the default "
                           "kind is prune, which auto allocates)")
                raise ValueError(f"{section}.{name}: {value!r} is not read by {why}: {_INSTEAD[strategy]}. Remove "
                                 f"{section}.{name}, or {fix}")
        return self

    @model_validator(mode="after")
    def _architecture(self):
        """What ``output.architecture: standard`` and ``output.width_multiple`` can represent, before any model
        loads."""
        kind, out, pol = self.replacement.kind, self.output, self.policy
        if out.architecture == "standard":
            if kind != "prune":
                why = ("its bypass is an affine map, which the base class's MLP has no place for"
                       if kind == "hybrid" else "it is no subset of the MLP's hidden units")
                raise ValueError(
                    "output.architecture: standard saves the base model's own MLP with fewer hidden units, so only"
                    f" replacement.kind: prune is representable; kind {kind} is not ({why}). Use kind: prune, or"
                    " output.architecture: custom (every kind, per-block widths; the gguf format runs those in"
                    " llama.cpp)"
                )
            if pol.exclude:
                raise ValueError(
                    f"policy.exclude: {pol.exclude} with output.architecture: standard: the base class has one FFN "
                    "width, so every block is pruned to it and none can keep its original width; remove "
                    "policy.exclude, or use output.architecture: custom")
            if pol.strategy == "greedy":
                raise ValueError("policy.strategy: greedy cannot keep every block at one width (it rolls blocks back "
                                 "one by one); output.architecture: standard searches the width itself. Use "
                                 "policy.strategy: auto")
        if out.width_multiple is not None and kind not in ("prune", "hybrid"):
            raise ValueError(f"output.width_multiple applies to the hidden-unit kinds (prune, hybrid), not {kind}; "
                             "remove it")
        step, m = getattr(self.replacement, "step_units", None), width_multiple(out)
        if step is not None and m > 1 and m % step:
            raise ValueError(f"replacement.step_units: {step} does not divide the width multiple {m} "
                             "(output.width_multiple / architecture / gguf quantization): the unit-removal path "
                             f"would skip the widths the output can take; use a divisor of {m} or leave it null")
        return self

    @model_validator(mode="after")
    def _domains(self):
        if isinstance(self.evaluation, list):
            if not self.evaluation:
                raise ValueError("evaluation: give at least one section")
            names = [e.domain_name() for e in self.evaluation]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"evaluation: domain names must be distinct, {dup} repeat; set `name` on each")
        cal = self.calibration
        if cal.writes_self():
            for i, e in enumerate(self.evaluation_domains()):
                if e.self_written() and self.self_seed(e) == cal.seed:
                    field = f"evaluation.{i}.seed" if isinstance(self.evaluation, list) else "evaluation.seed"
                    raise ValueError(
                        f"{field}: {cal.seed} is calibration.seed, so the gate would score the text the "
                        "replacements were fitted on; give the evaluation another seed (or leave it unset: "
                        "calibration.seed + 1)")
        return self

    def self_seed(self, e: EvaluationConfig) -> int:
        """The seed of a ``self`` evaluation domain's text: its own, else ``calibration.seed + 1``."""
        return e.seed if e.seed is not None else self.calibration.seed + 1

    @model_validator(mode="after")
    def _tasks(self):
        named = [e for e in self.evaluation_domains() if e.tasks]
        if len(named) > 1:
            raise ValueError("evaluation: tasks are run once per model; name them in one evaluation section")
        if self.policy.task_budget is not None and not named:
            raise ValueError("policy.task_budget: gates on evaluation.tasks, and the recipe names none; add "
                             "evaluation.tasks or remove policy.task_budget")
        return self

    def task_section(self) -> EvaluationConfig | None:
        """The evaluation section that names ``tasks``, or None."""
        return next((e for e in self.evaluation_domains() if e.tasks), None)

    def strategy(self) -> str:
        """``policy.strategy`` with ``auto`` resolved: allocate for prune/hybrid, greedy otherwise."""
        if self.policy.strategy == "auto":
            return "allocate" if self.replacement.kind in ("prune", "hybrid") else "greedy"
        return self.policy.strategy

    def data_sections(self) -> list[tuple[str, "_Data"]]:
        """``(field path, section)`` of every data source: calibration, then each evaluation domain."""
        listed = isinstance(self.evaluation, list)
        return [("calibration", self.calibration)] + [
            (f"evaluation.{i}" if listed else "evaluation", cfg) for i, cfg in enumerate(self.evaluation_domains())
        ]

    def evaluation_domains(self) -> list[EvaluationConfig]:
        """The evaluation sections as a list (the single-section form is a list of one)."""
        return list(self.evaluation) if isinstance(self.evaluation, list) else [self.evaluation]

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def sha256(self) -> str:
        """Hash of the resolved recipe minus the output section (same run, any folder)."""
        d = self.to_dict()
        d.pop("output")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def measurement_sha256(self) -> str:
        """Hash of what the run measures before its gate: the recipe minus the output section and
        the policy's :data:`GATE_FIELDS`. Two recipes with the same hash take the same statistics,
        loss gradients and baseline, so a run can take them from the other's kept state."""
        d = self.to_dict()
        d.pop("output")
        for name in GATE_FIELDS:
            d["policy"].pop(name, None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


#: Policy settings read only by the gate (after pass A, the loss-gradient pass and the baseline
#: evaluation): a change to them alone keeps a run's measurements valid. ``strategy`` and
#: ``allocation`` are not among them: they decide what pass A records.
GATE_FIELDS = tuple(sorted(set(PolicyConfig.model_fields) - {"strategy", "allocation"}))
