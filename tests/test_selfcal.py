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
