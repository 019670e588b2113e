"""The calibrate stage's inputs: calibration windows and evaluation token streams from a recipe.

* :func:`evaluation_streams` — token ids per evaluation domain read from text,
  disjoint from calibration text; needs only the tokenizer, so a too-small
  evaluation set fails before the model loads;
* :func:`self_evaluation_streams` — the ``self`` domains: text the original
  model writes under its own seed, once the model is loaded;
* :func:`build_calibration` — the calibration windows, each source's share of
  ``calibration.max_tokens`` (``CalibrationConfig.shares``: a list of sources by
  weight, ``mix``, or one source); ``self`` is text the model writes,
  :mod:`compressor.inputs.selfcal`.
"""

from __future__ import annotations

import logging
import time

import torch

from compressor.core.errors import InputError
from compressor.inputs.data import (CalibrationSet, TextSource, calibration_text_tokens, evaluation_tokens,
                                    start_windows, window_start, windows_from)
from compressor.inputs.load import load_tokenizer as _load_tokenizer
from compressor.inputs.load import resolve_source
from compressor.recipe.schema import CalibrationSource, ModelConfig, Recipe

logger = logging.getLogger(__name__)


class DataInput:
    """Turn a data problem found while reading/tokenizing text (too few tokens,
    missing column…) into an :class:`InputError` naming the recipe field."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ, exc, tb) -> bool:
        if typ is not None and issubclass(typ, ValueError) and not issubclass(typ, InputError):
            raise InputError(f"{self.field}: {exc}") from exc
        return False


def source_text(cfg) -> TextSource:
    """The text a data section reads (its ``dataset``), or one entry of a calibration list (its ``source``)."""
    name = cfg.source if isinstance(cfg, CalibrationSource) else cfg.dataset
    return TextSource(name, cfg.config, cfg.split, cfg.text_column)


def load_tokenizer(mc: ModelConfig):
    """The tokenizer alone (no weights): enough to size the evaluation text before the model loads."""
    return _load_tokenizer(resolve_source(mc.source, mc.gguf_file), trust_remote_code=mc.trust_remote_code,
                           revision=mc.revision)


def calibration_texts(recipe: Recipe) -> list[TextSource]:
    """The text sources the calibration reads, in order (not the model's own writing: ``self`` reads none,
    ``mix`` the embedded prose, a list each of its other entries)."""
    return [source_text(s) for _, s in recipe.calibration.read_sources()]


def evaluation_streams(recipe: Recipe, tokenizer) -> dict[str, torch.Tensor]:
    """Token ids per evaluation domain read from text (not the ``self`` domains, which the model writes:
    :func:`self_evaluation_streams`), disjoint from calibration text; raises :class:`InputError` when a
    domain is below ``evaluation.min_tokens`` (needs only the tokenizer)."""
    cal_src = calibration_texts(recipe)
    start = window_start(tokenizer)
    out = {}
    for e in recipe.evaluation_domains():
        if e.self_written():  # written once the model is loaded; its size is the schema's (whole rows)
            continue
        ids = evaluation_tokens(tokenizer, source_text(e), cal_src, max_tokens=e.max_tokens)
        if start is not None and e.stride == e.seq_len:  # every window starts as the model's input does
            ids = start_windows(ids, e.seq_len, start)[: e.max_tokens]
        elif start is not None:
            logger.warning("evaluation domain %r: the tokenizer starts every sequence with BOS, but windows that "
                           "overlap (stride %d < seq_len %d) cannot each start with it; set evaluation.stride "
                           "equal to seq_len", e.domain_name(), e.stride, e.seq_len)
        if ids.numel() < e.min_tokens:
            raise InputError(
                f"evaluation domain {e.domain_name()!r} ({e.dataset}) has {ids.numel()} tokens, fewer than "
                f"evaluation.min_tokens={e.min_tokens}: a perplexity on so little text is noise. Give more "
                "evaluation text (or lower min_tokens knowingly)."
            )
        out[e.domain_name()] = ids
    return out


def self_evaluation_settings(recipe: Recipe, e, tokenizer, vocab: int):
    """The :class:`~compressor.inputs.selfcal.SelfCalSettings` of a ``self`` evaluation domain: rows of exactly
    ``e.seq_len`` ids (the prompt, then sampled tokens), so each row is one window, under the domain's seed."""
    from compressor.inputs.selfcal import SelfCalSettings, prompt_length

    return SelfCalSettings(n_tokens=e.max_tokens, seq_len=e.seq_len - prompt_length(tokenizer, vocab),
                           seed=recipe.self_seed(e))


def self_evaluation_domains(recipe: Recipe) -> list:
    """The evaluation sections the model writes (``dataset: self``)."""
    return [e for e in recipe.evaluation_domains() if e.self_written()]


def self_evaluation_streams(recipe: Recipe, model, tokenizer, use_cache: bool,
                            model_fp: str | None = None) -> dict[str, torch.Tensor]:
    """Token ids of each ``self`` evaluation domain: the original model's own writing, sampled as the
    calibration's is (:mod:`compressor.inputs.selfcal`, cached the same way) under the domain's seed, which is
    never the calibration's. Whole rows only: ``max_tokens // seq_len`` windows."""
    from compressor.inputs.selfcal import self_calibration_tokens

    vocab = model.get_input_embeddings().weight.shape[0]
    out = {}
    for e in self_evaluation_domains(recipe):
        ids = self_calibration_tokens(model, tokenizer, self_evaluation_settings(recipe, e, tokenizer, vocab),
                                      use_cache=use_cache, model_fp=model_fp,
                                      desc=f"evaluation text {e.domain_name()!r} (the model's own writing)")
        out[e.domain_name()] = ids[: e.written_tokens()]
    return out


def self_settings(recipe: Recipe):
    """The :class:`~compressor.inputs.selfcal.SelfCalSettings` of the calibration's own writing (``self``, ``mix``
    or a list naming ``self``): its share of ``max_tokens``."""
    from compressor.inputs.selfcal import SelfCalSettings

    c = recipe.calibration
    return SelfCalSettings(n_tokens=c.self_written_tokens(), seq_len=c.seq_len, seed=c.seed)


def build_calibration(recipe: Recipe, model, tokenizer, use_cache: bool,
                      model_fp: str | None = None) -> tuple[CalibrationSet, dict]:
    """Calibration windows for ``calibration.dataset``: each source's share of ``max_tokens``, cut into windows
    one source at a time, in the recipe's order. Text read from a source an evaluation domain also reads is its
    even-numbered documents (the embedded texts: their calibration halves), so no gate window is fitted on;
    ``self`` is written by the model (``model_fp``: its fingerprint, when the caller has computed it already)."""
    from compressor.inputs.selfcal import self_calibration_tokens

    c = recipe.calibration
    evaluation = [source_text(e) for e in recipe.evaluation_domains() if not e.self_written()]
    info = {"dataset": c.model_dump(mode="json")["dataset"], "self_tokens": 0, "sources": []}
    streams, names = [], []
    for s, n in c.shares():
        if s.source == "self":
            t0 = time.perf_counter()
            ids = self_calibration_tokens(model, tokenizer, self_settings(recipe), use_cache=use_cache,
                                          model_fp=model_fp)
            info.update(self_tokens=int(ids.numel()), self_s=time.perf_counter() - t0)
            names.append(f"{ids.numel()} self-generated tokens")
        else:
            ids = calibration_text_tokens(tokenizer, source_text(s), max_tokens=n, evaluation=evaluation)
            names.append(s.source)
            if ids.numel() < n:
                logger.warning("calibration source %r gave %d tokens of its share %d: it holds no more text "
                               "(the other sources are not topped up)", s.source, ids.numel(), n)
        streams.append(ids.flatten().to(torch.long))
        info["sources"].append({"source": s.source, "weight": s.weight, "share": n, "tokens": int(ids.numel())})
    cal = windows_from(tokenizer, streams, seq_len=c.seq_len, heldout_fraction=c.heldout_fraction, seed=c.seed,
                       names=names)
    info["text_tokens"] = int(cal.fit.numel() + cal.heldout.numel()) - info["self_tokens"]
    return cal, info
