"""End-to-end tests of ``compressor.run``: run → save → reload, on tiny saved checkpoints.

Every checkpoint is a tiny random (or briefly trained) model written into
``tmp_path`` by ``tests/checkpoints.py``; nothing is downloaded. The statistics
cache is pointed at ``tmp_path`` by an autouse fixture.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from checkpoints import BLOCK_COMPRESSOR, COMPRESSIBLE, save_tiny_checkpoint, tiny_causal_lm, tiny_tokenizer

import compressor
from compressor.core.modeling import COMPRESSION_FORMAT, AffineFFN, LowRankAffineFFN
from compressor.fitting.replace import count_params

pytestmark = pytest.mark.usefixtures("torch_single_thread")

ARCH_PARAMS = list(COMPRESSIBLE)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Statistics cache inside tmp_path: nothing is written to ~/.cache."""
    d = tmp_path / "stats-cache"
    monkeypatch.setenv("COMPRESSOR_CACHE_DIR", str(d))
    return d


def make_recipe(source: Path, out: Path, **sections) -> compressor.Recipe:
    """A small, fast recipe (cache off unless a section says otherwise)."""
    data = {
        "model": {"source": str(source)},
        "calibration": {"max_tokens": 2048, "seq_len": 32},
        "evaluation": {"max_tokens": 1024, "seq_len": 64, "stride": 32},
        "policy": {"threshold": -100, "ppl_budget": 0.5},
        "replacement": {"kind": "affine"},  # whole-block swaps, the greedy search (prune, the default, allocates)
        "output": {"path": str(out)},
        "measure": {"cache": False},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return compressor.recipe_from_dict(data)


def tree_hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*")) if p.is_file()
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def probe_ids(batch: int = 2, length: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, 128, (batch, length), generator=g)


@torch.no_grad()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=ids).logits.float()


def safetensors_keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def tried_order(records, n_blocks: int) -> list[int]:
    """Block indices in the order the gate logged a decision for them."""
    import re

    order = []
    for rec in records:
        m = re.match(r"block (\d+) (kept|rejected):", rec.getMessage())
        if rec.name == "compressor.policy.greedy" and m:
            order.append(int(m.group(1)))
    assert all(0 <= i < n_blocks for i in order)
    return order


@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory) -> Path:
    """A tiny llama trained for a few steps on the calibration text, so its FFNs matter:

    replacing them raises perplexity (a random model is near-uniform, and its
    perplexity moves either way when an FFN is replaced)."""
    from compressor.inputs.data import _embedded_documents, tokenize_stream

    folder = tmp_path_factory.mktemp("trained-llama")
    tok = tiny_tokenizer()
    model = tiny_causal_lm("llama").train()
    ids = tokenize_stream(tok, _embedded_documents("calibration"), 8192)
    n = ids.numel() // 32
    windows = ids[: n * 32].view(n, 32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        batch = windows[torch.randint(0, n, (16,), generator=g)]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# --------------------------------------------------------------------------------------------------
# The architecture matrix: run → save → reload
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ARCH_PARAMS)
def test_run_save_reload(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    src = save_tiny_checkpoint(tmp_path / "in", model_type)
    out = tmp_path / "out"
    res = compressor.run(make_recipe(src, out))
    assert res.exit_code == compressor.EXIT_OK, res.report["message"]
    assert res.output == out.resolve()
    ids = probe_ids()
    expected = logits_of(res.result.model, ids)

    # Reload both ways: the helper and a plain Auto class (compressor is imported → registered).
    via_helper = compressor.load_compressed(out)
    via_auto = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(via_auto).__name__.startswith("Compressed")
    for reloaded in (via_helper, via_auto):
        torch.testing.assert_close(logits_of(reloaded, ids), expected, atol=1e-5, rtol=0)

    cfg = json.loads((out / "config.json").read_text())
    comp = cfg["compression"]
    assert comp["format"] == COMPRESSION_FORMAT
    assert cfg["model_type"] == f"compressed_{model_type}"
    assert comp["blocks"], "no block was replaced"
    kept = [d["index"] for d in res.report["blocks"] if d["decision"] == "kept"]
    assert sorted(b["index"] for b in comp["blocks"]) == sorted(kept)

    in_keys, out_keys = safetensors_keys(src), safetensors_keys(out)
    for block in comp["blocks"]:
        module, kind = block["module"], block["kind"]
        assert kind == "affine"
        assert isinstance(via_auto.get_submodule(module), AffineFFN)
        original = {k for k in in_keys if k.startswith(module + ".")}
        assert original, f"input checkpoint has no weights under {module}"
        now = {k for k in out_keys if k.startswith(module + ".")}
        assert now == {f"{module}.proj.weight", f"{module}.proj.bias"}
        assert not (original & out_keys), f"original FFN weights of {module} are still saved"

    original_model = AutoModelForCausalLM.from_pretrained(str(src))
    assert count_params(via_auto) < count_params(original_model)
    assert count_params(via_auto) == res.report["params"]["after"] == comp["params_after"]

    for name in ("report.json", "recipe.yaml", "README.md", "modeling_compressor.py"):
        assert (out / name).is_file(), name
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["reload_check"]["passed"] is True
    assert on_disk["status"] == "success"
    assert res.report["reload_check"]["passed"] is True
    # nothing left behind beside the output folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]


@pytest.mark.parametrize("model_type", ARCH_PARAMS)
def test_low_rank_reload(tmp_path, model_type):
    src = save_tiny_checkpoint(tmp_path / "in", model_type)
    out = tmp_path / "out"
    res = compressor.run(make_recipe(src, out, replacement={"kind": "low_rank", "rank": 4}))
    assert res.exit_code == compressor.EXIT_OK, res.report["message"]
    reloaded = compressor.load_compressed(out)
    d = reloaded.config.hidden_size
    blocks = json.loads((out / "config.json").read_text())["compression"]["blocks"]
    assert blocks
    for b in blocks:
        assert b["kind"] == "low_rank" and b["config"]["rank"] == 4
        mod = reloaded.get_submodule(b["module"])
        assert isinstance(mod, LowRankAffineFFN)
        assert tuple(mod.down.weight.shape) == (4, d)
        assert tuple(mod.up.weight.shape) == (d, 4)
        assert tuple(mod.up.bias.shape) == (d,)
    ids = probe_ids()
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(res.result.model, ids), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------------
# Loading where compressor is not installed (remote code)
# --------------------------------------------------------------------------------------------------

_NO_COMPRESSOR_SCRIPT = BLOCK_COMPRESSOR + textwrap.dedent(
    """
    try:
        import compressor  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the import blocker does not work")

    import torch
    from transformers import AutoModelForCausalLM

    folder, ids, result_file = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    result = {}
    try:
        AutoModelForCausalLM.from_pretrained(folder)
    except Exception as e:  # expected: custom code needs the explicit opt-in
        result["without_trust"] = f"{type(e).__name__}: {e}"
    else:
        result["without_trust"] = None
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        result["logits"] = model(input_ids=torch.tensor(ids)).logits.tolist()
    result["class"] = type(model).__module__ + "." + type(model).__name__
    # The tokenizer needs no custom code: no prompt (stdin is closed), no remote code.
    from transformers import AutoTokenizer

    result["tokens"] = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)("hello world")["input_ids"]
    result["compressor_imported"] = sorted(m for m in sys.modules if m == "compressor" or m.startswith("compressor."))
    with open(result_file, "w") as f:
        json.dump(result, f)
    """
)


def test_loads_without_compressor_installed(tmp_path):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    out = tmp_path / "out"
    res = compressor.run(make_recipe(src, out))
    assert res.exit_code == 0
    ids = probe_ids()
    expected = logits_of(res.result.model, ids)

    script = tmp_path / "load_without_compressor.py"
    script.write_text(_NO_COMPRESSOR_SCRIPT)
    env = dict(os.environ)
    env.update(
        HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HOME=str(tmp_path / "hf_home"),
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1",
    )
    env.pop("PYTHONPATH", None)
    result_file = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(script), str(out), json.dumps(ids.tolist()), str(result_file)],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(result_file.read_text())
    assert result["compressor_imported"] == []
    assert result["class"].endswith("modeling_compressor.CompressedLlamaForCausalLM"), result["class"]
    assert result["without_trust"] is not None, "loaded custom code without trust_remote_code"
    assert "trust_remote_code" in result["without_trust"]
    from transformers import AutoTokenizer

    # trust_remote_code=False never prompts (the model load above, without the flag, does)
    assert result["tokens"] == AutoTokenizer.from_pretrained(str(src))("hello world")["input_ids"]
    torch.testing.assert_close(torch.tensor(result["logits"]), expected, atol=1e-5, rtol=0)
    assert (tmp_path / "hf_modules").is_dir()  # transformers' dynamic-module cache stayed in tmp_path


# --------------------------------------------------------------------------------------------------
# The perplexity gate
# --------------------------------------------------------------------------------------------------


def test_rollback_restores_original_blocks(tmp_path, trained_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compressor.inputs.data import TextSource, evaluation_tokens
    from compressor.evaluation.perplexity import perplexity

    out = tmp_path / "out"
    recipe = make_recipe(trained_llama, out, policy={"ppl_budget": 0.0, "budget_mode": "absolute", "min_blocks": 0,
                                                      "order": "r2"})
    res = compressor.run(recipe)
    assert res.exit_code == compressor.EXIT_OK, res.report["message"]
    ppl = res.report["perplexity"]
    baseline, final = ppl["baseline"]["ppl"], ppl["final"]["ppl"]
    assert ppl["budget"] == pytest.approx(baseline)

    decisions = res.report["blocks"]
    assert all(d["ppl_when_tried"] is not None for d in decisions)  # threshold -100: all tried
    rejected = [d for d in decisions if d["ppl_when_tried"] > baseline]
    assert rejected, "the trained model should have at least one block whose swap raises perplexity"
    for d in decisions:
        if d["ppl_when_tried"] > baseline:
            assert d["decision"] == "rejected", d
            assert "rolled back" in d["reason"]
        else:
            assert d["decision"] == "kept", d
    assert final <= baseline

    original_cls = type(AutoModelForCausalLM.from_pretrained(str(trained_llama)).model.layers[0].mlp)
    model = res.result.model
    for d in decisions:
        mlp = model.model.layers[d["index"]].mlp
        if d["decision"] == "rejected":
            assert type(mlp) is original_cls
        else:
            assert isinstance(mlp, AffineFFN)

    # The returned model really is at the reported perplexity (the rollbacks took effect).
    tok = AutoTokenizer.from_pretrained(str(trained_llama))
    e = recipe.evaluation
    tokens = evaluation_tokens(tok, TextSource(e.dataset, split=e.split), TextSource(), max_tokens=e.max_tokens)
    again = perplexity(model, tokens, seq_len=e.seq_len, stride=e.stride)
    assert again.ppl == pytest.approx(final, rel=1e-6)


def test_gate_failure_writes_nothing(tmp_path, trained_llama):
    out = tmp_path / "out"
    recipe = make_recipe(trained_llama, out, policy={"gate": False, "ppl_budget": 0.0, "budget_mode": "absolute"})
    res = compressor.run(recipe)
    assert res.exit_code == compressor.EXIT_GATE == 3
    assert res.output is None
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary folder left either
    assert res.report["status"] == "rejected"
    assert res.report["exit_code"] == 3
    assert "over budget" in res.report["message"]
    assert all(d["decision"] == "kept" for d in res.report["blocks"])  # bare threshold rule took them all
    assert res.report["perplexity"]["final"]["ppl"] > res.report["perplexity"]["baseline"]["ppl"]


def test_min_blocks_not_reached_fails_gate(tmp_path):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    out = tmp_path / "out"
    res = compressor.run(make_recipe(src, out, policy={"threshold": 1.0}))
    assert res.exit_code == compressor.EXIT_GATE
    assert not out.exists()
    assert res.report["status"] == "rejected"
    assert "min_blocks" in res.report["message"]
    assert all(d["decision"] == "not a candidate" for d in res.report["blocks"])


# --------------------------------------------------------------------------------------------------
# Output folder safety
# --------------------------------------------------------------------------------------------------


def test_refuses_non_empty_output_unless_overwrite(tmp_path):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("precious")
    with pytest.raises(compressor.RecipeError) as err:
        compressor.run(make_recipe(src, out))
    assert "not empty" in str(err.value) and "overwrite" in str(err.value)
    assert (out / "old.txt").read_text() == "precious"
    assert [p.name for p in out.iterdir()] == ["old.txt"]

    # --overwrite replaces an earlier compressor output, never a folder of other files
    with pytest.raises(compressor.RecipeError, match="not an earlier compressor output"):
        compressor.run(make_recipe(src, out, output={"overwrite": True}))
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    (out / "old.txt").unlink()
    assert compressor.run(make_recipe(src, out)).exit_code == 0
    (out / "notes.txt").write_text("added by the user")
    res = compressor.run(make_recipe(src, out, output={"overwrite": True}))
    assert res.exit_code == 0
    assert (out / "notes.txt").read_text() == "added by the user"  # not compressor's: kept (issue 57)
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]  # old folder removed, no temp left


@pytest.mark.parametrize("overwrite", [False, True])
def test_refuses_output_equal_to_input(tmp_path, overwrite):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    before = tree_hashes(src)
    with pytest.raises(compressor.RecipeError) as err:
        compressor.run(make_recipe(src, src, output={"overwrite": overwrite}))
    assert "input" in str(err.value)
    assert tree_hashes(src) == before
    assert [p.name for p in tmp_path.iterdir()] == ["in"]


def test_input_checkpoint_never_modified(tmp_path):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    before = tree_hashes(src)
    res = compressor.run(make_recipe(src, tmp_path / "out"))
    assert res.exit_code == 0
    assert tree_hashes(src) == before


def test_saved_files_follow_umask(tmp_path):
    """save_pretrained writes weights as 0600; the published folder must not."""
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    old = os.umask(0o022)
    try:
        res = compressor.run(make_recipe(src, tmp_path / "out"))
    finally:
        os.umask(old)
    assert res.exit_code == 0
    modes = {p.name: p.stat().st_mode & 0o777 for p in res.output.iterdir() if p.is_file()}
    assert modes and all(m == 0o644 for m in modes.values()), modes


def test_reproducible_weights(tmp_path):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    a = compressor.run(make_recipe(src, tmp_path / "a"))
    b = compressor.run(make_recipe(src, tmp_path / "b"))
    assert a.exit_code == b.exit_code == 0
    assert sha256(a.output / "model.safetensors") == sha256(b.output / "model.safetensors")
    assert a.report["recipe_sha256"] == b.report["recipe_sha256"]


# --------------------------------------------------------------------------------------------------
# Statistics cache
# --------------------------------------------------------------------------------------------------


def test_profile_statistics_cache_reused(tmp_path, cache_dir):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    kw = dict(max_tokens=1024, seq_len=32, use_cache=True)
    first = compressor.profile(str(src), **kw)
    files = [p for p in cache_dir.iterdir() if p.is_file()]
    assert len(files) == 1 and files[0].suffix == ".safetensors"
    second = compressor.profile(str(src), **kw)
    assert [b.r2_lin for b in second.blocks] == [b.r2_lin for b in first.blocks]
    assert len([p for p in cache_dir.iterdir() if p.is_file()]) == 1


def test_run_does_not_use_the_statistics_cache(tmp_path, cache_dir):
    """run measures layer by layer as it compresses; nothing is written to the cache."""
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    res = compressor.run(make_recipe(src, tmp_path / "o1", measure={"cache": True}))
    assert res.exit_code == 0
    assert res.report["cache"]["enabled"] is False
    assert not cache_dir.exists() or not [p for p in cache_dir.iterdir() if p.is_file()]  # selfcal/ aside


# --------------------------------------------------------------------------------------------------
# Policy options
# --------------------------------------------------------------------------------------------------


def test_removed_refit_option_is_refused_with_its_replacement(tmp_path):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    with pytest.raises(compressor.RecipeError, match="replacement.target"):
        make_recipe(src, tmp_path / "out", policy={"refit": True})


def test_swap_sweep_and_swap_ppl_order(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="compressor.policy.greedy")
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    res = compressor.run(make_recipe(src, tmp_path / "out", measure={"swap_sweep": True}, policy={"order": "swap_ppl"}))
    assert res.exit_code == 0
    decisions = res.report["blocks"]
    assert all(isinstance(d["swap_ppl"], float) for d in decisions)
    assert len({d["swap_ppl"] for d in decisions}) == len(decisions)  # really measured, one per block
    expected = [d["index"] for d in sorted(decisions, key=lambda d: (d["swap_ppl"], d["index"]))]
    assert tried_order(caplog.records, len(decisions)) == expected


# --------------------------------------------------------------------------------------------------
# Profile-only architectures
# --------------------------------------------------------------------------------------------------


def test_bert_is_profile_only(tmp_path):
    import transformers as tf

    folder = tmp_path / "bert"
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=128)
    tf.BertModel(cfg).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)

    with pytest.raises(compressor.InputError, match="profile-only"):
        compressor.run(make_recipe(folder, tmp_path / "out"))
    assert not (tmp_path / "out").exists()

    prof = compressor.profile(str(folder), "embedded", max_tokens=1024, seq_len=32)
    assert prof.model_type == "bert"
    assert [b.index for b in prof.blocks] == [0, 1]
    assert all(type(b).__name__ == "BlockProfile" for b in prof.blocks)
    assert all(b.r2_lin == b.r2_lin and b.r2_lin <= 1 for b in prof.blocks)  # finite-or-not-NaN, ≤ 1


def test_single_swap_over_budget_is_rejected_without_a_gate_evaluation(tmp_path, trained_llama):
    recipe = make_recipe(trained_llama, tmp_path / "out",
                         policy={"ppl_budget": 0.0, "budget_mode": "absolute", "min_blocks": 0, "order": "swap_ppl"})
    res = compressor.run(recipe)
    base = res.report["perplexity"]["baseline"]["ppl"]
    over = [d for d in res.report["blocks"] if d["swap_ppl"] > base]
    assert over, "the trained model should have a block whose single swap raises perplexity"
    for d in over:
        assert d["decision"] == "rejected" and d["ppl_when_tried"] is None, d
        assert "alone exceeds the budget" in d["reason"]


def test_patience_stops_after_consecutive_rejections(tmp_path, trained_llama):
    recipe = make_recipe(trained_llama, tmp_path / "out",
                         policy={"ppl_budget": 0.0, "budget_mode": "absolute", "min_blocks": 0, "order": "r2",
                                 "patience": 1})
    res = compressor.run(recipe)
    decisions = res.report["blocks"]
    rejected = [d for d in decisions if d["decision"] == "rejected"]
    stopped = [d for d in decisions if "policy.patience=1" in d["reason"]]
    assert len(rejected) == 1 and stopped, decisions
    assert all(d["decision"] == "not tried" and d["ppl_when_tried"] is None for d in stopped)
