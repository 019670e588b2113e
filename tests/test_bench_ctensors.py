"""``tools/benchlib/ctensors.py``: the pure helpers of the compressed-tensors benchmark.

The calibration windows it cuts must be the windows compressor fits on (the check runs compressor's own
calibrate-stage input on a tiny text file); KL statistics, byte counts and the quantization summary are
checked on small known inputs. Nothing is downloaded; no venv is made.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from tiny import byte_level_tokenizer
from tools.benchlib import ctensors as ct

LINES = [f"line {i}: the quick brown fox {i * 7 % 13} jumps over {i % 5} lazy dogs." for i in range(150)]


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer("\n".join(LINES), vocab_size=300)


def test_cut_windows_consecutive_and_with_bos():
    assert ct.cut_windows(list(range(10)), 3, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert ct.cut_windows(list(range(10)), 2, 4, start=99) == [[99, 0, 1, 2], [99, 3, 4, 5]]
    with pytest.raises(ValueError, match="3 windows of 3; 4 were asked for"):
        ct.cut_windows(list(range(10)), 4, 3)


@pytest.mark.parametrize("final_newline", [True, False])
def test_text_file_stream_is_compressors_reading(tmp_path, tok, final_newline):
    from compressor.inputs.data import TextSource, calibration_text_tokens

    f = tmp_path / "cal.txt"
    f.write_text("\n".join(LINES) + ("\n" if final_newline else ""), encoding="utf-8")
    for max_tokens in (50, 10_000_000):  # cut mid-document, and the whole file
        ours = ct.text_file_stream(tok, f, max_tokens)
        theirs = calibration_text_tokens(tok, TextSource(str(f)), max_tokens=max_tokens).tolist()
        assert ours == theirs


def test_compressor_fits_on_exactly_the_windows(tmp_path, tok):
    f = tmp_path / "cal.txt"
    f.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    n, seq_len = 6, 16
    windows = torch.tensor(ct.cut_windows(ct.text_file_stream(tok, f, (n + 1) * seq_len), n, seq_len))
    section = ct.compressor_calibration(f, seq_len, n)
    assert section["max_tokens"] == (n + 1) * seq_len
    assert math.ceil(section["heldout_fraction"] * (n + 1)) == 1
    got = ct.check_compressor_windows(windows, tok, section)
    assert got["identical"] and got["fit_windows"] == n and got["heldout_windows"] == 1
    with pytest.raises(AssertionError, match="differ"):
        ct.check_compressor_windows(windows.roll(1, dims=0), tok, section)


def test_heldout_seed_holds_out_the_last_windows():
    seed = ct.heldout_seed(10, 2, 0.15)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(seed))
    assert sorted(perm[:2].tolist()) == [10, 11]
    with pytest.raises(ValueError, match="holds out 1 of 12"):
        ct.heldout_seed(10, 2, 0.05)


def test_kl_summary_statistics_over_windows():
    s = ct.kl_summary([[0.0, 0.2, 0.1], [0.3, 0.5, 0.4]], [[True, True, False], [True, False, False]])
    assert s["mean"] == pytest.approx(0.25)
    assert s["mean_se"] == pytest.approx(0.15)  # two window means, 0.1 and 0.4: SD 0.2121 / sqrt(2)
    assert s["median"] == pytest.approx(0.25) and s["max"] == pytest.approx(0.5)
    assert s["p99"] == pytest.approx(0.495)
    assert s["same_top"] == pytest.approx(0.5) and s["tokens"] == 6 and s["windows"] == 2


def test_bytes_count_tied_weights_once(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    b = ct.module_bytes(model)
    assert b["parameters"] == 2 * sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once
    assert sum(b["by_dtype"].values()) == b["total"] == b["parameters"] + b["buffers"]  # buffers: rotary inv_freq
    model.save_pretrained(tmp_path)
    disk = ct.safetensors_bytes(tmp_path)
    assert disk["safetensors"] == (tmp_path / "model.safetensors").stat().st_size > b["parameters"]


def test_quantization_summary():
    config = {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "version": "0.20.0",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                                                  "symmetric": True, "actorder": "static", "dynamic": False}}}}}
    s = ct.quantization_summary(config)
    assert s["format"] == "pack-quantized" and s["ignore"] == ["lm_head"]
    assert s["config_groups"]["group_0"]["weights"] == {"num_bits": 4, "type": "int", "strategy": "group",
                                                        "group_size": 32, "symmetric": True, "actorder": "static"}
    assert ct.quantization_summary({"model_type": "llama"}) is None


def test_setup_commands_pin_torch(tmp_path):
    cmds = ct.setup_commands(tmp_path, "llmc")
    assert cmds[0][1:3] == ["-m", "venv"]
    assert cmds[2][-1] == ct.TORCH_SPEC
    assert cmds[3][-3:] == ["-c", str(tmp_path / "constraints.txt"), "llmcompressor==0.14.0.1"]
