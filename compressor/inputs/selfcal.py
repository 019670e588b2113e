"""Self-calibration: calibration text the model writes itself.

A narrow calibration text (e.g. one manual) fits the replacement maps to that
text's activations; self-generated text follows the model's own distribution
instead, which transfers better across domains (Williams et al. 2024,
"Self-calibration for language model quantization and pruning",
arXiv 2410.17170). Sampling: temperature 1, nucleus top-p 0.95, from the BOS
token followed by one of a few generic opening words — 16 of prose, 8 of
source code (``def``, ``import``, ``#``, ``<``…), row ``i`` of a batch taking
opening ``i mod 24``, so a quarter of the rows of a 32-row batch open with code
— batched with a KV cache
(``model.generate``) under a fixed seed.

Results are cached as safetensors under ``cache_dir()/selfcal/``, keyed by the
model's weight fingerprint and every sampling setting; a second call with the
same model and settings reads the file (this module is self-contained so the
cache can move into a generic cache later).

>>> ids = self_calibration_tokens(model, tokenizer, n_tokens=4096)   # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from compressor.core.onload import input_device
from compressor.core.progress import progress
from compressor.engine.cache import cache_dir, model_fingerprint
from compressor.core.distributed import from_main

logger = logging.getLogger(__name__)

SELFCAL_FORMAT = "compressor.selfcal/v1"

#: Generic openings: one word each, so every prompt is BOS + one token and a batch needs no padding.
PROSE_OPENINGS = ("The", "In", "A", "This", "It", "We", "I", "When", "There", "One", "If", "As", "For", "To", "He",
                  "She")
#: Openings of source code. From prose openings alone a code model writes no code (Qwen2.5-Coder-1.5B wrote
#: mathematics exercises from "The"), and a cut fitted on that text is wrong for the code it is used on.
CODE_OPENINGS = ("def", "import", "class", "from", "#", "//", "function", "<")
OPENINGS = PROSE_OPENINGS + CODE_OPENINGS


@dataclass(frozen=True)
class SelfCalSettings:
    n_tokens: int = 8192
    seq_len: int = 128
    """Tokens generated per sequence (prompt excluded)."""
    batch_size: int = 32
    """Rows sampled together (a decoding step is bound by reading the weights, so wider is cheaper per token)."""
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0


def _bos(tokenizer, vocab: int) -> int | None:
    bos = tokenizer.bos_token_id
    return None if bos is None or bos >= vocab else bos


def prompt_length(tokenizer, vocab: int) -> int:
    """Ids in each row's prompt: BOS (when the tokenizer has one in the vocabulary) and one opening word."""
    return 1 + (_bos(tokenizer, vocab) is not None)


def _prompts(tokenizer, n: int, vocab: int) -> torch.Tensor:
    """``[n, L]`` prompt ids: BOS (if the tokenizer has one) + the first token of a generic word."""
    firsts = []
    for w in OPENINGS:
        ids = tokenizer(w, add_special_tokens=False)["input_ids"]
        if ids and ids[0] < vocab:
            firsts.append(ids[0])
    if not firsts:
        raise ValueError("the tokenizer produced no ids for the generic opening words")
    bos = _bos(tokenizer, vocab)
    rows = [([bos] if bos is not None else []) + [firsts[i % len(firsts)]] for i in range(n)]
    return torch.tensor(rows, dtype=torch.long)


def _key(model_fp: str, s: SelfCalSettings, tokenizer) -> str:
    blob = json.dumps({"format": SELFCAL_FORMAT, "model": model_fp, "settings": asdict(s),
                       "vocab": len(tokenizer), "bos": tokenizer.bos_token_id, "openings": OPENINGS}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _cache_path(key: str) -> Path:
    return cache_dir() / "selfcal" / f"{key}.safetensors"


def _load(path: Path) -> torch.Tensor | None:
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    try:
        return load_file(str(path))["ids"]
    except Exception as e:  # a corrupt entry is regenerated, never fatal
        logger.warning("ignoring unreadable self-calibration cache %s: %s", path, e)
        return None


def _save(path: Path, ids: torch.Tensor, meta: dict) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    save_file({"ids": ids.contiguous()}, str(tmp), metadata={k: str(v) for k, v in meta.items()})
    os.replace(tmp, path)


#: Below this many parameters a decoding step's matrix products are too small to share between
#: threads: measured on the 2-core CPU, SmolLM2-135M decodes faster on one thread (under load, 24-30
#: tokens/s vs 2.6-3.6 on two); Qwen2.5-Coder-1.5B decodes 1.1-1.4x faster on two (quiet machine,
#: batch 16-64). A fixed rule, not a timing probe, so the same machine always samples the same text.
SINGLE_THREAD_BELOW = 500_000_000


def decode_threads(model: nn.Module, available: int) -> int:
    """Intra-op threads for sampling on the CPU (see :data:`SINGLE_THREAD_BELOW`)."""
    n = sum(p.numel() for p in model.parameters())
    return 1 if n < SINGLE_THREAD_BELOW else available


class _StepTicker:
    """Advances the progress bar by one token per row at every decoding step (never stops generation):
    a batch of a large model takes minutes, and the log must not be silent through it."""

    def __init__(self, bar, rows: int, limit: int) -> None:
        self.bar, self.rows, self.limit, self.shown = bar, rows, limit, 0

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        step = min(self.rows, self.limit - self.shown)
        if step > 0:
            self.bar.update(step)
            self.shown += step
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def generate_tokens(model: nn.Module, tokenizer, settings: SelfCalSettings = SelfCalSettings(),
                    desc: str = "self-calibration text") -> torch.Tensor:
    """Sample ``settings.n_tokens`` ids from ``model`` (1-D stream; no cache).

    Each sequence is the prompt plus ``seq_len`` sampled tokens. The global RNG
    state is left untouched: sampling runs under a forked, seeded RNG, so the
    same model, settings and seed give the same ids.
    """
    from transformers import StoppingCriteriaList

    s = settings
    device = input_device(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    chunks: list[torch.Tensor] = []
    have, rounds = 0, 0
    was = model.training
    model.eval()
    t0 = time.perf_counter()
    devices = [device] if device.type == "cuda" else []
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(decode_threads(model, threads))
    # Rows never stop early: an end-of-text token stays in the stream as a document
    # boundary and the model writes on, as after any document end. Every step of every
    # row is kept, so no batch slot idles waiting for the longest row.
    no_stop = dict(eos_token_id=None, pad_token_id=0, forced_eos_token_id=None)
    with torch.random.fork_rng(devices=devices), progress(total=s.n_tokens, desc=desc, unit="tok") as bar:
        torch.manual_seed(s.seed)
        try:
            while have < s.n_tokens:
                rows = min(s.batch_size, -(-(s.n_tokens - have) // (s.seq_len + 2)))  # a smaller last batch
                prompt = _prompts(tokenizer, rows, vocab)
                # Rotate openings between batches so a small run still sees several.
                prompt[:, -1] = prompt[:, -1].roll(rounds)
                prompt = prompt.to(device)
                ticker = _StepTicker(bar, rows, s.n_tokens - have)
                out = model.generate(
                    input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                    temperature=s.temperature, top_p=s.top_p, top_k=0, max_new_tokens=s.seq_len,
                    use_cache=True, stopping_criteria=StoppingCriteriaList([ticker]), **no_stop,
                )
                rounds += 1
                before = have
                for row in out.cpu():
                    take = row[: s.n_tokens - have]
                    chunks.append(take)
                    have += len(take)
                    if have >= s.n_tokens:
                        break
                bar.update(have - before - ticker.shown)  # the prompt tokens, and any rounding
        finally:
            model.train(was)
            torch.set_num_threads(threads)
    dt = time.perf_counter() - t0
    logger.info("%s: %d tokens in %.1f s (%.0f tokens/s, batch %d)", desc, have, dt, have / max(dt, 1e-9),
                s.batch_size)
    return torch.cat(chunks)[: s.n_tokens].to(torch.long)


def self_calibration_tokens(
    model: nn.Module, tokenizer, settings: SelfCalSettings = SelfCalSettings(), *, use_cache: bool = True,
    model_fp: str | None = None, desc: str = "self-calibration text",
) -> torch.Tensor:
    """Self-generated calibration ids (1-D), from the cache when the same model and settings ran before.

    ``model_fp`` (:func:`compressor.engine.cache.model_fingerprint`) may be passed when
    the caller has it already; hashing the weights costs about a second per 500 MB.
    Under a process group rank 0 samples (or reads the cache) and every rank gets its ids.
    """
    return from_main(lambda: _tokens(model, tokenizer, settings, use_cache, model_fp, desc))


def is_cached(model_fp: str, tokenizer, settings: SelfCalSettings) -> bool:
    """Whether text for this model (fingerprint) and these settings is in the cache already."""
    return _cache_path(_key(model_fp, settings, tokenizer)).is_file()


def _tokens(model, tokenizer, settings: SelfCalSettings, use_cache: bool, model_fp: str | None,
            desc: str = "self-calibration text") -> torch.Tensor:
    if not use_cache:
        return generate_tokens(model, tokenizer, settings, desc)
    key = _key(model_fp or model_fingerprint(model), settings, tokenizer)
    path = _cache_path(key)
    ids = _load(path)
    if ids is not None and ids.numel() == settings.n_tokens:
        logger.info("%s loaded from cache %s", desc, path)
        return ids
    ids = generate_tokens(model, tokenizer, settings, desc)
    try:
        _save(path, ids, {"format": SELFCAL_FORMAT, **asdict(settings)})
    except OSError as e:  # generated text is never thrown away because the cache cannot take it
        logger.warning("could not cache the self-calibration text at %s (%s); continuing without the cache", path, e)
    return ids
