"""The sections of ``report.json``, typed: what :class:`~compressor.reports.schema.Report` validates.

What every run's report holds is typed — a key missing or of the wrong type fails validation, naming its path;
what is open-ended (a writer's own verification fields, a domain's KL percentiles, the planned tensors, the
recipe) is kept as extra keys beside the typed ones. :class:`ReportFields` is every top-level key; the views
(:mod:`compressor.reports.summary`, :mod:`compressor.reports.card`) read it, and
:class:`~compressor.reports.schema.Report` adds them as its methods. ``schema_version``
(:data:`SCHEMA_VERSION`) changes when a key is renamed or removed or its meaning changes; a new key keeps it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

#: The version of report.json's keys (``schema_version``): pipelines that read it check it.
SCHEMA_VERSION = 1
#: The report's ``schema`` key (kept beside ``schema_version``: earlier readers look for it).
REPORT_SCHEMA = f"compressor.report/v{SCHEMA_VERSION}"


class Section(BaseModel):
    """A section of the report: its typed keys, and any other keys kept as they are."""

    model_config = ConfigDict(extra="allow")


class ModelInfo(Section):
    """What was loaded: the source as given and as resolved, and what the source says of itself."""

    source: str
    resolved: str
    model_type: str
    dtype: str
    device: str
    hub_id: str | None = None
    base_model: str | None = None
    base_model_name: str | None = None
    license: str | None = None


class Calibration(Section):
    """The calibration text the fits (or a size plan's prices) were measured on."""

    data: str
    seq_len: int
    fit_windows: int
    heldout_windows: int
    tokens: int


class Cache(Section):
    enabled: bool
    hit: bool
    key: str | None = None


class Score(Section):
    """One perplexity measurement (:class:`compressor.evaluation.perplexity.Perplexity`)."""

    ppl: float
    nll: float
    tokens: int
    seq_len: int
    stride: int
    windows: int = 0


class Perplexity(Section):
    """The primary evaluation domain before and after, and the gate's limit on it."""

    data: str
    baseline: Score
    final: Score
    budget: float
    ppl_budget: float
    budget_mode: str
    delta: float
    relative_delta: float


class Params(Section):
    before: int
    after: int
    removed: int
    ratio: float


class Block(Section):
    """One FFN block's decision (kept | rejected | not a candidate | not tried | not replaced)."""

    index: int
    decision: str
    reason: str = ""


class Split(Section):
    """A domain's change on one split of its windows (the search's, or the held-out confirmation's)."""

    windows: int
    relative_delta: float | None = None
    relative_delta_upper: float | None = None
    kl: float | None = None
    kl_upper: float | None = None
    passed: bool


class GateDomain(Section):
    """One evaluation domain as the gate measured it: the change, its confidence bound, the limit."""

    name: str
    windows: int
    passed: bool
    limit: float
    baseline_ppl: float
    metric: str = "ppl"
    dataset: str | None = None
    relative_delta: float | None = None
    relative_delta_upper: float | None = None
    kl: float | None = None
    kl_upper: float | None = None
    baseline: Score | None = None
    final: Score | None = None
    search: Split | None = None
    confirmation: Split | None = None


class Evaluation(Section):
    """What the gate was measured on, per domain, its rule, and the warnings a reader needs."""

    confidence: float
    metric: str
    passed: bool
    message: str
    domains: list[GateDomain]
    headroom: float = 0.0
    ppl_budget: float
    kl_budget: float | None = None
    budget_mode: str
    confirm_fraction: float | None = None
    confirmation: dict[str, Any] | None = None
    one_domain: bool = False
    notes: list[str] = []
    warnings: list[str] = []


class LikeWithLike(Section):
    """The source and the output at the same quantization."""

    source_bytes: int
    output_bytes: int
    ratio: float
    what: str


class Size(Section):
    """Bytes of the source and of what was written (more keys per format, e.g. ``gguf_bytes``)."""

    source_bytes: int | None = None
    output_bytes: int | None = None
    output_dtype: str
    output_dtype_is_source: bool
    like_with_like: LikeWithLike | None = None


class Continuations(Section):
    identical: float
    prompts: int
    tokens: int
    matching_prefix: float


class Agreement(Section):
    """Greedy agreement with the original: next tokens, and whole continuations of a few prompts."""

    next_token: float | None = None
    next_token_se: float | None = None
    domains: dict[str, float | None] = {}
    continuations: Continuations | None = None


class TaskRow(Section):
    task: str
    metric: str | None = None
    original: float | None = None
    compressed: float | None = None
    delta: float | None = None
    stderr: float | None = None
    samples: int | None = None
    passed: bool | None = None


class Tasks(Section):
    """lm-evaluation-harness scores of both models, and ``policy.task_budget``'s verdict."""

    budget: float | None = None
    passed: bool
    message: str | None = None
    tasks: list[TaskRow]


class Check(Section):
    """A writer's verification of what it wrote (its own keys beside these)."""

    passed: bool | None = None
    perplexity: float | None = None
    quant: str | None = None
    file_bytes: int | None = None


class Anchor(Section):
    """A file measured beside the planned one: the size's anchor, a better one of no more bytes, a rival."""

    name: str
    file_bytes: int
    called: str | None = None
    perplexity: float | None = None
    relative_change: float | None = None
    kl_mean: float | None = None
    made_by: str | None = None


class PlannedDomain(Section):
    """The planned file on one gate domain, where it runs, with the anchors' changes beside (``preset_*``,
    ``best_preset_*``: each of the file's keys again for them)."""

    name: str
    perplexity: float
    relative_change: float
    reference_perplexity: float
    relative_delta_upper: float | None = None
    confidence: float | None = None
    kl_mean: float | None = None
    kl_p99: float | None = None
    kl_p999: float | None = None
    same_top_token: float | None = None
    preset_relative_change: float | None = None
    preset_kl_mean: float | None = None
    best_preset_relative_change: float | None = None
    best_preset_kl_mean: float | None = None


class PlannedCheck(Check):
    """The verification of a size-planned file (``quant: plan``): its bytes against the budget, and per gate
    domain its change beside the anchors'."""

    quant: Literal["plan"]
    planned_format: str
    file_bytes: int
    budget_bytes: int
    planned_file_bytes: int
    predicted_relative_change: float
    domains: list[PlannedDomain] = []
    preset: Anchor | None = None
    best_preset: Anchor | None = None
    rivals: list[Anchor] = []
    gate_rule: str | None = None
    gate_passed: bool | None = None
    confidence: float | None = None


def _check_kind(value: Any) -> str:
    quant = value.get("quant") if isinstance(value, dict) else getattr(value, "quant", None)
    return "plan" if quant == "plan" else "written"


AnyCheck = Annotated[Union[Annotated[PlannedCheck, Tag("plan")], Annotated[Check, Tag("written")]],
                     Discriminator(_check_kind)]


class SearchAttempt(Section):
    file_bytes: int | None = None
    passed: bool
    tensor_bytes: int | None = None
    predicted_ppl_change: float | None = None


class Search(Section):
    """``output.size: smallest``: the plans the gate measured."""

    mode: str = "smallest"
    target_predicted_ppl_change: float
    attempts: list[SearchAttempt]


class SizePlan(Section):
    """``output.size``: the budget, the types chosen, the predicted change, every planned tensor (``tensors``)."""

    size: str
    budget_bytes: int
    types_used: dict[str, int] = {}
    predicted_ppl_change: float | None = None
    planned_file_bytes: int | None = None
    tensor_bytes: int | None = None
    preset: dict[str, Any] | None = None
    search: Search | None = None

    def types_line(self) -> str:
        """The types chosen and how many weights took each, most used first ("Q4_K ×150, Q6_K ×61")."""
        return ", ".join(f"{t} ×{n}" for t, n in sorted(self.types_used.items(), key=lambda kv: -kv[1]))


class ReportFields(BaseModel):
    """Every top-level key of ``report.json``, typed (the views read it; :class:`~compressor.reports.schema.Report`
    is it with its views as methods). Keys added later are kept as extra keys."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    schema_version: Literal[SCHEMA_VERSION] = Field(description="the version of the report's keys (docs/python-api.md)")
    schema_id: str = Field(alias="schema", description="compressor.report/v<schema_version>")
    tool_version: str
    status: Literal["success", "rejected"]
    exit_code: int
    message: str
    output: str | None
    model: ModelInfo
    recipe_sha256: str
    recipe: dict[str, Any]
    calibration: Calibration
    cache: Cache
    perplexity: Perplexity
    params: Params
    strategy: str
    allocation_attempts: list[dict[str, Any]]
    blocks: list[Block]
    profile: list[dict[str, Any]]
    timings: dict[str, float]
    resumed: bool
    snapped: dict[str, Any]
    evaluation: Evaluation
    size: Size
    agreement: Agreement
    tasks: Tasks | None = None
    verification: dict[str, AnyCheck] = {}
    reload_check: Check | None = None
    size_plan: SizePlan | None = None
    files: list[str] | None = None

    def planned(self) -> tuple[str, PlannedCheck] | None:
        """The size-planned file's format and verification entry (``quant: plan``); None without a size plan."""
        if self.size_plan is None:
            return None
        return next(((fmt, c) for fmt, c in self.verification.items() if isinstance(c, PlannedCheck)), None)

    def kept(self) -> list[int]:
        """The indices of the FFN blocks replaced."""
        return [b.index for b in self.blocks if b.decision == "kept"]
