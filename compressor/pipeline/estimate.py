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


def estimate_run(recipe: Recipe, model: nn.Module, *, self_text_cached: bool, hidden: bool,
                 recorded: dict | None = None, self_eval_tokens: int = 0) -> Estimate:
    """Expected seconds per stage of ``recipe`` on ``model`` (already loaded) on this machine: the text the
    model writes, then the workflow's own stages (:meth:`~compressor.pipeline.workflow.Workflow.estimate`).
    ``recorded``: what a saved run state already holds (:meth:`~compressor.engine.runstate.RunState.recorded`),
    which a resumed run does not measure again. ``self_eval_tokens``: tokens of ``self`` evaluation text the
    model is still to write (not in the cache)."""
    from compressor.pipeline.preflight import workflow_for

    c = recipe.calibration
    fwd = forward_seconds_per_token(model, c.seq_len)
    out: dict[str, float] = {}
    if c.writes_self() and not self_text_cached:
        out["self-calibration"] = c.self_written_tokens() * decode_seconds_per_token(model, 32)
    if self_eval_tokens:
        out["self-written evaluation"] = self_eval_tokens * decode_seconds_per_token(model, 32)
    out.update(workflow_for(recipe).estimate(model, fwd, hidden=hidden, recorded=recorded or {}))
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
