"""The ``compressor`` command line: exit codes and messages for bad input, and the happy paths.

Everything runs in-process through ``compressor.cli.main(argv)`` on tiny
checkpoints saved into ``tmp_path``; nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import yaml

from checkpoints import save_tiny_checkpoint, tiny_tokenizer

from compressor.cli import main
from compressor.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml")) + sorted((REPO / "recipes").glob("*.yml"))

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Cache in tmp_path; undo the global logging/progress-bar changes ``main`` makes."""
    import transformers

    monkeypatch.setenv("COMPRESSOR_CACHE_DIR", str(tmp_path / "stats-cache"))
    monkeypatch.setenv("TQDM_DISABLE", "0")  # record the original state, then remove:
    monkeypatch.delenv("TQDM_DISABLE")  # `--quiet` sets it in os.environ; monkeypatch restores it
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    verbosity = transformers.utils.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    yield
    for h in root.handlers:
        if h not in handlers:
            root.removeHandler(h)
    root.handlers[:] = handlers
    root.setLevel(level)
    transformers.utils.logging.set_verbosity(verbosity)
    if bars:
        transformers.utils.logging.enable_progress_bar()
    else:
        transformers.utils.logging.disable_progress_bar()


def recipe_dict(source: Path, out: Path) -> dict:
    return {
        "model": {"source": str(source)},
        "calibration": {"max_tokens": 2048, "seq_len": 32},
        "evaluation": {"max_tokens": 1024, "seq_len": 64, "stride": 32},
        "policy": {"threshold": -100, "ppl_budget": 0.5},
        "replacement": {"kind": "affine"},  # whole-block swaps, the greedy search (prune, the default, allocates)
        "measure": {"cache": False},
        "output": {"path": str(out)},
    }


def write_recipe(path: Path, data: dict | str) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def save_opt_checkpoint(folder: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                       max_position_embeddings=128, word_embed_proj_dim=32)
    tf.OPTForCausalLM(cfg).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


# --------------------------------------------------------------------------------------------------
# Bad input: exit code 2 and a message that names the problem
# --------------------------------------------------------------------------------------------------


def _set(section, values):
    def edit(d, src, out):
        d[section] = values
    return edit


def _merge(section, values):
    def edit(d, src, out):
        d[section].update(values)
    return edit


BAD_INPUTS = [
    # id, how to make the recipe (text, or an edit of the good dict), expected exit, substrings of stderr
    ("malformed-yaml", "model: {source: [unclosed\npolicy: threshold: 0.9\n", 2, ["not valid YAML"]),
    ("unknown-key", _set("policy", {"treshold": 0.9}), 2,
     ["policy.treshold", "unknown key", "allowed keys here:", "threshold"]),
    ("wrong-type", _set("policy", {"threshold": "high"}), 2, ["policy.threshold", "'high'"]),
    ("out-of-range", _set("policy", {"threshold": 1.5}), 2, ["policy.threshold", "1.5"]),
    ("low-rank-without-rank", _set("replacement", {"kind": "low_rank"}), 2,
     ["replacement", "low_rank", "rank"]),
    ("missing-data-file", _merge("calibration", {"dataset": "/nonexistent/x.txt"}), 2,
     ["calibration.dataset", "/nonexistent/x.txt", "does not exist"]),
    ("missing-model", _merge("model", {"source": "/nonexistent/model-folder"}), 2,
     ["model.source", "/nonexistent/model-folder"]),
    ("unsupported-model-type", "OPT", 2, ["'opt'", "not supported", "Supported types", "llama", "gpt2", "qwen2"]),
    ("output-is-input", lambda d, src, out: d["output"].update(path=str(src)), 2,
     ["output.path", "input model folder"]),
    ("output-inside-input", lambda d, src, out: d["output"].update(path=str(src / "sub")), 2,
     ["output.path", "input model folder"]),
    ("output-not-empty", "NONEMPTY", 2, ["output.path", "not empty", "overwrite"]),
    ("recipe-file-missing", None, 2, ["does not exist"]),
]


@pytest.mark.parametrize("make, code, expected", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(tmp_path, capsys, make, code, expected):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    out = tmp_path / "out"
    data = recipe_dict(src, out)
    path = tmp_path / "recipe.yaml"
    if make is None:
        path = tmp_path / "no-such-recipe.yaml"
    elif make == "OPT":
        data["model"]["source"] = str(save_opt_checkpoint(tmp_path / "opt"))
        write_recipe(path, data)
    elif make == "NONEMPTY":
        out.mkdir()
        (out / "keep.txt").write_text("keep me")
        write_recipe(path, data)
    elif isinstance(make, str):
        write_recipe(path, make)
    else:
        make(data, src, out)
        write_recipe(path, data)
    input_before = {p.name: p.read_bytes() for p in src.iterdir()}

    rc = main(["run", str(path)])
    captured = capsys.readouterr()
    assert rc == code, captured.err
    for s in expected:
        assert s in captured.err, f"{s!r} not in stderr:\n{captured.err}"
    assert "Traceback" not in captured.err
    # invalid input: nothing written
    if make == "NONEMPTY":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    assert {p.name: p.read_bytes() for p in src.iterdir()} == input_before


def test_unknown_key_lists_allowed_keys(tmp_path, capsys):
    path = write_recipe(tmp_path / "r.yaml", {"policy": {"treshold": 0.9}})
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "policy.treshold" in x)
    allowed = line.split("allowed keys here:", 1)[1]
    assert "threshold" in [k.strip() for k in allowed.split(",")]


# --------------------------------------------------------------------------------------------------
# validate / dry-run / overrides
# --------------------------------------------------------------------------------------------------


def test_validate_good_recipe(tmp_path, capsys):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(src, tmp_path / "out"))
    assert main(["validate", str(path)]) == 0
    assert "recipe OK" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


@pytest.fixture
def no_run(no_loading, monkeypatch):
    """No model load and no pipeline run: the command must finish on the recipe alone."""
    monkeypatch.setattr("compressor.pipeline.runner.run", no_loading)
    monkeypatch.setattr("compressor.pipeline.runner.oneshot", no_loading)


def test_dry_run_prints_resolved_recipe(tmp_path, capsys, no_run):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(src, tmp_path / "out"))
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "heldout_fraction: 0.125" in out  # a default, not in the recipe file
    resolved = yaml.safe_load(out)
    assert resolved["policy"]["threshold"] == -100
    assert resolved["replacement"]["kind"] == "affine"  # default section filled in
    assert resolved["calibration"]["seq_len"] == 32
    assert not (tmp_path / "out").exists()


def test_set_override_in_dry_run(tmp_path, capsys, no_run):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(src, tmp_path / "out"))
    rc = main(["run", str(path), "--dry-run", "--set", "policy.threshold=0.95", "--set", "replacement.kind=low_rank",
               "--set", "replacement.rank=4"])
    assert rc == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["policy"]["threshold"] == 0.95
    assert resolved["replacement"] == {"kind": "low_rank", "rank": 4, "rank_fraction": None, "max_params_fraction": None}
    assert yaml.safe_load(path.read_text())["policy"]["threshold"] == -100  # the file itself is untouched


def test_set_override_is_validated(tmp_path, capsys, no_run):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(src, tmp_path / "out"))
    assert main(["run", str(path), "--dry-run", "--set", "policy.threshold=2"]) == 2
    assert "policy.threshold" in capsys.readouterr().err


def test_set_names_an_item_of_a_list_of_sections_by_its_index():
    from compressor.core.errors import RecipeError
    from compressor.recipe.loader import apply_overrides

    data = {"evaluation": [{"dataset": "embedded"}, {"dataset": "self"}]}
    out = apply_overrides(data, ["evaluation.1.seed=7", "evaluation.0.max_tokens=4096"])
    assert out["evaluation"] == [{"dataset": "embedded", "max_tokens": 4096}, {"dataset": "self", "seed": 7}]
    assert data["evaluation"][1] == {"dataset": "self"}  # the input is untouched
    for item, words in (("evaluation.2.seed=1", "index 2 is past the end of a list of 2 sections (0..1)"),
                        ("evaluation.max_tokens=1", "a list of 2 sections; name one by its index (0..1)"),
                        ("evaluation.1=3", None)):
        if words is None:  # a whole item replaced is the schema's to judge
            assert apply_overrides(data, [item])["evaluation"][1] == 3
            continue
        with pytest.raises(RecipeError, match=re.escape(words)):
            apply_overrides(data, [item])
    with pytest.raises(RecipeError, match=r"names item 2 of a list that this recipe does not write out"):
        apply_overrides({}, ["evaluation.2.seed=1"])


# --------------------------------------------------------------------------------------------------
# Real runs
# --------------------------------------------------------------------------------------------------


def test_run_success(tmp_path, capsys):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    out = tmp_path / "out"
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(src, out))
    assert main(["run", str(path)]) == 0
    stdout = capsys.readouterr().out.splitlines()
    model_line = next(x for x in stdout if x.startswith("model:"))
    report_line = next(x for x in stdout if x.startswith("report:"))
    assert Path(model_line.split(":", 1)[1].strip()) == out.resolve()
    report = Path(report_line.split(":", 1)[1].strip())
    assert report.is_file() and json.loads(report.read_text())["status"] == "success"
    from minimal_report import checked_report

    assert checked_report(json.loads(report.read_text())).planned() is None  # a structural run's report
    assert (out / "model.safetensors").is_file()
    assert any(x.startswith("status: success") for x in stdout)


def test_run_quiet_prints_only_warnings(tmp_path, capsys):
    import datasets

    datasets_bars = datasets.utils.logging.is_progress_bar_enabled()
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(src, tmp_path / "ignored"))
    out = tmp_path / "out"
    capsys.readouterr()
    try:
        rc = main(["run", str(path), "--quiet", "--output", str(out)])
    finally:
        if datasets_bars:
            datasets.enable_progress_bars()
    captured = capsys.readouterr()
    assert rc == 0
    assert (out / "model.safetensors").is_file()  # --output overrides output.path
    assert not (tmp_path / "ignored").exists()
    noise = [x for x in captured.err.splitlines() if x.strip() and not x.startswith("WARNING")]
    assert noise == [], captured.err
    assert "model:" in captured.out


def test_profile_subcommand_writes_files(tmp_path, capsys):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    dest = tmp_path / "profile"
    rc = main(["profile", str(src), "--seq-len", "32", "--max-tokens", "1024", "--output", str(dest)])
    assert rc == 0, capsys.readouterr().err
    prof = json.loads((dest / "profile.json").read_text())
    assert prof["schema"] == "compressor.profile/v1"
    assert prof["model_type"] == "llama"
    assert [b["index"] for b in prof["blocks"]] == [0, 1, 2]
    assert all(isinstance(b["r2_lin"], float) and b["r2_lin"] <= 1 for b in prof["blocks"])
    assert (dest / "profile.md").read_text().strip()
    assert (dest / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "profile.json" in capsys.readouterr().out


def test_gate_failure_exit_3_writes_report(tmp_path, capsys):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    out = tmp_path / "out"
    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(src, out))
    report = tmp_path / "report.json"
    rc = main(["run", str(path), "--set", "policy.threshold=1.0", "--report", str(report)])
    captured = capsys.readouterr()
    assert rc == 3, captured.err
    assert not out.exists()
    data = json.loads(report.read_text())
    assert data["status"] == "rejected"
    assert data["exit_code"] == 3
    assert data["output"] is None
    assert "status: rejected" in captured.out
    assert "model:" not in captured.out


# --------------------------------------------------------------------------------------------------
# The shipped recipes
# --------------------------------------------------------------------------------------------------


def test_recipes_folder_has_recipes():
    assert RECIPES, "recipes/ has no YAML files"


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipe_is_valid(path):
    try:
        recipe = load_recipe(path)
    except RecipeError as e:  # pragma: no cover - the failure message is the point
        pytest.fail(f"{path.name} is not a valid recipe:\n{e}")
    assert recipe.version == 1
    assert recipe.to_dict()  # round-trips through the schema


def test_compress_gates_on_the_default_prose_code_and_self_domains_unless_eval_data_is_given():
    from compressor.cli import build_parser
    from compressor.cli.run import _recipe_from_args

    parser = build_parser()
    r = _recipe_from_args(parser.parse_args(["compress", "some/model", "-o", "out/x"]))
    assert [e.domain_name() for e in r.evaluation_domains()] == ["embedded", "embedded-code", "self"]
    r = _recipe_from_args(parser.parse_args(["compress", "some/model", "-o", "out/x", "--eval-data", "embedded"]))
    assert [e.domain_name() for e in r.evaluation_domains()] == ["embedded"]
