"""An output that deploys: saved dtype, sizes, a tokenizer that loads with no
prompt, the profile plot, ``profile.json`` parameter counts, exit codes in
``--help``, and an import that does not pull in torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import save_tiny_checkpoint
from test_cli import isolated, recipe_dict  # noqa: F401  (isolated is an autouse fixture)

import compressor
from compressor.cli import main

pytestmark = pytest.mark.usefixtures("torch_single_thread")
REPO = Path(__file__).resolve().parents[1]


def safetensors_dtypes(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


# --------------------------------------------------------------------------------------------------
# output.dtype
# --------------------------------------------------------------------------------------------------


def test_output_dtype_bfloat16_halves_the_weights(tmp_path):
    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    d = recipe_dict(src, tmp_path / "out")
    d["output"]["dtype"] = "bfloat16"
    res = compressor.run(compressor.recipe_from_dict(d))
    assert res.exit_code == 0
    assert safetensors_dtypes(res.output / "model.safetensors") == {"BF16"}
    cfg = json.loads((res.output / "config.json").read_text())
    assert (cfg.get("dtype") or cfg.get("torch_dtype")) == "bfloat16"
    check = res.report["reload_check"]
    assert check["passed"] and check["saved_dtype"] == "bfloat16" and check["max_abs_logit_diff"] <= 1e-5
    assert res.report["size"]["output_dtype"] == "bfloat16"
    assert res.report["size"]["output_bytes"] < res.report["size"]["source_bytes"] * 0.5
    assert res.report["size"]["like_with_like"] is None  # bfloat16 against a float32 source: not like with like
    assert next(res.result.model.parameters()).dtype == torch.float32  # computed in model.dtype, cast only on save
    reloaded = compressor.load_compressed(res.output)
    assert next(reloaded.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("architecture", ["custom", "standard"])
def test_the_reload_check_frees_the_rounded_copy_before_it_reloads(tmp_path, monkeypatch, architecture):
    """The in-memory model rounded to the saved dtype is a full copy: it is gone before the folder is
    reloaded, so the check holds two models at once, not three (6.6 GiB less on a 1.5B model)."""
    import gc
    import weakref

    from transformers import AutoModelForCausalLM

    import compressor.output.hf.folder as hf

    copies, alive_at_reload = [], []
    rounded_copy, from_pretrained = hf.rounded_copy, AutoModelForCausalLM.from_pretrained

    def recording_copy(*args, **kwargs):
        ref = rounded_copy(*args, **kwargs)
        copies.append(weakref.ref(ref))
        return ref

    def reload(*args, **kwargs):
        gc.collect()
        alive_at_reload.append((len(copies), sum(c() is not None for c in copies)))
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(hf, "rounded_copy", recording_copy)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", reload)
    from test_standard import _wide_checkpoint  # an FFN wide enough for the standard width grid

    make = _wide_checkpoint if architecture == "standard" else save_tiny_checkpoint
    d = recipe_dict(make(tmp_path / "in", "llama"), tmp_path / "out")
    d["output"].update({"dtype": "bfloat16", "architecture": architecture})
    d["replacement"] = {"kind": "prune"}  # the one kind a standard folder can hold
    d["policy"].pop("threshold")  # not read by prune's allocate strategy (an error to set)
    res = compressor.run(compressor.recipe_from_dict(d))
    assert res.exit_code == 0 and res.report["reload_check"]["passed"]
    made, alive = alive_at_reload[-1]  # at the reload check's reload
    assert made == 1 and alive == 0  # the rounded copy was made before it, and freed


def test_output_dtype_source_follows_the_source_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float16).save_pretrained(src)  # an fp16 source
    res = compressor.run(compressor.recipe_from_dict(recipe_dict(src, tmp_path / "out")))
    assert res.exit_code == 0
    assert res.report["size"]["output_dtype"] == "float16"
    assert safetensors_dtypes(res.output / "model.safetensors") == {"F16"}
    assert res.report["reload_check"]["passed"]


def test_gguf_source_defaults_to_bfloat16():
    from compressor.inputs.load import ResolvedSource
    from compressor.output.hf import output_dtype

    assert output_dtype("source", ResolvedSource("/x", "m.gguf", True)) == torch.bfloat16
    assert output_dtype("float32", ResolvedSource("/x", "m.gguf", True)) == torch.float32
    assert output_dtype("source", ResolvedSource("/nonexistent", None, True)) == torch.float32


def test_cast_state_dict_keeps_tied_weights_shared(tiny_model):
    from compressor.output.hf import cast_state_dict

    model = tiny_model("gpt2")  # lm_head is tied to the token embedding
    sd = cast_state_dict(model, torch.bfloat16)
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    assert sd["lm_head.weight"].dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------------
# The tokenizer (loading where compressor is not installed: tests/test_pipeline.py)
# --------------------------------------------------------------------------------------------------


def test_tokenizer_and_model_load_with_no_flags_once_compressor_is_imported(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    res = compressor.run(compressor.recipe_from_dict(recipe_dict(src, tmp_path / "out")))
    assert json.loads((res.output / "tokenizer_config.json").read_text())["tokenizer_class"]
    tok = AutoTokenizer.from_pretrained(str(res.output))
    assert tok("hello world")["input_ids"] == AutoTokenizer.from_pretrained(str(src))("hello world")["input_ids"]
    assert type(AutoModelForCausalLM.from_pretrained(str(res.output))).__name__ == "CompressedLlamaForCausalLM"


# --------------------------------------------------------------------------------------------------
# Light imports, --help
# --------------------------------------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_help_does_not_import_torch_or_transformers():
    proc = _python(
        "import sys\n"
        "from compressor.cli import main\n"
        "for argv in (['--help'], ['run', '--help'], ['cache', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'datasets', 'matplotlib') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
    assert "exit codes:" in proc.stdout and "perplexity gate failed" in proc.stdout


def test_import_compressor_is_lazy():
    proc = _python(
        "import sys, compressor\n"
        "print('TORCH', 'torch' in sys.modules)\n"
        "r = compressor.recipe_from_dict({})\n"
        "print('VERSION', compressor.__version__, type(r).__name__)\n"
        "import compressor.fitting.solve\n"
        "print('STAGE', compressor.fitting.solve.solve_affine.__name__)\n"  # stage packages stay importable
        "import transformers\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
        "compressor.load_compressed\n"  # first public access with transformers loaded: registers
        "print('REGISTERED', 'compressed_llama' in CONFIG_MAPPING)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "TORCH False" in proc.stdout and "VERSION 0.1.0 Recipe" in proc.stdout
    assert "STAGE solve_affine" in proc.stdout and "REGISTERED True" in proc.stdout


def test_import_after_transformers_registers_at_once():
    proc = _python(
        "import transformers\n"
        "import compressor\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
        "print('REGISTERED', 'compressed_qwen2' in CONFIG_MAPPING)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "REGISTERED True" in proc.stdout


def test_run_help_lists_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for code in ("0  success", "1  runtime error", "2  invalid recipe or input", "3  perplexity gate failed"):
        assert code in out


# --------------------------------------------------------------------------------------------------
# profile.json counts and the plot
# --------------------------------------------------------------------------------------------------


def test_profile_json_has_parameter_counts(tmp_path):
    from compressor.fitting.replace import count_params

    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    prof = compressor.profile(str(src), seq_len=32, max_tokens=1024)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src))
    d = model.config.hidden_size
    for b in prof.blocks:
        assert b.ffn_params == count_params(model.model.layers[b.index].mlp) > 0
        assert b.affine_params == d * d + d


def _synthetic_profile():
    from compressor.engine.profiling import BlockProfile, Profile

    def block(i, r2, bulk, share, flagged):
        return BlockProfile(
            index=i, r2_lin=r2, r2_median_feature=r2, r2_bulk=bulk, outlier_sst_share=share, sink_sst_share=share,
            spike_sst_share=0.0, outlier_rows=1, outlier_dominated=flagged, explained_effective_rank=1.0,
            output_effective_rank=None, input_condition_number=None, input_effective_rank=1.0,
            input_dynamic_range=1.0, n_fit=10, n_heldout=5, d_in=4, d_out=4, damping=0.0, dead_inputs=0,
        )

    blocks = [block(0, 0.91, 0.8, 0.1, False), block(1, 0.97, -107.0, 0.99, True), block(2, 0.5, -2.0, 0.6, True),
              block(3, 0.3, 0.2, 0.05, False)]
    return Profile(model="synthetic", model_type="llama", blocks=blocks, tool_version="0",
                   settings={"outlier_share_flag": 0.5})


def test_profile_plot_marks_clipped_values_threshold_and_share_panel(tmp_path):
    import matplotlib.pyplot as plt

    from compressor.reports.plot import profile_figure, profile_plot

    fig = profile_figure(_synthetic_profile(), threshold=0.9)
    try:
        r2_ax, share_ax = fig.axes
        texts = [t.get_text() for t in r2_ax.texts]
        assert "-107" in texts and "-2" in texts  # clipped bulk R² written out
        assert any(abs(line.get_ydata()[0] - 0.9) < 1e-12 for line in r2_ax.get_lines())  # the threshold
        assert share_ax.get_ylim() == (0, 1.05)  # the share has its own 0–1 axis
        assert any("threshold 0.9" in t.get_text() for t in r2_ax.get_legend().get_texts())
    finally:
        plt.close(fig)
    path = profile_plot(_synthetic_profile(), tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_reload_check_allows_a_gpu_its_float32_noise_and_nothing_more():
    """Float32 on a GPU: the in-memory model and its reload differ by kernel and summation order
    (8.3e-5 on Gemma-3-270M on an H200), so 1e-3 there; the CPU keeps 1e-5; 16-bit compute 1e-2."""
    from compressor.output.hf import logit_tolerance

    assert logit_tolerance(torch.float32, on_gpu=False) == 1e-5
    assert logit_tolerance(torch.float32, on_gpu=True) == 1e-3
    assert logit_tolerance(torch.bfloat16, on_gpu=True) == logit_tolerance(torch.bfloat16, on_gpu=False) == 1e-2


def test_an_onloaded_model_that_computes_on_a_gpu_gets_the_gpu_tolerance():
    """An onloaded model's weights wait on the CPU, on disk or as meta placeholders; its accelerate hooks
    say where it computes, and that decides the reload check's tolerance."""
    from tiny import tiny_model

    from compressor.output.hf import computes_on_gpu

    model = tiny_model("llama")
    assert not computes_on_gpu(model)

    class Hook:  # what accelerate's AlignDevicesHook carries
        execution_device = 0

    model.get_input_embeddings()._hf_hook = Hook()
    assert computes_on_gpu(model)
