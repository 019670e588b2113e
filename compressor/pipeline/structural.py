"""The structural workflow: replace FFN blocks with closed-form fits (the policy's search and gate), then write
every requested format as it is and verify each (:mod:`.writing`). Chosen by
:func:`~compressor.pipeline.workflow.workflow_for` for a recipe without ``output.size``."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from compressor.core import distributed as dist
from compressor.core.errors import InputError
from compressor.engine.records import ResumeError
from compressor.output import get_writer
from compressor.policy.compress import CompressionResult, compress_model
from compressor.recipe.schema import Recipe

logger = logging.getLogger(__name__)


class StructuralWorkflow:
    """A run that replaces blocks (or, with a gate that allows none, keeps them all)."""

    changes_blocks = True

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    def default_formats(self, model_type: str, src) -> list[str]:
        """``[hf]``, and the source's own format beside it where the source is a file a writer re-writes in its
        own architecture and quantization (a GGUF the gguf writer takes)."""
        from compressor.output.registry import source_format

        fmt = source_format(src)
        if fmt is None:
            return ["hf"]
        why = get_writer(fmt).source_refusal(model_type)
        if why is not None:
            logger.info("output.formats: [hf], no %s: %s", fmt, why)
            return ["hf"]
        return ["hf", fmt]

    def check_config(self, config, *, writes: bool, given: bool) -> None:
        from compressor.core.archs import moe_refusal

        if (why := moe_refusal(config, size=False, offload=self.recipe.model.offload)) is not None:
            raise InputError(why)

    def check_evaluation(self, streams: dict[str, torch.Tensor], *, writes: bool) -> None:
        """``policy.confirm_fraction`` leaves at least two windows (a standard error) on each side of every
        domain's split."""
        from compressor.evaluation.gate import confirmation_windows
        from compressor.evaluation.perplexity import window_count

        recipe = self.recipe
        f = recipe.policy.confirm_fraction
        if not f:
            return
        for e in recipe.evaluation_domains():
            tokens = e.written_tokens() if e.self_written() else streams[e.domain_name()].numel()
            windows = window_count(tokens, e.seq_len, e.stride)
            held = len(confirmation_windows(windows, f))
            if min(held, windows - held) < 2:
                raise InputError(
                    f"policy.confirm_fraction: {f:g} of evaluation domain {e.domain_name()!r}'s {windows} windows "
                    f"(seq_len {e.seq_len}) leaves {held} held out for confirmation and {windows - held} for the "
                    "search; each needs at least 2 (a standard error). Give more evaluation text "
                    "(evaluation.max_tokens), shorter windows (evaluation.seq_len), another fraction, or "
                    "policy.confirm_fraction: 0 (no confirmation)")

    def check_writers(self, tokenizer, model_type: str, src, config) -> None:
        from compressor.pipeline.formats import refuse_writer, writer_refusals

        for name, why in writer_refusals(self.recipe, self.recipe.replacement.kind, tokenizer, model_type, src).items():
            refuse_writer(self.recipe.output, name, why)

    def compress(self, loaded, calibrated, checked) -> CompressionResult:
        """The policy engine: measure, fit, select and gate (:func:`compressor.policy.compress.compress_model`)."""
        try:
            return compress_model(loaded.model, self.recipe, calibrated.cal, checked.eval_streams,
                                  state=checked.state, width_multiple=checked.width_multiple, grid=checked.grid)
        except ResumeError as err:  # a saved state out of step with this run
            raise InputError(str(err)) from None

    def ship(self, request, windows: torch.Tensor, checked, report: dict, result: CompressionResult, *,
             use_cache: bool) -> Path:
        """Every format written into one staging folder, each reloaded and checked."""
        from compressor.pipeline.writing import verify, write

        staged = write(self.recipe.output, request, checked, report["timings"])
        verify(self.recipe.output, request, staged, report)
        return staged.folder

    def follow(self, request, windows: torch.Tensor) -> tuple:
        """Rank 0 writes alone: wait for its last word."""
        return dist.broadcast_object()

    def estimate(self, model, fwd: float, *, hidden: bool, recorded: dict) -> dict[str, float]:
        return structural_parts(self.recipe, model, fwd, hidden=hidden, recorded=recorded)


#: Forward+backward over forward, for the loss-gradient pass (Qwen2.5-Coder-1.5B: 2.05 measured).
BACKWARD_FACTOR = 2.2
#: Seconds of one block's hidden-unit solve path per (width)³, in units of the measured seconds per
#: forward multiply-add (float64 factorisations run slower than float32 matrix products).
#: Qwen2.5-Coder-1.5B: 48 s per block (measured, 10,496 regressors).
SOLVE_FACTOR = 3.2
#: Statistics products per token run slower than the forward's matrix products (float64 merges,
#: the spill to disk): Qwen2.5-Coder-1.5B's forward and statistics took 48 s per block, 1.5× the
#: forward-speed count.
STATS_FACTOR = 1.5
#: A gate attempt's re-solves, relative to every block's full path: one re-solve is 0.24 of its
#: block's path (11.4 s against 47.9 s at 8,192 of 8,960 units: tools/structural/results/bench_pass_a_pieces.json),
#: but an attempt re-solves only the blocks the allocation narrows, and a width solved once is reused:
#: Qwen2.5-Coder-1.5B's default run spent 448 s on re-solves over 5 attempts, 0.28 of 28 × 11.4 s each.
REFIT_SHARE = 0.24 * 0.28


def structural_parts(recipe: Recipe, model: nn.Module, fwd: float, *, hidden: bool, recorded: dict) -> dict:
    """Expected seconds of a structural run's stages: loss gradients, pass A, the gate's attempts, the teacher
    pass, writing and verifying every format."""
    from compressor.output import get_writer

    c, pol, rc = recipe.calibration, recipe.policy, recipe.replacement
    d, ff, layers, vocab, params = _shape(model)
    macs = max(params - vocab * d, 1) + vocab * d  # the blocks, and the output layer (tied or not)
    per_mac = fwd / macs
    width = d + ff if hidden else d
    stats = layers * width * width / macs  # statistics products per token, over the forward's
    cal = c.max_tokens
    fit = int(cal * (1 - c.heldout_fraction))
    evals = sum(e.max_tokens for e in recipe.evaluation_domains())
    out: dict[str, float] = {}
    strategy = pol.strategy
    needs_gradients = strategy == "allocate" and pol.allocation == "fisher" or getattr(rc, "selection", "obs") == "loss"
    if needs_gradients and not recorded.get("gradients"):
        out["loss gradients"] = min(fit, 128 * c.seq_len) * fwd * BACKWARD_FACTOR
    left = max(layers - recorded.get("layers", 0), 0) / layers
    out["pass A"] = left * (cal * fwd * (1 + STATS_FACTOR * stats) + (layers * width ** 3 * per_mac * SOLVE_FACTOR
                                                                      if hidden else 0.0))
    # a fixed policy.ffn_keep is one attempt (counted as passing: the guess a caller who set it makes);
    # the search tries its smallest cut first, then bisects max_backoff steps: above it when it passes,
    # below it (smaller cuts) when it fails; fewer when targets allocate the same widths
    if pol.ffn_keep is not None or not pol.gate:
        attempts = 1
    else:
        attempts = 1 + pol.max_backoff if pol.max_backoff > 1 else 1
    teacher = getattr(rc, "target", "none") not in ("none", None)
    out["gate"] = evals * fwd * (1 + attempts + (1 if teacher else 0))
    if hidden:
        out["gate"] += attempts * layers * width ** 3 * per_mac * SOLVE_FACTOR * REFIT_SHARE
    if teacher:
        out["teacher pass"] = cal * fwd * (1 + STATS_FACTOR * stats)
    out["write + verify"] = evals * fwd * sum(get_writer(w).verify_passes for w in recipe.output.writers())
    return out


def _shape(model: nn.Module) -> tuple[int, int, int, int, int]:
    cfg = getattr(model.config, "text_config", None) or model.config
    d = int(cfg.hidden_size)
    ff = int(getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * d)
    return d, ff, int(cfg.num_hidden_layers), int(cfg.vocab_size), sum(p.numel() for p in model.parameters())


__all__ = ["StructuralWorkflow", "structural_parts"]
