"""Issue 71's minor findings, each reproduced as the new-user probe met it, with the answer it should get.

1. a Phi-3 folder llama.cpp's converter or llama.cpp cannot take: refused before pricing (exit 2), saying what the
   converter or llama.cpp said and what to change (a tokenizer class; a name llama.cpp reads as Phi-3's);
3. ``export`` of a compressed-tensors output: exit 2, plan the GGUF from the original instead;
4. ``oneshot`` without ``output_dir``: the hint it gives (``overrides={"output.path": DIR}``) works;
6. a mistyped local folder (``models/llama2`` beside ``models/llama``) is "no such folder", not Hub advice;
8. a GGUF planned from a model object is named after the model, not after the work folder it was saved in;
9. ``export --help`` lists export's exit codes, not run's.

Tiny random models with a byte-level BPE tokenizer (what llama.cpp's converter carries), nothing downloaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tiny import TEXT, byte_level_tokenizer

from compressor.cli import main
from compressor.core.errors import EXIT_INVALID, EXIT_OK, InputError

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(autouse=True)
def cache_dir(isolated_cache):
    return isolated_cache


def _phi3(folder: Path, tokenizer_class: str | None = None) -> Path:
    """A tiny Phi-3 folder with a byte-level BPE tokenizer as transformers 5 saves it ("TokenizersBackend"), or
    with ``tokenizer_class`` written into its tokenizer_config.json."""
    import transformers

    torch.manual_seed(0)
    transformers.Phi3ForCausalLM(transformers.Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=320, max_position_embeddings=256, pad_token_id=0, bos_token_id=0,
        eos_token_id=0)).float().eval().save_pretrained(folder)
    byte_level_tokenizer(TEXT).save_pretrained(folder)
    if tokenizer_class is not None:
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "tokenizer_class": tokenizer_class}))
    return folder


def _data(tmp_path: Path) -> dict:
    words = TEXT.split()
    for name, seed in (("cal.txt", 0), ("eval.txt", 1)):
        rng = np.random.default_rng(seed)
        (tmp_path / name).write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(400)) + "\n")
    return {"calibration": {"dataset": str(tmp_path / "cal.txt"), "max_tokens": 1024, "seq_len": 32},
            "evaluation": {"dataset": str(tmp_path / "eval.txt"), "max_tokens": 1024, "seq_len": 64, "stride": 64},
            "policy": {"ppl_budget": 5.0}, "measure": {"cache": False}}


def _size_recipe(tmp_path: Path, source: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": {"source": str(source), "dtype": "float32"}, **_data(tmp_path),
                                    "output": {"path": str(tmp_path / "out"), "size": "Q8_0"}}))
    return path


def _left_behind(tmp_path: Path) -> list[str]:
    """What a run of output ``out`` may leave: the output, its work folder, staging, lock, run state."""
    return sorted(p.name for p in tmp_path.iterdir() if p.name == "out" or p.name.startswith(".out."))


@pytest.fixture
def never_priced(monkeypatch):
    """Fail the test if the size stage reaches pricing (the refusal must come before it)."""
    def boom(*args, **kwargs):
        raise AssertionError("the size run was priced")

    monkeypatch.setattr("compressor.pipeline.size.prices.measure_and_price", boom)


# --------------------------------------------------------------------------------------------------
# 1. phi3
# --------------------------------------------------------------------------------------------------


def test_a_phi3_bpe_tokenizer_the_converter_cannot_read_is_refused_with_the_fix(tmp_path, capsys, never_priced):
    """transformers 5 saves a BPE tokenizer as "TokenizersBackend"; the converter's Phi-3 class then asks for a
    SentencePiece tokenizer.model. Exit 2 naming tokenizer_config.json and the class to set, no traceback."""
    src = _phi3(tmp_path / "phi3a")
    assert main(["run", str(_size_recipe(tmp_path, src))]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "tokenizer.model" in err and '"tokenizer_class": "GPT2Tokenizer"' in err, err[-2000:]
    assert str(src / "tokenizer_config.json") in err and "TokenizersBackend" in err
    assert "Traceback" not in err and 'File "' not in err
    assert _left_behind(tmp_path) == []


def test_a_name_llama_cpp_reads_as_phi3_is_refused_before_pricing(tmp_path, capsys, never_priced):
    """A folder named ``phi3b``: the converter names the model "Phi3B", and llama.cpp's vocabulary loader, which
    looks up Phi-3's tokens for any name containing "phi3", does not load it. The converter's F16 is loaded right
    after it is made: exit 2 before pricing, with what llama.cpp said, why, and what to rename."""
    src = _phi3(tmp_path / "phi3b", "GPT2Tokenizer")
    assert main(["run", str(_size_recipe(tmp_path, src))]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "unordered_map::at" in err and "'Phi3B'" in err and "'phi3b'" in err, err[-2000:]
    assert "rename the folder" in err and "'</s>'" in err
    assert "Traceback" not in err
    assert _left_behind(tmp_path) == []


def test_the_same_phi3_folder_under_another_name_converts_and_loads(tmp_path):
    """The control: the folder of the test above named ``tp`` converts, and llama.cpp loads its F16."""
    from compressor.output.gguf.check import load_failure
    from compressor.output.gguf.converter import convert

    src = _phi3(tmp_path / "tp", "GPT2Tokenizer")
    work = tmp_path / "work"
    work.mkdir()
    layout = convert(src, work / "f16.gguf", work, pre_tokenizer="gpt-2")
    assert layout.architecture == "phi3" and load_failure(work / "f16.gguf") is None


# --------------------------------------------------------------------------------------------------
# 3. export of a compressed-tensors output
# --------------------------------------------------------------------------------------------------


def test_export_of_a_compressed_tensors_output_is_refused_with_what_to_do(tmp_path, capsys):
    """``compressor export out/w4a16 --format gguf`` of a real compressed-tensors folder: exit 2 before the model
    loads (it was exit 1, ``NotRepresentableError … weight_scale``), saying to plan the GGUF from the original."""
    import transformers

    from compressor.output import WriteRequest, get_writer

    pytest.importorskip("compressed_tensors")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=320, max_position_embeddings=256)).float().eval()
    folder = tmp_path / "w4a16"
    folder.mkdir()
    request = WriteRequest(model=model, tokenizer=byte_level_tokenizer(TEXT), compression={"source_model": "models/x"},
                           source=None, dtype=torch.float32, options={"ct_scheme": "W4A16"})
    get_writer("compressed-tensors").write(request, folder)
    before = sorted(p.name for p in folder.iterdir())
    capsys.readouterr()  # what writing the folder logged
    assert main(["export", str(folder), "--format", "gguf"]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "compressed-tensors folder" in err and "output.size" in err and "models/x" in err, err[-2000:]
    assert "NotRepresentableError" not in err and "Traceback" not in err
    assert sorted(p.name for p in folder.iterdir()) == before and not list(tmp_path.glob(".*"))


# --------------------------------------------------------------------------------------------------
# 4 and 8. oneshot: the hint for an output, and the GGUF's name
# --------------------------------------------------------------------------------------------------


def test_oneshot_hint_names_an_override_that_works_and_the_file_is_named_after_the_model(tmp_path):
    """Without ``output_dir`` a size is refused with a hint; the hint's ``overrides={"output.path": DIR}`` writes
    there. The GGUF of the model object is named after the model ("Llama", as the command line names a folder
    called llama), not after the work folder it was saved into ("Hf")."""
    import transformers

    import compressor
    from compressor.output.gguf.naming import _field, _gguf

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=320, max_position_embeddings=256)).float().eval()
    assert model.config.architectures is None  # built from a config: save_pretrained would name the class
    tok = byte_level_tokenizer(TEXT)
    recipe = {**_data(tmp_path), "output": {"size": "Q8_0"}}
    with pytest.raises(InputError, match=r"overrides=\{'output.path': DIR\}"):
        compressor.oneshot(model, recipe, tokenizer=tok)
    out = tmp_path / "out"
    res = compressor.oneshot(model, recipe, tokenizer=tok, overrides={"output.path": str(out)})
    assert res.output == out and (out / "model.gguf").is_file()
    assert _field(_gguf().GGUFReader(out / "model.gguf"), "general.name") == "Llama"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")) == []
    assert model.config.architectures == ["LlamaForCausalLM"]  # what save_pretrained writes, said before the checks


def test_the_name_of_a_model_object(tmp_path):
    """A Hub id as it is (the converter's heuristic makes "SmolLM2 135M" of it), a folder by its name, else the
    model type."""
    from types import SimpleNamespace

    from compressor.output.gguf.converter import model_name

    def named(name):
        return SimpleNamespace(config=SimpleNamespace(_name_or_path=name, model_type="qwen2"))

    (tmp_path / "my-llama").mkdir()
    assert model_name(named("HuggingFaceTB/SmolLM2-135M")) == "HuggingFaceTB/SmolLM2-135M"
    assert model_name(named(str(tmp_path / "my-llama"))) == "my-llama"
    assert model_name(named("")) == "qwen2"


# --------------------------------------------------------------------------------------------------
# 6. a missing local folder
# --------------------------------------------------------------------------------------------------


def test_a_mistyped_local_folder_is_no_such_folder_not_hub_advice(tmp_path, capsys, monkeypatch, no_loading):
    """``model.source: models/llama2`` beside ``models/llama``, offline: "no such folder", the similar folder, and
    no advice to set HF_HUB_OFFLINE=1 (it is set)."""
    from checkpoints import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "models" / "llama")
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"source": "models/llama2"}, **_data(tmp_path),
                                      "output": {"path": str(tmp_path / "out")}}))
    assert main(["run", str(recipe)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "no folder 'llama2' in 'models'" in err and "did you mean 'models/llama'" in err, err
    assert "HF_HUB_OFFLINE=1" not in err and "Hub has no such repository" not in err and "Traceback" not in err


def test_offline_hub_advice_does_not_say_to_set_what_is_set(monkeypatch):
    """A Hub id not in the cache, with HF_HUB_OFFLINE=1: the advice is a local copy, not HF_HUB_OFFLINE=1."""
    import transformers

    from compressor.inputs.load import ResolvedSource, model_config

    def offline(*args, **kwargs):  # what the hub library raises offline for a model it has not cached
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them "
                      "in the cached files; you are in offline mode")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    with pytest.raises(InputError) as e:
        model_config(ResolvedSource("nobody-here/none-such-model"))
    assert "local copy" in str(e.value) and "HF_HUB_OFFLINE is set" in str(e.value), str(e.value)
    assert "set HF_HUB_OFFLINE=1" not in str(e.value)


# --------------------------------------------------------------------------------------------------
# 9. export --help
# --------------------------------------------------------------------------------------------------


def test_export_help_has_its_own_exit_codes(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["export", "--help"])
    assert stop.value.code == EXIT_OK
    out = capsys.readouterr().out
    assert "exit codes:" in out and "compressed-tensors" in out and "--overwrite" in out
    assert "--resume" not in out and "report.json" not in out
