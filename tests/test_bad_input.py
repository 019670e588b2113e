"""Every bad input gets a clean exit code and a message that says what was
wrong, what was expected and how to fix it (the README's "Bad input" table).

Runs ``compressor.cli.main`` in-process on tiny checkpoints; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from checkpoints import save_tiny_checkpoint
from test_cli import isolated, recipe_dict, write_recipe  # noqa: F401  (isolated is an autouse fixture)

from compressor.cli import main

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def _recipe_bytes(raw: bytes):
    def make(tmp, d):
        p = tmp / "recipe.yaml"
        p.write_bytes(raw)
        return p
    return make


def _recipe_folder(tmp, d):
    p = tmp / "recipes-folder"
    p.mkdir()
    return p


def _edit(fn):
    def make(tmp, d):
        fn(tmp, d)
        return write_recipe(tmp / "recipe.yaml", d)
    return make


def _data(section: str, name: str, content: bytes):
    def fn(tmp, d):
        (tmp / name).write_bytes(content)
        d[section]["dataset"] = str(tmp / name)
    return _edit(fn)


def _model_file(name: str, content: bytes):
    def fn(tmp, d):
        (tmp / name).write_bytes(content)
        d["model"]["source"] = str(tmp / name)
    return _edit(fn)


def _parquet(tmp, d):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["hello", "world"]}), str(tmp / "cal.parquet"))
    d["calibration"]["dataset"] = str(tmp / "cal.parquet")
    return write_recipe(tmp / "recipe.yaml", d)


def _policy(**values):
    return _edit(lambda tmp, d: d["policy"].update(values))


BAD = [
    # id, recipe maker, exit code, substrings of stderr
    ("recipe-binary", _recipe_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR"), 2, ["recipe.yaml", "binary file", "YAML"]),
    ("recipe-not-utf8", _recipe_bytes("model:\n  source: café\n".encode("latin-1")), 2,
     ["recipe.yaml", "not UTF-8", "offset"]),
    ("recipe-is-folder", _recipe_folder, 2, ["is a folder", "expected a YAML recipe file"]),
    ("model-source-binary-file", _model_file("weights.bin", b"\0\1\2" * 100), 2,
     ["model.source", "is a file, not a model", "save_pretrained folder"]),
    ("model-source-fake-gguf", _model_file("model.gguf", b"not really"), 2, ["model.source", "not a GGUF file"]),
    ("empty-calibration-file", _data("calibration", "cal.txt", b""), 2, ["calibration.dataset", "cal.txt", "empty"]),
    ("empty-evaluation-file", _data("evaluation", "ev.jsonl", b""), 2, ["evaluation.dataset", "ev.jsonl", "empty"]),
    ("whitespace-calibration-file", _data("calibration", "cal.txt", b"\n \n\t\n"), 2,
     ["calibration.dataset", "only whitespace"]),
    ("non-utf8-calibration-file", _data("calibration", "cal.txt", "café ".encode("latin-1") * 50), 2,
     ["calibration.dataset", "not UTF-8", "iconv"]),
    ("binary-evaluation-file", _data("evaluation", "ev.txt", b"\0\xff\xfe" * 100), 2,
     ["evaluation.dataset", "not UTF-8", "binary"]),
    ("jsonl-without-text-column", _data("calibration", "cal.jsonl", b'{"content": "hello"}\n'), 2,
     ["calibration.dataset", "no text column 'text'", "content", "text_column"]),
    ("csv-without-text-column", _data("evaluation", "ev.csv", b"id,body\n1,hello\n"), 2,
     ["evaluation.dataset", "no text column 'text'", "body"]),
    ("parquet-without-text-column", lambda tmp, d: _parquet(tmp, d), 2,
     ["calibration.dataset", "no text column 'text'", "body"]),
    ("unsupported-data-suffix", _data("calibration", "cal.docx", b"PK\3\4"), 2, ["calibration.dataset", ".docx", ".txt"]),
    ("threshold-true", _policy(threshold=True), 2, ["policy.threshold", "valid number", "True"]),
    ("gate-yes", _policy(gate="yes"), 2, ["policy.gate", "valid boolean", "'yes'"]),
    ("min-blocks-float", _policy(min_blocks=1.0), 2, ["policy.min_blocks", "valid integer"]),
]


def _refused_before_loading(tmp_path, capsys, monkeypatch, make, expected, *, command="run", code=2) -> None:
    """``command`` on the recipe ``make`` writes exits ``code`` quickly, says every ``expected`` piece, shows
    no traceback, loads no model and writes nothing."""
    import time

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("compressor.pipeline.stages.load_model", boom)
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    d = recipe_dict(src, tmp_path / "out")
    path = make(tmp_path, d)
    before = _tree(tmp_path)
    t0 = time.perf_counter()
    rc = main([command, str(path)])
    err = capsys.readouterr().err
    assert rc == code, err
    assert time.perf_counter() - t0 < 30
    for s in expected:
        assert s in err, f"{s!r} not in stderr:\n{err}"
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("make, code, expected", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_before_loading(tmp_path, capsys, monkeypatch, make, code, expected):
    _refused_before_loading(tmp_path, capsys, monkeypatch, make, expected, code=code)


def test_int_for_float_and_set_bool_still_work(tmp_path, capsys):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    d = recipe_dict(src, tmp_path / "out")
    d["policy"]["ppl_budget"] = 1  # an int where a float is expected is fine
    path = write_recipe(tmp_path / "r.yaml", d)
    assert main(["run", str(path), "--dry-run", "--set", "policy.gate=false", "--set", "measure.cache=true"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["policy"]["gate"] is False and resolved["policy"]["ppl_budget"] == 1.0
    assert main(["run", str(path), "--dry-run", "--set", "policy.gate=yes-please"]) == 2
    assert "policy.gate" in capsys.readouterr().err


def test_ten_token_calibration_file_is_exit_2(tmp_path, capsys):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    d = recipe_dict(src, tmp_path / "out")
    (tmp_path / "cal.txt").write_text("one two three four five six seven eight nine ten\n")
    d["calibration"]["dataset"] = str(tmp_path / "cal.txt")
    rc = main(["run", str(write_recipe(tmp_path / "r.yaml", d))])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "calibration.dataset" in err and "calibration tokens" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_nan_weight_names_the_parameter(tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    sd["model.layers.1.mlp.up_proj.weight"][4, 5] = float("inf")
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    rc = main(["run", str(write_recipe(tmp_path / "r.yaml", recipe_dict(src, tmp_path / "out")))])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "model.layers.1.mlp.up_proj.weight (block 1) has 1 NaN and 1 Inf value(s)" in err
    assert "checkpoint is corrupt" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert torch.isnan(load_file(str(src / "model.safetensors"))["model.layers.1.mlp.up_proj.weight"]).sum() == 1


def test_profile_also_refuses_nan_weights(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert main(["profile", str(src), "--seq-len", "32", "--max-tokens", "512"]) == 2
    assert "model.layers.0.mlp.down_proj.weight (block 0)" in capsys.readouterr().err


def test_activation_overflow_names_block_and_dtype():
    import torch

    from compressor.core.finite import NonFiniteActivationError, check_activations_finite

    check_activations_finite(0, "FFN input", torch.ones(2, 3), torch.float32)  # finite: no error
    t = torch.tensor([[1.0, float("inf")], [float("nan"), 0.0]], dtype=torch.float16)
    with pytest.raises(NonFiniteActivationError) as e:
        check_activations_finite(7, "FFN output", t, torch.float16)
    msg = str(e.value)
    assert isinstance(e.value, FloatingPointError)
    assert "block 7" in msg and "FFN output" in msg and "1 NaN and 1 Inf" in msg
    assert "overflowed float16" in msg and "model.dtype: float32" in msg
    with pytest.raises(NonFiniteActivationError, match="weights or inputs are not finite"):
        check_activations_finite(2, "FFN input", t.float(), torch.float32)


def test_activation_check_runs_during_measurement(tiny_model):
    import torch

    from compressor.core.errors import NonFiniteActivationError
    from compressor.engine.measure import collect

    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("inf")
    ids = torch.randint(2, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteActivationError, match="block 1: FFN output"):
        collect(model, ids[:2], ids[2:])


def test_report_json_has_sizes(tmp_path):
    import compressor

    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    d = recipe_dict(src, tmp_path / "out")
    res = compressor.run(compressor.recipe_from_dict(d))
    size = json.loads((res.output / "report.json").read_text())["size"]
    assert size["source_bytes"] == (src / "model.safetensors").stat().st_size
    assert size["output_bytes"] == (res.output / "model.safetensors").stat().st_size
    assert size["output_bytes"] < size["source_bytes"]
    assert size["output_dtype"] == "float32"
    # like with like: the source's dtype on both sides, so the two sizes compare directly
    same = size["like_with_like"]
    assert same["output_bytes"] == size["output_bytes"] and same["ratio"] == size["output_bytes"] / size["source_bytes"]
    assert "source's dtype" in same["what"]


# --------------------------------------------------------------------------------------------------
# Issue 34: the inputs a new user tries, each refused before any work, by `run` and by `validate`
# --------------------------------------------------------------------------------------------------


def _compressed_source(tmp, d):
    """An earlier compressor output (compressor's own classes) given as the source."""
    src = Path(d["model"]["source"])
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(model_type="compressed_llama", compression={"tool": "compressor", "source_model": "org/original"})
    (src / "config.json").write_text(json.dumps(cfg))
    return write_recipe(tmp / "recipe.yaml", d)


def _plain_folder(tmp, d):
    (tmp / "texts").mkdir()
    (tmp / "texts" / "a.txt").write_text("hello\n")
    d["calibration"]["dataset"] = str(tmp / "texts")
    return write_recipe(tmp / "recipe.yaml", d)


def _section(section: str, **values):
    return _edit(lambda tmp, d: d.setdefault(section, {}).update(values))


NO_MODEL_NEEDED = [
    ("compressor-output-as-source", _compressed_source, ["model.source", "compressor output", "org/original"]),
    ("data-folder-not-saved-dataset", _plain_folder, ["calibration.dataset", "not a dataset saved", "a.txt"]),
    ("hf-scheme-dataset-name", _section("calibration", dataset="hf:Salesforce/wikitext"),
     ["calibration.dataset", "not a Hub dataset name", "'Salesforce/wikitext'"]),
    ("evaluation-past-context", _section("evaluation", seq_len=128, stride=128, max_tokens=1024),
     ["evaluation.seq_len", "128", "max_position_embeddings 64"]),
    ("calibration-seq-len-huge", _section("calibration", seq_len=100000),
     ["calibration", "seq_len (100000)", "fewer than two windows"]),
    ("keep-under-allocate", _edit(lambda tmp, d: d.update(replacement={"kind": "prune", "keep": 0.5},
                                                          policy={"ppl_budget": 0.5})),
     ["replacement.keep", "0.5", "allocate", "policy.strategy: greedy"]),
    ("threshold-under-allocate", _edit(lambda tmp, d: d.update(replacement={"kind": "prune"})),
     ["policy.threshold", "-100", "allocate"]),
    ("greedy-fields-under-the-default-kind", _edit(lambda tmp, d: d.pop("replacement")),
     ["policy.threshold", "the default kind is prune", "replacement.kind: affine"]),
    ("ffn-keep-1", _edit(lambda tmp, d: d.update(replacement={"kind": "prune"}, policy={"ffn_keep": 1})),
     ["policy.ffn_keep", "nothing would be compressed"]),
]


@pytest.mark.parametrize("command", ["run", "validate"])
@pytest.mark.parametrize("make, expected", [c[1:] for c in NO_MODEL_NEEDED], ids=[c[0] for c in NO_MODEL_NEEDED])
def test_checked_before_any_work(tmp_path, capsys, monkeypatch, command, make, expected):
    _refused_before_loading(tmp_path, capsys, monkeypatch, make, expected, command=command)


@pytest.mark.parametrize("command", ["run", "validate"])
def test_cuda_without_a_gpu_is_exit_2(tmp_path, capsys, monkeypatch, command):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    d = recipe_dict(src, tmp_path / "out")
    d["model"]["device"] = "cuda"
    rc = main([command, str(write_recipe(tmp_path / "r.yaml", d))])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "model.device: cuda" in err and "no CUDA GPU" in err and "model.device: cpu" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    assert main(["profile", str(src), "--device", "cuda", "--seq-len", "32", "--max-tokens", "512"]) == 2
    assert "--device: cuda" in capsys.readouterr().err


def _offline(*a, **k):
    import requests

    raise requests.exceptions.ConnectionError("Failed to resolve 'huggingface.co' ([Errno -3] Temporary failure)")


def test_hub_model_id_offline_says_so(tmp_path, capsys, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", _offline)
    d = recipe_dict(Path("someone/some-model"), tmp_path / "out")
    d["model"]["source"] = "someone/some-model"
    rc = main(["run", str(write_recipe(tmp_path / "r.yaml", d))])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "model.source" in err and "offline" in err and "local copy" in err and "someone/some-model" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    # not found (online): named as such, not as offline
    def missing(*a, **k):
        raise OSError("someone/some-model is not a local folder and is not a valid model identifier")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", missing)
    assert main(["run", str(write_recipe(tmp_path / "r.yaml", d))]) == 2
    err = capsys.readouterr().err
    assert "no such repository" in err and "offline" not in err


@pytest.mark.parametrize("section", ["calibration", "evaluation"])
def test_hub_dataset_offline_says_so_before_loading(tmp_path, capsys, monkeypatch, section):
    import datasets

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("compressor.pipeline.stages.load_model", boom)
    monkeypatch.setattr(datasets, "load_dataset", _offline)
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    d = recipe_dict(src, tmp_path / "out")
    d[section]["dataset"] = "someone/some-data"
    rc = main(["run", str(write_recipe(tmp_path / "r.yaml", d))])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"{section}.dataset" in err and "offline" in err and "save_to_disk" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_profile_output_safety(tmp_path, capsys):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    args = ["profile", str(src), "--seq-len", "32", "--max-tokens", "512"]
    before = _tree(src)
    assert main(args + ["--output", str(src)]) == 2  # the model's own folder
    assert "model's folder" in capsys.readouterr().err
    assert main(args + ["--output", str(src / "profile")]) == 2
    capsys.readouterr()
    published = tmp_path / "published"
    published.mkdir()
    (published / "report.json").write_text(json.dumps({"schema": "compressor.report/v1"}))
    assert main(args + ["--output", str(published)]) == 2
    assert "published compressor output" in capsys.readouterr().err
    earlier = tmp_path / "prof"
    earlier.mkdir()
    (earlier / "profile.json").write_text("{}")
    assert main(args + ["--output", str(earlier)]) == 2
    err = capsys.readouterr().err
    assert "earlier profile" in err and "--overwrite" in err and "Traceback" not in err
    assert _tree(src) == before and (earlier / "profile.json").read_text() == "{}"
    assert sorted(p.name for p in published.iterdir()) == ["report.json"]

    from compressor.inputs.data import TextSource
    from compressor.inputs.validate import check_profile_inputs

    kw = dict(seq_len=32, max_tokens=512, heldout_fraction=0.2, seed=0, batch_size=8, blocks=None)
    check_profile_inputs(str(src), TextSource("embedded"), output=str(earlier), overwrite=True, **kw)


def test_non_empty_output_does_not_suggest_an_overwrite_that_is_refused(tmp_path, capsys):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc = main(["run", str(write_recipe(tmp_path / "r.yaml", recipe_dict(src, out)))])
    err = capsys.readouterr().err
    assert rc == 2 and "would not replace it" in err and "new or empty folder" in err
    assert "set output.overwrite: true" not in err


def test_too_short_calibration_file_does_not_advise_max_tokens(tmp_path, capsys):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    d = recipe_dict(src, tmp_path / "out")
    (tmp_path / "cal.txt").write_text("one two three four five six seven eight nine ten\n")
    d["calibration"]["dataset"] = str(tmp_path / "cal.txt")
    assert main(["run", str(write_recipe(tmp_path / "r.yaml", d))]) == 2
    err = capsys.readouterr().err
    assert "raise max_tokens" not in err and "longer text" in err


def test_summary_of_a_gguf_only_output_names_no_hugging_face_folder(capsys):

    from compressor.cli.run import _print_summary
    from minimal_report import minimal_report

    report = minimal_report(**{
        "status": "success", "message": "ok", "model": {"resolved": "m.gguf"},
        "perplexity": {"baseline": {"ppl": 10.0}, "final": {"ppl": 10.3, "tokens": 8192, "seq_len": 256, "stride": 256},
                       "budget": 10.5},
        "params": {"before": 100, "after": 90}, "blocks": [],
        "size": {"output_bytes": None, "output_dtype": "float32", "gguf_bytes": 1000, "source_bytes": 2000},
        "verification": {"gguf": {"file_type": "Q8_0", "perplexity": 10.31}},
        "evaluation": {"confidence": 0.9, "domains": [
            {"name": "embedded", "metric": "ppl", "relative_delta": 0.03, "relative_delta_upper": 0.041,
             "limit": 10.5, "baseline_ppl": 10.0, "windows": 32, "passed": True}]},
    })
    _print_summary(report, Path("out"))
    out = capsys.readouterr().out
    assert "Hugging Face folder" not in out and "unknown" not in out
    assert "gate [embedded]: +3.00%, 90% bound +4.10% vs +5.00% over 32 windows — within budget" in out
    # with policy.headroom, the limit is the budget less it, and the line says so
    report["evaluation"]["headroom"] = 0.2
    report["evaluation"]["domains"][0]["limit"] = 10.4
    _print_summary(report, Path("out"))
    out = capsys.readouterr().out
    assert "vs +4.00% (the budget less policy.headroom 20%) over 32 windows — within budget" in out
    assert "gate limit 10.5000" in out


def test_summary_of_a_rejected_run_does_not_call_the_original_within_budget(capsys):
    """Qwen2.5-Coder-1.5B, every cut refused: the summary went on with "gate [embedded]: search +0.00%
    … — within budget" and "greedy agreement 100.0 %", the original model's numbers."""
    from compressor.cli.run import _print_summary
    from minimal_report import minimal_report

    report = minimal_report(**{
        "status": "rejected", "message": "no cut passed the gate: …", "model": {"resolved": "m.gguf"},
        "perplexity": {"baseline": {"ppl": 8.2182}, "final": {"ppl": 8.2182, "tokens": 8160, "seq_len": 256,
                                                             "stride": 256}, "budget": 8.6292},
        "params": {"before": 100, "after": 100}, "blocks": [{"index": 27, "decision": "rejected"}],
        "agreement": {"next_token": 1.0, "continuations": {"identical": 1.0, "prompts": 4, "tokens": 32,
                                                           "matching_prefix": 1.0}},
        "evaluation": {"confidence": 0.9, "domains": [
            {"name": "embedded", "metric": "ppl", "relative_delta": 0.0, "relative_delta_upper": 0.0,
             "limit": 8.6292, "baseline_ppl": 8.2182, "windows": 32, "passed": True}]},
    })
    _print_summary(report, None)
    out = capsys.readouterr().out
    assert out.startswith("status: rejected — no cut passed the gate")
    assert "within budget" not in out and "greedy agreement" not in out and "no model written" in out


def test_profile_seq_len_past_the_context_is_exit_2(tmp_path, capsys):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    assert main(["profile", str(src), "--seq-len", "128", "--max-tokens", "1024"]) == 2
    err = capsys.readouterr().err
    assert "--seq-len: 128" in err and "max_position_embeddings 64" in err and "Traceback" not in err
