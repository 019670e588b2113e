"""Self-calibration: seeded, deterministic, cached; leaves the global RNG alone."""

from __future__ import annotations

import pytest
import torch

from checkpoints import tiny_tokenizer
from tiny import tiny_model

from compressor.inputs import selfcal
from compressor.inputs.selfcal import SelfCalSettings, generate_tokens, self_calibration_tokens

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SETTINGS = SelfCalSettings(n_tokens=200, seq_len=16, batch_size=4, seed=0)


def test_same_seed_same_ids_and_global_rng_untouched():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(123)
    before, threads = torch.random.get_rng_state(), torch.get_num_threads()
    a = generate_tokens(model, tok, SETTINGS)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.get_num_threads() == threads
    b = generate_tokens(model, tok, SETTINGS)
    c = generate_tokens(model, tok, SelfCalSettings(**{**SETTINGS.__dict__, "seed": 1}))
    assert a.dtype == torch.long and a.shape == (200,)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert int(a.max()) < len(tok) and a[0] == tok.bos_token_id


def test_second_call_is_a_cache_hit(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESSOR_CACHE_DIR", str(tmp_path))
    model, tok = tiny_model("gpt2"), tiny_tokenizer()
    first = self_calibration_tokens(model, tok, SETTINGS)
    files = list((tmp_path / "selfcal").glob("*.safetensors"))
    assert len(files) == 1

    def boom(*a, **k):
        raise AssertionError("generated again instead of reading the cache")

    monkeypatch.setattr(selfcal, "generate_tokens", boom)
    assert torch.equal(self_calibration_tokens(model, tok, SETTINGS), first)
    # Other settings or other weights: a different entry.
    with pytest.raises(AssertionError, match="generated again"):
        self_calibration_tokens(model, tok, SelfCalSettings(**{**SETTINGS.__dict__, "seed": 5}))
    with pytest.raises(AssertionError, match="generated again"):
        self_calibration_tokens(tiny_model("gpt2", seed=1), tok, SETTINGS)


def test_progress_moves_at_every_decoding_step(monkeypatch):
    """A batch of a large model takes minutes: the log counts tokens step by step, not batch by batch."""
    counts = []

    class Bar:
        def __init__(self, *a, total=None, **k):
            self.n, self.total = 0, total

        def update(self, n=1):
            self.n += n
            counts.append(self.n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(selfcal, "progress", Bar)
    ids = generate_tokens(tiny_model("llama"), tiny_tokenizer(), SETTINGS)
    assert counts[-1] == len(ids) == SETTINGS.n_tokens  # every token counted once, none twice
    # 200 tokens in batches of 4 rows x 16 steps: many more updates than the 4 batches.
    assert len(counts) >= SETTINGS.seq_len * 3 and counts == sorted(counts)


def test_decode_threads_follow_model_size(monkeypatch):
    small = tiny_model("llama")
    assert selfcal.decode_threads(small, 2) == 1
    monkeypatch.setattr(selfcal, "SINGLE_THREAD_BELOW", 1)
    assert selfcal.decode_threads(small, 2) == 2


def test_openings_include_source_code():
    """A code model writes no code from prose openings alone (Qwen2.5-Coder wrote mathematics from "The"):
    8 of the 24 openings are code constructs, so 8 rows of each 32-row batch open with one."""
    tok = tiny_tokenizer()
    n = len(selfcal.OPENINGS)
    rows = selfcal._prompts(tok, 2 * n, len(tok))
    assert rows.shape == (2 * n, 2) and (rows[:, 0] == tok.bos_token_id).all()
    first = {w: tok(w, add_special_tokens=False)["input_ids"][0] for w in selfcal.OPENINGS}
    assert rows[:, 1].tolist() == [first[w] for w in selfcal.OPENINGS] * 2
    assert set(selfcal.CODE_OPENINGS) <= set(selfcal.OPENINGS) and len(selfcal.CODE_OPENINGS) * 3 == n
    assert {first[w] for w in selfcal.CODE_OPENINGS} != {tok.unk_token_id}
    batch = selfcal._prompts(tok, 32, len(tok))[:, 1].tolist()
    assert sum(f in {first[w] for w in selfcal.CODE_OPENINGS} for f in batch) >= 8
