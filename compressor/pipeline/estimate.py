"""How long a run will take, said before the heavy work starts.

A run's stages are forward passes over known token counts (calibration,
evaluation), statistics products whose size follows from the config, and
per-block solves of the hidden-unit statistics (cubic in the FFN width). The
estimate times one forward pass of this model on this machine (a couple of
calibration-sized windows, a few seconds even at 1.5B parameters) and, when
the calibration text is still to be written, two decoding steps at the
self-calibration batch; everything else is that forward speed times counts
read from the recipe and the config. The constants below are set from operation
counts, and scaled where a measured run of the default recipe on the 2-core
CPU disagreed (docs/checkpoints.md): Qwen2.5-Coder-1.5B's loss gradients,
pass A per block and gate re-solve, measured after the path and solve were
made faster; with the earlier constants, SmolLM2-135M 5 min said, 5.8 min
taken, and Gemma-3-270M the loss gradients, pass A and gate within 20 %
(not re-checked since). A guide, not a
promise.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from compressor.core.onload import input_device
from compressor.recipe.schema import Recipe

logger = logging.getLogger(__name__)

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
#: block's path (11.4 s against 47.9 s at 8,192 of 8,960 units: tools/results/bench_pass_a_pieces.json),
#: but an attempt re-solves only the blocks the allocation narrows, and a width solved once is reused:
#: Qwen2.5-Coder-1.5B's default run spent 448 s on re-solves over 5 attempts, 0.28 of 28 × 11.4 s each.
REFIT_SHARE = 0.24 * 0.28


@dataclass
class Estimate:
    stages: dict[str, float] = field(default_factory=dict)
    """Expected seconds per stage, in run order."""
    forward_s_per_token: float = float("nan")

    @property
    def total_s(self) -> float:
        return sum(self.stages.values())

    def describe(self) -> str:
        parts = ", ".join(f"{k} {_minutes(v)}" for k, v in self.stages.items() if v >= 30)
        return f"about {_minutes(self.total_s)} on this machine" + (f" ({parts})" if parts else "")


def _minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"


@torch.no_grad()
def forward_seconds_per_token(model: nn.Module, seq_len: int, rows: int = 2) -> float:
    """Seconds per token of one forward pass over ``rows`` windows of ``seq_len`` random ids (after a
    warm-up call on one short window)."""
    device, vocab = input_device(model), model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g).to(device)
    model(input_ids=ids[:1, : min(seq_len, 16)], use_cache=False)
    t = time.perf_counter()
    model(input_ids=ids, use_cache=False)
    return (time.perf_counter() - t) / ids.numel()


@torch.no_grad()
def decode_seconds_per_token(model: nn.Module, batch: int, steps: int = 3) -> float:
    """Seconds per sampled token of self-calibration (its batch, its thread rule), from ``steps`` steps."""
    from compressor.inputs.selfcal import SelfCalSettings, decode_threads

    device = input_device(model)
    prompt = torch.zeros(batch, 2, dtype=torch.long, device=device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(decode_threads(model, threads))
    st = SelfCalSettings()  # sampled as self-calibration samples: top-p sorts the whole vocabulary each step
    kw = dict(attention_mask=torch.ones_like(prompt), do_sample=True, temperature=st.temperature, top_p=st.top_p,
              top_k=0, eos_token_id=None, pad_token_id=0)
    try:
        with torch.random.fork_rng(devices=[]):  # the probe's sampling leaves the global RNG as it was
            model.generate(input_ids=prompt, max_new_tokens=1, **kw)  # warm-up
            t = time.perf_counter()
            model.generate(input_ids=prompt, max_new_tokens=steps, **kw)
            return (time.perf_counter() - t) / (steps * batch)
    finally:
        torch.set_num_threads(threads)


def _shape(model: nn.Module) -> tuple[int, int, int, int, int]:
    cfg = getattr(model.config, "text_config", None) or model.config
    d = int(cfg.hidden_size)
    ff = int(getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * d)
    return d, ff, int(cfg.num_hidden_layers), int(cfg.vocab_size), sum(p.numel() for p in model.parameters())


def estimate_run(recipe: Recipe, model: nn.Module, *, self_text_cached: bool, hidden: bool,
                 recorded: dict | None = None, self_eval_tokens: int = 0) -> Estimate:
    """Expected seconds per stage of ``recipe`` on ``model`` (already loaded) on this machine.
    ``recorded``: what a saved run state already holds (:meth:`~compressor.engine.runstate.RunState.recorded`),
    which a resumed run does not measure again. ``self_eval_tokens``: tokens of ``self`` evaluation text the
    model is still to write (not in the cache)."""
    recorded = recorded or {}
    c, pol, rc = recipe.calibration, recipe.policy, recipe.replacement
    fwd = forward_seconds_per_token(model, c.seq_len)
    d, ff, layers, vocab, params = _shape(model)
    macs = max(params - vocab * d, 1) + vocab * d  # the blocks, and the output layer (tied or not)
    per_mac = fwd / macs
    width = d + ff if hidden else d
    stats = layers * width * width / macs  # statistics products per token, over the forward's
    cal = c.max_tokens
    fit = int(cal * (1 - c.heldout_fraction))
    evals = sum(e.max_tokens for e in recipe.evaluation_domains())
    out: dict[str, float] = {}
    if c.writes_self() and not self_text_cached:
        out["self-calibration"] = c.self_written_tokens() * decode_seconds_per_token(model, 32)
    if self_eval_tokens:
        out["self-written evaluation"] = self_eval_tokens * decode_seconds_per_token(model, 32)
    from compressor.pipeline import size

    sized = size.sizing(recipe).estimate(model, cal, evals, fwd, params)
    if sized is not None:  # a size plan: its own stages, no structural search
        return Estimate({**out, **sized}, fwd)
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
    writers = recipe.output.writers()
    out["write + verify"] = evals * fwd * len(writers) * (2 if "gguf" in writers else 1)
    return Estimate(out, fwd)


def say_estimate(recipe: Recipe, model: nn.Module, *, self_text_cached: bool, hidden: bool,
                 recorded: dict | None = None, self_eval_tokens: int = 0) -> Estimate | None:
    """Log the estimate (never fails a run: a model that cannot be timed is simply not estimated)."""
    try:
        est = estimate_run(recipe, model, self_text_cached=self_text_cached, hidden=hidden, recorded=recorded,
                           self_eval_tokens=self_eval_tokens)
    except Exception as err:  # noqa: BLE001 - an estimate is a courtesy, the run goes on without it
        logger.debug("no time estimate: %s", err)
        return None
    logger.info("expected run time: %s", est.describe())
    return est
