"""The size planner: GGML types from ggml's own quantizer, closed-form costs checked by brute force,
the allocation against exhaustive search, and a planned GGUF that an unmodified llama.cpp runs.

Tiny models from configs; the llama.cpp parts skip where llama-cpp-python is not installed.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from compressor.core import ggml
from compressor.core.ggml import GGMLType
from compressor.engine.tensorstats import EMBEDDING, input_moments, linear_names, output_fisher
from compressor.policy.options import Option, allocate, total_cost, total_size
from compressor.recipe.schema import OutputConfig, parse_size

pytestmark = pytest.mark.usefixtures("torch_single_thread")


# --------------------------------------------------------------------------------------------------
# GGML types
# --------------------------------------------------------------------------------------------------


def test_block_table_matches_gguf_py():
    gguf = pytest.importorskip("gguf")
    for t in GGMLType:
        q = gguf.GGMLQuantizationType(int(t))
        assert q.name == t.name and ggml.BLOCKS[t] == tuple(gguf.GGML_QUANT_SIZES[q])


@pytest.mark.parametrize("t", [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_1, GGMLType.IQ4_NL, GGMLType.Q2_K,
                               GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.IQ4_XS, GGMLType.IQ3_S])
def test_quantize_roundtrip_error_shrinks_with_bits_and_obeys_the_imatrix(t):
    """ggml's quantizer via ctypes: the bytes have the size the block table says, the error is small
    relative to the weights, and an importance matrix lowers the weighted error it was given."""
    pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 512)).astype(np.float32)
    raw = ggml.quantize(w, t)
    assert raw.shape == (64, ggml.bytes_per_row(t, 512))
    back = ggml.dequantize(raw, t, 512)
    rel = float(((back - w) ** 2).mean() / (w ** 2).mean())
    assert rel < {8: 1e-4}.get(int(ggml.bits_per_weight(t)), 0.2)
    imatrix = np.ones(512, dtype=np.float32)
    imatrix[:64] = 100.0  # the first columns matter far more
    weighted = ggml.roundtrip(w, t, imatrix)
    err_plain = float((((back - w) ** 2) * imatrix).sum())
    err_weighted = float((((weighted - w) ** 2) * imatrix).sum())
    assert err_weighted <= err_plain * 1.0001


def test_sizes_per_row_and_refusals():
    assert ggml.bytes_per_row(GGMLType.Q4_K, 512) == 288 and ggml.bits_per_weight(GGMLType.Q8_0) == 8.5
    assert ggml.fits(GGMLType.Q4_0, 576) and not ggml.fits(GGMLType.Q4_K, 576)
    with pytest.raises(ValueError, match="not a multiple of 256"):
        ggml.bytes_per_row(GGMLType.Q2_K, 576)


# --------------------------------------------------------------------------------------------------
# Allocation
# --------------------------------------------------------------------------------------------------


def _brute(units: dict[str, list[Option]], budget: float) -> float:
    best = float("inf")
    for combo in itertools.product(*units.values()):
        if sum(o.size for o in combo) <= budget:
            best = min(best, sum(o.cost for o in combo))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_feasible_maximal_and_near_the_exhaustive_optimum(seed):
    """Random units with convex-ish cost curves: the choice fits the budget, no single upgrade that
    saves cost still fits (the greedy fill), and its cost is within 10 % of exhaustive search."""
    rng = np.random.default_rng(seed)
    units = {}
    for u in range(5):
        sizes = np.sort(rng.choice(np.arange(1, 40), 4, replace=False)).astype(float)
        costs = np.sort(rng.random(4) * 10)[::-1]
        units[f"u{u}"] = [Option(f"u{u}", f"o{i}", s, c) for i, (s, c) in enumerate(zip(sizes, costs))]
    floor = sum(min(o.size for o in opts) for opts in units.values())
    budget = floor + rng.random() * 60
    choice = allocate(units, budget)
    assert total_size(choice) <= budget
    left = budget - total_size(choice)
    for u, opts in units.items():
        assert not any(o.cost < choice[u].cost and o.size - choice[u].size <= left for o in opts)
    assert total_cost(choice) <= _brute(units, budget) * 1.1 + 1e-9


def test_allocation_below_the_floor_returns_the_smallest_options():
    units = {"a": [Option("a", "big", 10, 0.0), Option("a", "small", 6, 1.0)]}
    assert allocate(units, 3)["a"].name == "small"


# --------------------------------------------------------------------------------------------------
# Statistics and the closed-form cost, against brute force
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    from tests.tiny import tiny_model

    torch.manual_seed(0)
    return tiny_model("llama").eval()


def _windows(model, n=6, seq=16):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, model.config.vocab_size, (n, seq), generator=g)


def test_input_moments_match_collected_inputs_and_share_one_matrix(llama):
    windows = _windows(llama)
    names = linear_names(llama)
    moments = input_moments(llama, windows, names, batch_size=4)
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    hooks = [llama.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: seen[n].append(a[0].detach().reshape(-1, a[0].shape[-1]).double())) for n in names]
    with torch.no_grad():
        llama(windows)
    for h in hooks:
        h.remove()
    for n in names:
        x = torch.cat(seen[n])
        assert torch.allclose(moments[n].double(), x.T @ x / windows.numel(), rtol=1e-4, atol=1e-6), n
    q, k = (n for n in names if n.endswith("layers.0.self_attn.q_proj") or n.endswith("layers.0.self_attn.k_proj"))
    assert moments[q] is moments[k]  # q and k read the same tensor: one matrix
    first = [n for n in names if ".layers.0." in n]
    calls = []
    hook = llama.get_submodule(names[-1]).register_forward_pre_hook(lambda m, a: calls.append(1))
    early = input_moments(llama, windows, first, batch_size=4)  # stops after layer 0: the head never runs
    hook.remove()
    assert not calls and all(torch.allclose(early[n], moments[n]) for n in first)


def test_the_closed_form_cost_equals_the_per_token_sum(llama):
    """½ Σ_o F_o (ΔW Ĥ ΔWᵀ)_oo equals ½ mean_t Σ_o F_o e_{t,o}² computed token by token."""
    from compressor.sizing.sites import Site, _imatrix

    windows = _windows(llama)
    name = "model.layers.1.mlp.down_proj"
    fisher = output_fisher(llama, windows, batch_size=4, names=[name])
    h = input_moments(llama, windows, [name])[name]
    assert fisher.tokens == windows.numel() and fisher.grad_sq[EMBEDDING].shape == (llama.config.hidden_size,)
    w = llama.get_submodule(name).weight.detach().float()
    delta = torch.randn_like(w) * 0.01
    site = Site("blk.1.ffn_down.weight", name, w, h.float(), fisher.grad_sq[name], _imatrix(torch.diagonal(h)))
    xs = []
    hook = llama.get_submodule(name).register_forward_pre_hook(lambda m, a: xs.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        llama(windows)
    hook.remove()
    e = torch.cat(xs).double() @ delta.double().T  # [tokens, d_out]
    brute = 0.5 * float((fisher.grad_sq[name] * e.pow(2).mean(0)).sum())
    assert site.cost(delta) == pytest.approx(brute, rel=1e-4)


def test_fisher_is_the_squared_gradient_of_the_summed_loss(llama):
    windows = _windows(llama, n=2)
    name = "model.layers.0.mlp.up_proj"
    fisher = output_fisher(llama, windows, batch_size=2, names=[name])
    outs = []

    def keep(module, args, out):
        out.retain_grad()
        outs.append(out)

    hook = llama.get_submodule(name).register_forward_hook(keep)
    llama.requires_grad_(False)
    emb = llama.get_input_embeddings()(windows).detach().requires_grad_(True)
    logits = llama(inputs_embeds=emb).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten(), reduction="sum").backward()
    hook.remove()
    g2 = outs[0].grad.double().pow(2).sum((0, 1)) / windows.numel()
    assert torch.allclose(fisher.grad_sq[name], g2, rtol=1e-4, atol=1e-12)
    assert fisher.token_counts.sum() == windows.numel()
    # the token counts may come from more text than the gradients: the same F, the counts of ``counted``
    more = torch.cat([windows, _windows(llama, n=3)])
    wider = output_fisher(llama, windows, batch_size=2, names=[name], counted=more)
    assert torch.equal(wider.grad_sq[name], fisher.grad_sq[name])
    assert wider.tokens == more.numel()
    assert torch.equal(wider.token_counts, torch.bincount(more.flatten(), minlength=llama.config.vocab_size).double())


def test_gram_is_the_float32_product_of_what_the_layer_multiplies(monkeypatch):
    """``gram``: a float32 input's float32 product (column blocks, the lower mirrored), under an autocast too; a
    bfloat16 input's float32 product to 1e-5 of the largest entry, symmetric and positive semi-definite, where one
    bfloat16 product is indefinite; where a device's GEMM would round before it accumulates, a float32 product."""
    from compressor.engine import tensorstats

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 600, generator=g) * torch.logspace(-2, 1.5, 600)  # fewer tokens than inputs: singular
    assert torch.allclose(tensorstats.gram(x), x.T @ x, rtol=1e-5, atol=1e-5 * float((x.T @ x).abs().max()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = tensorstats.gram(x)
    assert under.dtype == torch.float32 and torch.allclose(under, x.T @ x, rtol=1e-5, atol=1e-3)
    xb = x.bfloat16()
    exact = xb.double().T @ xb.double()
    scale = float(exact.abs().max())
    got = tensorstats.gram(xb)
    assert got.dtype == torch.float32 and torch.equal(got, got.T)
    if tensorstats._two_pass_exact("cpu"):
        assert float((got.double() - exact).abs().max()) <= 1e-5 * scale
        assert float(torch.linalg.eigvalsh(got.double()).min()) > -1e-5 * scale
        single = (xb.T @ xb).double()  # one bfloat16 product: what is not done
        assert float(torch.linalg.eigvalsh(single).min()) < -1e-4 * scale
    monkeypatch.setattr(tensorstats, "_two_pass_exact", lambda device_type: False)
    assert float((tensorstats.gram(xb).double() - exact).abs().max()) <= 1e-6 * scale


def test_bfloat16_statistics_where_native_and_close_to_float32(llama, monkeypatch):
    """``output.size_precision: auto`` takes bfloat16 for a float32 model on a device that multiplies it natively,
    float32 elsewhere and for a model already in half precision; the bfloat16 passes' Ĥ and F are close to the
    float32 ones and Ĥ stays positive definite once damped (GPTQ's Cholesky)."""
    import copy

    from compressor.fitting.gridround import factor
    from compressor.pipeline.size import prices

    P = prices.StatisticsPrecision
    monkeypatch.setattr(prices, "native_bfloat16", lambda device: True)
    assert P.resolve("auto", llama).name == "bfloat16" and P.resolve("float32", llama).name == "float32"
    assert P.resolve("auto", copy.deepcopy(llama).to(torch.bfloat16)).name == "float32"
    monkeypatch.setattr(prices, "native_bfloat16", lambda device: False)
    assert P.resolve("auto", llama).name == "float32" and P.resolve("bfloat16", llama).name == "bfloat16"
    windows = _windows(llama)
    names = linear_names(llama)
    ref_h, ref_f = input_moments(llama, windows, names, batch_size=4), output_fisher(llama, windows, batch_size=4)
    with P("bfloat16").context(llama):
        assert torch.is_autocast_enabled("cpu")
        h, f = input_moments(llama, windows, names, batch_size=4), output_fisher(llama, windows, batch_size=4)
    assert not torch.is_autocast_enabled("cpu")
    for n in names:
        assert h[n].dtype == torch.float32 and float((h[n] - ref_h[n]).norm() / ref_h[n].norm()) < 0.05, n
        assert float((f.grad_sq[n] - ref_f.grad_sq[n]).norm() / ref_f.grad_sq[n].norm()) < 0.1, n
        factor(h[n])  # raises if the damped Ĥ is not positive definite
    with P("float32").context(llama):
        assert not torch.is_autocast_enabled("cpu")
    offloaded = copy.deepcopy(llama)
    offloaded.get_input_embeddings().to("meta")  # an offloaded weight: the passes compute where the others are
    with P("bfloat16").context(offloaded):
        assert torch.is_autocast_enabled("cpu")


def test_size_precision_is_read_only_with_a_size():
    with pytest.raises(ValueError, match="size_precision"):
        OutputConfig(size_precision="float32")
    assert OutputConfig(size="Q4_K_M", size_precision="bfloat16").size_precision == "bfloat16"


# --------------------------------------------------------------------------------------------------
# Recipe
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [("750MB", ("bytes", 750_000_000)), ("1.5GiB", ("bytes", 1_610_612_736)),
                                        ("123456", ("bytes", 123456)), ("4.5bpw", ("bpw", 4.5)),
                                        ("q3_k_m", ("preset", "Q3_K_M")), ("Q2_K", ("preset", "Q2_K"))])
def test_sizes_parse(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text, match", [("huge", "is not a size"), ("40bpw", "between 1.5 and 16"),
                                         ("0MB", "must be positive")])
def test_bad_sizes_name_the_forms(text, match):
    with pytest.raises(ValueError, match=match):
        OutputConfig(size=text, formats=["gguf"])


def test_size_with_another_quant_is_refused():
    with pytest.raises(ValueError, match="remove output.gguf_quant"):
        OutputConfig(size="Q4_K_M", formats=["gguf"], gguf_quant="q8_0")


def test_presets_the_schema_names_are_the_writer_s():
    pytest.importorskip("gguf")
    from compressor.output.gguf.encode import PRESETS
    from compressor.recipe.schema import SIZE_PRESETS

    assert set(SIZE_PRESETS) == set(PRESETS)


def test_row_sampling_is_unbiased_and_keeps_the_rows_that_matter():
    """A tensor priced on a sample of its rows: the heaviest rows always, the rest drawn and reweighted;
    over many draws the weighted sum averages to the full sum."""
    from compressor.sizing.sites import Site, sample_rows

    torch.manual_seed(0)
    n, d = 600, 8
    w = torch.randn(n, d)
    f = torch.rand(n).double() ** 4
    h = torch.eye(d)
    delta = torch.randn(n, d) * 0.1
    full = Site("t", "m", w, h, f, np.ones(d, dtype=np.float32)).cost(delta)
    estimates = []
    for seed in range(200):
        s = sample_rows(Site("t", "m", w, h, f, np.ones(d, dtype=np.float32)), limit=100, seed=seed)
        assert len(s.rows) == 100 and set(torch.topk(f, 50).indices.tolist()) <= set(s.rows.tolist())
        estimates.append(s.cost(delta[s.rows]))
    assert np.mean(estimates) == pytest.approx(full, rel=0.03)
    small = Site("t", "m", w[:50], h, f[:50], np.ones(d, dtype=np.float32))
    assert sample_rows(small, limit=100).rows is None


def test_prices_round_trip_through_the_cache_format():
    from compressor.sizing.plan import Choice, Priced, from_tensors, plan, to_tensors

    units = {n: [Option(n, "Q4_0", 18.0 * k, 2.0 / k, payload=Choice(GGMLType.Q4_0, n == "b")),
                 Option(n, "Q8_0", 34.0 * k, 0.1 / k, payload=Choice(GGMLType.Q8_0, True))]
             for k, n in ((1, "a"), (2, "b"))}
    priced = [Priced("a", "m.a", (1, 32), np.ones(32, dtype=np.float32)),
              Priced("b", "m.b", (2, 32), np.arange(32, dtype=np.float32))]
    from compressor.output.gguf.target import GGUFTarget

    back_units, back_priced = from_tensors(*to_tensors(units, priced), GGUFTarget().payload)
    assert back_units == units and [p.name for p in back_priced] == ["a", "b"]
    assert np.array_equal(back_priced[1].imatrix, priced[1].imatrix)
    p = plan(back_units, back_priced, 18 + 68)
    assert p.types == {"a": "Q8_0", "b": "Q4_0"} and p.tensor_bytes == 70  # 1.9 saved for 16 bytes beats 0.95 for 32
    assert set(p.imatrix) == {"a", "b"}  # both chosen options were priced with the importance matrix
    p = plan(back_units, back_priced, 18 + 36)
    assert p.types == {"a": "Q4_0", "b": "Q4_0"} and set(p.imatrix) == {"b"}  # a's Q4_0 was cheaper unweighted


def test_a_type_is_priced_with_and_without_the_importance_matrix_and_keeps_the_cheaper():
    """An importance matrix that disagrees with the true cost (here the cost weighs every column alike,
    the matrix a seventh of them 50×): quantizing with it costs more, so the option keeps the unweighted
    price and says so; with a matrix that agrees it keeps the weighted one. F16 takes no matrix."""
    pytest.importorskip("llama_cpp")
    from compressor.sizing.sites import Site
    from compressor.output.gguf.pricing import price, variants

    w = torch.from_numpy(np.random.default_rng(0).standard_normal((32, 256)).astype(np.float32))
    skew = np.ones(256, dtype=np.float32)
    skew[::7] = 50.0
    site = Site("t", "m", w, torch.eye(256), torch.ones(32), skew)
    costs = {m is not None: site.cost(torch.from_numpy(ggml.roundtrip(w.numpy(), GGMLType.Q4_K, m)) - w)
             for m in (None, skew)}
    (opt,) = price(site, (GGMLType.Q4_K,))
    assert costs[False] < costs[True] and opt.payload.weighted is False and opt.cost == pytest.approx(costs[False])
    agreeing = Site("t", "m", w, torch.diag(torch.from_numpy(skew)), torch.ones(32), skew)
    (opt,) = price(agreeing, (GGMLType.Q4_K,))
    assert opt.payload.weighted is True
    assert variants(site, GGMLType.F16) == [None]


def test_the_rounding_is_chosen_on_the_probe_rows_and_priced_over_every_row():
    """Off a grid, error-compensating rounding wins on the probe (the rows of largest F) and its price is GPTQ
    over every row, the same number as rounding the whole tensor by hand. On the type's own grid (weights
    ggml's rounding leaves exact) nothing is left to compensate: nearest rounding at no cost, no GPTQ."""
    pytest.importorskip("llama_cpp")
    from compressor.fitting import gridround
    from compressor.output.gguf.pricing import PROBE_ROWS, price
    from compressor.sizing.sites import Site

    g = np.random.default_rng(3)
    rows, n = 3 * PROBE_ROWS, 256
    x = g.standard_normal((4 * n, n)) @ (g.standard_normal((n, n)) / n ** 0.5 + 0.5 * np.eye(n))
    h = torch.from_numpy((x.T @ x / x.shape[0]).astype(np.float32))
    w = torch.from_numpy((g.standard_normal((rows, n)) * 0.05).astype(np.float32))
    f = torch.from_numpy(g.uniform(0.5, 2.0, rows))
    imat = torch.diagonal(h).numpy() / float(torch.diagonal(h).max())
    site = Site("t", "m", w, h, f, imat)
    assert len(site.probe(PROBE_ROWS)) == PROBE_ROWS and set(site.probe(PROBE_ROWS).tolist()) == set(
        torch.topk(f, PROBE_ROWS).indices.tolist())
    (opt,) = price(site, (GGMLType.Q4_0,))
    assert opt.payload.compensated and opt.payload.weighted
    by_hand = gridround.dequantize(gridround.gptq_quantize(w, h, GGMLType.Q4_0, imat), GGMLType.Q4_0, tuple(w.shape))
    assert opt.cost == pytest.approx(site.cost(torch.from_numpy(by_hand) - w), rel=1e-9)
    nearest = site.cost(torch.from_numpy(ggml.roundtrip(w.numpy(), GGMLType.Q4_0, imat)) - w)
    assert opt.cost < 0.7 * nearest
    on_grid = torch.from_numpy(ggml.roundtrip(w.numpy(), GGMLType.Q4_0))
    (opt,) = price(Site("t", "m", on_grid, h, f, imat), (GGMLType.Q4_0,))
    assert not opt.payload.compensated and opt.cost == pytest.approx(0.0, abs=1e-12)


def test_pricing_keeps_the_bytes_of_full_row_roundings_for_the_plan():
    """A tensor priced on every row offers its GPTQ bytes (the same as rounding it by hand) to ``kept``; a
    tensor priced on a sample of rows offers none, and nothing is kept past the limit."""
    pytest.importorskip("llama_cpp")
    from compressor.fitting import gridround
    from compressor.output.gguf.pricing import PROBE_ROWS, price
    from compressor.sizing.plan import Rounded
    from compressor.sizing.sites import Site, sample_rows

    g = np.random.default_rng(4)
    rows, n = 2 * PROBE_ROWS, 256
    x = g.standard_normal((4 * n, n)).astype(np.float32)
    h = torch.from_numpy(x.T @ x / x.shape[0])
    w = torch.from_numpy((g.standard_normal((rows, n)) * 0.05).astype(np.float32))
    imat = torch.diagonal(h).numpy() / float(torch.diagonal(h).max())
    kept = Rounded(1 << 20)
    (q4, q5) = price(Site("t", "m", w, h, torch.ones(rows), imat), (GGMLType.Q4_0, GGMLType.Q5_0), kept=kept)
    assert q4.payload.compensated and q5.payload.compensated and set(kept) == {("t", "Q4_0"), ("t", "Q5_0")}
    assert np.array_equal(kept["t", "Q4_0"], gridround.gptq_quantize(w, h, GGMLType.Q4_0, imat))
    assert kept.nbytes == sum(r.nbytes for r in kept.values())
    sampled = sample_rows(Site("s", "m", w, h, torch.ones(rows), imat), limit=PROBE_ROWS + 2)
    price(sampled, (GGMLType.Q4_0,), kept=kept)
    full = Rounded(kept["t", "Q4_0"].nbytes - 1)
    price(Site("t", "m", w, h, torch.ones(rows), imat), (GGMLType.Q4_0,), kept=full)
    assert ("s", "Q4_0") not in kept and not full and full.nbytes == 0


def test_a_type_another_beats_on_the_probe_with_no_more_bytes_is_not_offered(monkeypatch):
    """:func:`undominated` keeps exactly the types no type of fewer bytes beats by the margin and none of the same
    bytes beats at all (brute force on random costs), and on an off-grid tensor the allocation over every type
    never picks one it dropped."""
    pytest.importorskip("llama_cpp")
    from compressor.core.ggml import bytes_per_row
    from compressor.output.gguf import pricing
    from compressor.output.gguf.pricing import DEFAULT_TYPES, DOMINATED_SHARE, PROBE_ROWS, offered, price, undominated
    from compressor.sizing.sites import Site

    g = np.random.default_rng(5)
    kinds = offered(DEFAULT_TYPES, 256)
    for _ in range(20):
        cost = dict(zip(kinds, g.uniform(0, 1, len(kinds)) * g.integers(0, 2, len(kinds))))
        kept = undominated(kinds, 256, cost)
        for t in kinds:
            size = {u: bytes_per_row(u, 256) for u in kinds}
            beaten = any((size[u] < size[t] and cost[u] < DOMINATED_SHARE * cost[t])
                         or (size[u] == size[t] and cost[u] < cost[t]) for u in kinds if u is not t)
            assert (t in kept) != beaten
    rows, n = 3 * PROBE_ROWS, 256
    monkeypatch.setattr(pricing, "SUPERSEDED", {})  # every type priced on the probe: the dominance rule alone
    x = g.standard_normal((4 * n, n)).astype(np.float32)
    h = torch.from_numpy(x.T @ x / x.shape[0])
    w = torch.from_numpy((g.standard_normal((rows, n)) * 0.05).astype(np.float32))
    imat = torch.diagonal(h).numpy() / float(torch.diagonal(h).max())
    site = Site("t", "m", w, h, torch.from_numpy(g.uniform(0.5, 2.0, rows)), imat)
    pruned = price(site)
    monkeypatch.setattr(pricing, "undominated", lambda kinds, n, cost: kinds)
    every = price(site)
    assert len(pruned) < len(every) == len(kinds)
    names = {o.name for o in pruned}
    for budget in sorted({o.size for o in every}):
        assert allocate({"t": every}, budget)["t"].name in names


def test_a_32_element_type_a_k_quant_supersedes_is_offered_only_to_a_tensor_on_its_grid():
    """Rows the k-quants fit are not priced in the 32-element types they supersede, unless the tensor already sits
    on that type's grid (ggml's rounding leaves the probe exact): a source on Q4_0's grid keeps Q4_0, at no cost."""
    pytest.importorskip("llama_cpp")
    from compressor.core.ggml import quantize
    from compressor.fitting.gridround import dequantize
    from compressor.output.gguf.pricing import SUPERSEDED, price
    from compressor.sizing.sites import Site

    g = np.random.default_rng(9)
    rows, n = 64, 256
    x = g.standard_normal((4 * n, n)).astype(np.float32)
    h = torch.from_numpy(x.T @ x / x.shape[0])
    imat = torch.diagonal(h).numpy() / float(torch.diagonal(h).max())
    off = (g.standard_normal((rows, n)) * 0.05).astype(np.float32)
    on = dequantize(quantize(off, GGMLType.Q4_0), GGMLType.Q4_0, (rows, n)).astype(np.float32)
    names = {}
    for label, w in (("off", off), ("on", on)):
        opts = price(Site(label, "m", torch.from_numpy(w), h, torch.ones(rows), imat))
        names[label] = {o.name: o for o in opts}
    assert not set(names["off"]) & {t.name for t in SUPERSEDED}
    assert "Q4_0" in names["on"] and names["on"]["Q4_0"].cost == 0.0
    for t in SUPERSEDED:  # a finer grid that holds Q4_0's (Q5_0's, at the same scale) is exact too; no other
        assert (t.name in names["on"]) == (t.name in names["on"] and names["on"][t.name].cost == 0.0)


def test_the_plans_rounding_rounds_a_tensor_beside_the_types_pricing_rounded_it_with():
    """A tensor priced on all its rows is rounded again (prices from the cache, or past the kept bytes) together
    with the compensated types pricing rounded it with, in pricing's order: one column loop for several types
    sums in another order than one for a type alone, so only that reproduces pricing's bytes. A tensor priced on
    a sample of rows, or a type not compensated, is rounded alone."""
    from compressor.pipeline.size.rounding import Compensator
    from compressor.sizing.plan import Choice, Priced
    from compressor.sizing.sites import priced_rows

    def opts(name):
        return [Option(name, t.name, 1, 0.0, payload=Choice(t, True, g))
                for t, g in ((GGMLType.Q4_0, True), (GGMLType.Q5_0, True), (GGMLType.Q5_1, True), (GGMLType.Q8_0, False))]

    wide = priced_rows(64) + 1
    priced = [Priced("small", "m", (8, 64), np.ones(64)), Priced("large", "m", (wide, 64), np.ones(64))]
    comp = Compensator(None, priced, torch.zeros(1, 1), 1, {}, None, units={p.name: opts(p.name) for p in priced})
    assert comp._alongside("small", "Q5_0") == ["Q4_0", "Q5_0", "Q5_1"]
    assert comp._alongside("small", "Q8_0") is None and comp._alongside("large", "Q5_0") is None


def test_fisher_reads_a_spread_share_of_the_windows():
    from compressor.pipeline.size.prices import fisher_windows

    windows = torch.arange(40 * 8).view(40, 8)
    some = fisher_windows(windows, tokens=80)
    assert some.shape == (10, 8) and some[0, 0] == 0 and some[-1, 0] == windows[-1, 0]
    assert (torch.diff(some[:, 0]) >= 4 * 8).all()  # spread over the text, not its beginning
    assert fisher_windows(windows, tokens=10_000) is windows and fisher_windows(windows, tokens=1).shape == (1, 8)


def test_a_large_unit_whose_step_overshoots_the_multiplier_is_still_taken():
    """One unit a large share of the budget (an embedding) whose upgrade saves a little less per byte than
    the small units' upgrades: the multiplier stops before it and the fill has no room left, though taking
    it and stepping a few small units down is cheaper. The allocation finds that (exhaustive check)."""
    units = {"emb": [Option("emb", "q5", 60, 1.0), Option("emb", "q8", 85, 0.0)]}  # 0.040 per byte
    for i in range(10):  # 0.0425 per byte each
        units[f"t{i}"] = [Option(f"t{i}", "q4", 4, 0.17), Option(f"t{i}", "q8", 8, 0.0)]
    budget = 150
    plain = allocate(units, budget, lumpy=0)
    chosen = allocate(units, budget)
    assert plain["emb"].name == "q5" and total_cost(plain) == pytest.approx(1.0)
    assert chosen["emb"].name == "q8" and total_size(chosen) <= budget
    assert total_cost(chosen) == pytest.approx(_brute(units, budget)) == pytest.approx(4 * 0.17)


@pytest.mark.parametrize("seed", range(3))
def test_the_smallest_plan_within_a_predicted_cost_is_found_by_bisection(seed):
    """``smallest_within``: its plan's predicted cost is within the target, and the allocation one
    tolerance fewer bytes is not; a target even the smallest types meet gives the smallest types."""
    from compressor.sizing.plan import Choice, Priced, smallest_within

    rng = np.random.default_rng(seed)
    units, priced = {}, []
    for i in range(12):
        sizes = np.sort(rng.integers(10, 400, 4)) * 100
        costs = np.sort(rng.random(4))[::-1] * rng.random()
        units[f"t{i}"] = [Option(f"t{i}", f"x{j}", float(sizes[j]), float(costs[j]),
                                 payload=Choice(GGMLType.Q8_0, True)) for j in range(4)]
        priced.append(Priced(f"t{i}", f"m{i}", (1, 32), np.ones(32, dtype=np.float32)))
    hi = int(total_size({n: max(o, key=lambda o: o.size) for n, o in units.items()}))
    target = 0.5 * total_cost({n: min(o, key=lambda o: o.size) for n, o in units.items()})
    p = smallest_within(units, priced, hi, target, tolerance=64)
    assert p.predicted_nll_increase <= target
    assert total_cost(allocate(units, p.budget_bytes - 65)) > target
    floor = smallest_within(units, priced, hi, 1e9)
    assert floor.tensor_bytes == total_size({n: min(o, key=lambda o: o.size) for n, o in units.items()})



def test_pricing_quantizes_each_type_once_and_its_rows_are_ggml_s_own(monkeypatch):
    """:class:`~compressor.output.gguf.pricing.Weighted` quantizes a tensor's priced rows once per type (its probe
    and every rounding reuse them): any subset of rows is what ggml gives those rows alone (rows are quantized
    independently), decoded as llama.cpp decodes them."""
    pytest.importorskip("llama_cpp")
    from compressor.output.gguf import pricing

    g = torch.Generator().manual_seed(2)
    rows = torch.randn(12, 256, generator=g) * 0.03
    imat = (torch.rand(256, generator=g) + 0.1).numpy()
    w = pricing.Weighted(rows, imat)
    calls, real = [], pricing.quantize
    monkeypatch.setattr(pricing, "quantize", lambda *a: calls.append(a[1]) or real(*a))
    at = torch.tensor([1, 4, 9])
    for t in (GGMLType.Q4_K, GGMLType.IQ4_XS):
        assert np.array_equal(w.raw(t, at), ggml.quantize(rows[at].numpy(), t, imat))
        assert np.array_equal(w.values(t, at), ggml.roundtrip(rows[at].numpy(), t, imat))
        assert np.array_equal(w.raw(t), ggml.quantize(rows.numpy(), t, imat))
    assert calls == [GGMLType.Q4_K, GGMLType.IQ4_XS]
