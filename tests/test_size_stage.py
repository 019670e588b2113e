"""The size stage as a new user meets it: nothing lost on interruption or bad input, nothing silent.

Each test is one finding of a new-user probe (tiny models from configs; nothing is downloaded): the
caller's model after Ctrl-C, a size with no output folder, ``validate`` agreeing with ``run``, run state
and work folders removed on every exit, (a size above the F16 is said: tests/test_gguf.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import TINY_RECIPE, save_tiny_checkpoint, tiny_causal_lm, tiny_tokenizer

import compressor

pytestmark = pytest.mark.usefixtures("torch_single_thread")

#: The tiny recipe with no structural fields (a size plans tensor types only).
SIZE_RECIPE = {**{k: v for k, v in TINY_RECIPE.items() if k not in ("replacement", "policy")},
               "policy": {"ppl_budget": 0.5}}


@pytest.fixture(autouse=True)
def cache_dir(isolated_cache):
    return isolated_cache


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_ctrl_c_during_oneshot_leaves_the_callers_model_as_it_was(tmp_path, monkeypatch):
    """Interrupted after the blocks were replaced (the report stage): the model handed in is the original
    again — its class, every module, its logits — and its ``save_pretrained`` folder reloads in plain
    transformers with every weight it had."""
    from transformers import AutoModelForCausalLM

    from compressor.pipeline import stages

    m, tok = tiny_causal_lm("llama"), tiny_tokenizer()
    ids = torch.randint(0, m.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    before, cls = _logits(m, ids), type(m)
    mlps = [layer.mlp for layer in m.model.layers]
    replaced = []

    def interrupted(recipe, loaded, *args, **kwargs):
        replaced.extend(type(layer.mlp).__name__ for layer in loaded.model.model.layers)
        raise KeyboardInterrupt

    monkeypatch.setattr(stages, "report", interrupted)
    with pytest.raises(KeyboardInterrupt):
        compressor.oneshot(m, dict(TINY_RECIPE, policy={"threshold": -100, "ppl_budget": 5.0}), tokenizer=tok)
    assert any(name != "LlamaMLP" for name in replaced)  # the run had replaced blocks when it was stopped
    assert type(m) is cls and [layer.mlp for layer in m.model.layers] == mlps
    assert torch.equal(_logits(m, ids), before)
    m.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.allclose(_logits(again, ids), before, atol=1e-6)


def test_a_size_with_no_output_folder_is_refused_before_anything_runs(monkeypatch):
    """A size plans the file users ship: ``oneshot`` with a model object and no ``output_dir`` would plan
    nothing; refused (the model in memory unchanged, still its own class), not a silent success."""
    m, tok = tiny_causal_lm("llama"), tiny_tokenizer()
    cls = type(m)
    recipe = {**SIZE_RECIPE, "output": {"size": "Q4_0"}}
    with pytest.raises(compressor.InputError, match="output_dir"):
        compressor.oneshot(m, recipe, tokenizer=tok)
    assert type(m) is cls and m.config.model_type == "llama"


def _validate(recipe: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compressor", "validate", str(recipe), *extra],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(Path.cwd())})


@pytest.mark.parametrize("model_type,output,model,match", [
    ("llama", {"size": "Q4_0", "formats": ["hf"]}, {}, "add gguf to output.formats"),
    ("gpt2", {"size": "Q4_0"}, {}, "remove output.size"),
])
def test_validate_refuses_what_run_refuses_with_a_size(tmp_path, model_type, output, model, match):
    """``compressor validate`` runs every check that needs no model, so it agrees with ``run``: a size with
    no GGUF among the formats, or for an architecture whose GGUF cannot be planned (whose message then does not
    send the user to a recipe that is refused in turn). GGUF and compressed-tensors sizes both stream with an
    onloaded model (tests/test_size_stream.py, tests/test_ctensors_stream.py)."""
    import yaml

    src = save_tiny_checkpoint(tmp_path / "tiny", model_type)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**SIZE_RECIPE,
                                      "model": {"source": str(src), **model},
                                      "output": {"path": str(tmp_path / "out"), **output}}))
    res = _validate(recipe)
    assert res.returncode == 2, res.stdout + res.stderr
    assert match in res.stderr
    assert not (tmp_path / "out").exists()


def test_the_run_state_is_removed_when_the_gate_refuses(tmp_path):
    """docs/resume.md: the state goes when the gate refuses (exit 3) as when the model is published."""
    from compressor.engine.runstate import state_dir

    m, tok = tiny_causal_lm("llama"), tiny_tokenizer()
    out = tmp_path / "out"
    with pytest.raises(compressor.GateFailed):
        compressor.oneshot(m, dict(TINY_RECIPE, policy={"threshold": 1.0}), tokenizer=tok, output_dir=out)
    assert not state_dir(out).exists() and not out.exists()


def test_a_killed_runs_size_work_folder_is_reclaimed(tmp_path):
    """The F16 and preset of a size run live in ``.<name>.size-<pid>`` beside the output; one left by a
    process that no longer exists is removed by the next run, one of a live process is not."""
    from compressor.pipeline.size.workdir import make_work_folder, work_folder

    out = tmp_path / "out"
    recipe = compressor.recipe_from_dict({"output": {"path": str(out)}})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.size-{dead.pid}"
    (stale / "f16.gguf").parent.mkdir()
    (stale / "f16.gguf").write_bytes(b"x" * 10)
    live = tmp_path / f".out.size-{os.getppid()}"
    live.mkdir()
    mine = work_folder(recipe, out)
    make_work_folder(recipe, out, mine)
    assert not stale.exists() and live.is_dir() and mine.is_dir() and mine.name == f".out.size-{os.getpid()}"
