"""Scoring a file's logits window by window (:func:`compressor.evaluation.external.window_scores`), a few rows at
a time to bound memory: the same numbers, bit for bit, as the whole window at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny import random_windows, tiny_model

from compressor.evaluation import external
from compressor.evaluation.teacher import TeacherCache

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_scoring_in_row_chunks_changes_no_bit(monkeypatch):
    model = tiny_model("llama")
    tokens = random_windows(1, 300, seed=5).flatten()
    teacher = TeacherCache.build(model, tokens, seq_len=64, stride=48, batch_size=2, top_k=8)
    g = torch.Generator().manual_seed(0)
    table = torch.randn(len(tokens), model.config.vocab_size, generator=g) * 3

    def logits(ids, k):  # a student whose logits depend on the window's tokens
        h = sum(ids) % 97
        return table[h:h + k].clone()

    monkeypatch.setattr(external, "SCORE_ROWS", 10 ** 9)
    whole = external.window_scores(logits, tokens, 64, 48, teacher)
    monkeypatch.setattr(external, "SCORE_ROWS", 7)
    rows = external.window_scores(logits, tokens, 64, 48, teacher)
    assert len(whole.nll) > 3
    assert whole.nll == rows.nll and whole.tokens == rows.tokens
    assert whole.kl == rows.kl and whole.agree == rows.agree
    assert np.array_equal(whole.token_kl, rows.token_kl)
