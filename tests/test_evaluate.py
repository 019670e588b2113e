"""Evaluation metrics: KL fidelity against a full-softmax reference, perplexity
standard errors against a direct per-window computation, and per-domain gating."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tiny import VOCAB, tiny_model

from compressor.evaluation.gate import Evaluator, gate_check

from compressor.evaluation.perplexity import _windows, perplexity, ratio_mean_se

from compressor.evaluation.teacher import TeacherCache, evaluate

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SEQ, STRIDE = 32, 16


def stream(n: int = 300, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g)


@torch.no_grad()
def reference(teacher, student, tokens):
    """Per window: (student NLL sum, full-softmax KL sum, count), one window at a time."""
    out = []
    for b, e, scored in _windows(tokens.numel(), SEQ, STRIDE):
        ids = tokens[b:e][None]
        k = min(scored, e - b - 1)
        lp = F.log_softmax(teacher(input_ids=ids).logits.float()[0, :-1], -1)[-k:]
        lq = F.log_softmax(student(input_ids=ids).logits.float()[0, :-1], -1)[-k:]
        nll = -lq.gather(-1, ids[0, 1:, None][-k:]).squeeze(-1)
        kl = (lp.exp() * (lp - lq)).sum(-1)
        out.append((float(nll.double().sum()), float(kl.double().sum()), k))
    return out


def test_kl_exact_with_full_vocab_and_lower_bound_with_small_k():
    teacher, student = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    tokens = stream()
    ref = reference(teacher, student, tokens)
    n = sum(r[2] for r in ref)
    kl_ref = sum(r[1] for r in ref) / n

    exact = evaluate(student, TeacherCache.build(teacher, tokens, seq_len=SEQ, stride=STRIDE, top_k=VOCAB))
    assert exact.tokens == n
    assert exact.kl == pytest.approx(kl_ref, rel=1e-5)
    assert exact.nll == pytest.approx(sum(r[0] for r in ref) / n, rel=1e-6)

    for k in (1, 4, 16):
        bound = evaluate(student, TeacherCache.build(teacher, tokens, seq_len=SEQ, stride=STRIDE, top_k=k))
        assert 0 <= bound.kl <= kl_ref + 1e-6
    # The teacher against itself: zero divergence, and the cached baseline is the plain perplexity.
    t = TeacherCache.build(teacher, tokens, seq_len=SEQ, stride=STRIDE, top_k=8)
    same = evaluate(teacher, t)
    assert abs(same.kl) < 1e-5
    plain = perplexity(teacher, tokens, seq_len=SEQ, stride=STRIDE)
    assert t.baseline.ppl == pytest.approx(plain.ppl, rel=1e-6) == pytest.approx(same.ppl, rel=1e-6)
    assert t.baseline.ppl_se == pytest.approx(plain.ppl_se, rel=1e-6)


def test_ppl_standard_error_matches_a_direct_per_window_computation():
    model = tiny_model("gpt2")
    tokens = stream(400, seed=3)
    ref = reference(model, model, tokens)
    s = torch.tensor([r[0] for r in ref], dtype=torch.float64)
    c = torch.tensor([r[2] for r in ref], dtype=torch.float64)
    mean = s.sum() / c.sum()
    m = len(ref)
    se = math.sqrt(float(((s - mean * c) ** 2).sum()) / (m * (m - 1) * float(c.mean()) ** 2))
    p = perplexity(model, tokens, seq_len=SEQ, stride=STRIDE, batch_size=3)
    assert p.windows == m
    assert p.nll == pytest.approx(float(mean), rel=1e-7)
    assert p.nll_se == pytest.approx(se, rel=1e-6)
    assert p.ppl_se == pytest.approx(math.exp(float(mean)) * se, rel=1e-6)
    # Equal window sizes: the ratio estimator is the SE of the mean of window means.
    x = torch.tensor([1.0, 2.0, 4.0, 7.0])
    r, e = ratio_mean_se(x * 10, torch.full((4,), 10.0))
    assert r == pytest.approx(3.5) and e == pytest.approx(float(x.std() / 2))


def policy(**kw):
    return SimpleNamespace(**({"metric": "ppl", "ppl_budget": 0.05, "budget_mode": "relative", "kl_budget": 0.05} | kw))


def test_gate_holds_on_every_domain_and_names_the_one_over_budget():
    teacher, student = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    with torch.no_grad():
        student.model.norm.weight.mul_(20)  # sharper, wrong predictions: clearly worse perplexity
    ev = Evaluator.build(teacher, {"alpha": stream(200, 1), "beta": stream(200, 2)}, seq_len=SEQ, stride=STRIDE)
    base = ev.baseline
    assert set(base.domains) == {"alpha", "beta"} and base.ppl == base.domains["alpha"].ppl

    ok, msg, per = gate_check(base, ev(teacher), policy())
    assert ok and set(per) == {"alpha", "beta"} and all(r["passed"] for r in per.values())

    # Same on alpha, a worse model on beta: the gate fails and says where.
    worse = dict(ev(teacher).domains)
    worse["beta"] = ev(student).domains["beta"]
    ok, msg, per = gate_check(base, worse, policy(ppl_budget=0.01))
    assert not ok and per["alpha"]["passed"] and not per["beta"]["passed"]
    assert "beta" in msg and "alpha" not in msg

    ok, msg, per = gate_check(base, worse, policy(metric="kl", kl_budget=1e-4))
    assert not ok and "beta" in msg and "KL" in msg and per["alpha"]["kl"] < 1e-5
    ok, _, _ = gate_check(base, worse, policy(metric="kl", kl_budget=100.0))
    assert ok


def _ev(ppl: float, *, windows: int = 32, delta_se: float | None = None, kl: float = 0.0, kl_se: float = 0.0):
    from compressor.evaluation.perplexity import Evaluation

    nll = math.log(ppl)
    return Evaluation(ppl=ppl, nll=nll, tokens=windows * 256, seq_len=256, stride=256, windows=windows,
                      nll_se=0.01, ppl_se=0.01 * ppl, name="d", kl=kl, kl_se=kl_se, top_k=64,
                      nll_delta_se=delta_se)


def test_gate_decides_on_the_upper_confidence_bound_of_the_change():
    from compressor.evaluation.gate import upper_quantile

    # Student t with windows − 1 degrees of freedom (exact: 1.3095 at 31, 1.3406 at 15); 0 at 0.5
    assert upper_quantile(0.9, 32) == pytest.approx(1.3095, abs=2e-3)
    assert upper_quantile(0.9, 16) == pytest.approx(1.3406, abs=2e-3)
    assert upper_quantile(0.5, 32) == 0.0
    base = _ev(10.0, delta_se=0.0)
    # +4 % measured, paired SE of ΔNLL 1 %: the 90 % bound is about +5.4 % > +5 %
    cand = _ev(10.4, delta_se=0.01)
    ok, msg, per = gate_check(base, cand, policy(confidence=0.9))
    row = per["d"]
    assert not ok and not row["passed"] and row["paired"]
    assert row["relative_delta"] == pytest.approx(0.04)
    assert row["relative_delta_upper"] == pytest.approx(1.04 * math.exp(upper_quantile(0.9, 32) * 0.01) - 1)
    assert "90% bound" in msg and "+4.00%" in msg
    # the same change with a small enough error passes; confidence 0.5 is the bare point test
    assert gate_check(base, _ev(10.4, delta_se=0.002), policy(confidence=0.9))[0]
    assert gate_check(base, cand, policy(confidence=0.5))[0]
    # a policy without the field (an older caller) gets the 90 % default
    assert not gate_check(base, cand, policy())[0]
    # KL: kl + t·se against the budget
    kl_cand = _ev(10.0, delta_se=0.0, kl=0.04, kl_se=0.01)
    ok, _, per = gate_check(base, kl_cand, policy(metric="kl", kl_budget=0.05, confidence=0.9))
    assert not ok and per["d"]["kl_upper"] == pytest.approx(0.04 + upper_quantile(0.9, 32) * 0.01)
    assert gate_check(base, kl_cand, policy(metric="kl", kl_budget=0.06, confidence=0.9))[0]


def test_gate_holds_the_bound_to_the_budget_less_the_headroom():
    """policy.headroom: the bound must be within (1 − headroom) × the budget, for ppl (relative and
    absolute) and kl; the recipe default is 0.2 (a +5 % budget is held at +4 %)."""
    from compressor.evaluation.gate import gate_budget, gate_ppl_limit, upper_quantile
    from compressor.recipe.schema import PolicyConfig

    assert PolicyConfig().headroom == 0.2 and gate_budget(PolicyConfig()) == pytest.approx(0.04)
    base = _ev(10.0, delta_se=0.0)
    # +4.2 %, exactly measured: within +5 %, over +4 % (headroom 0.2), within +4.5 % (headroom 0.1)
    cand = _ev(10.42, delta_se=0.0)
    assert gate_check(base, cand, policy(confidence=0.9))[0]
    ok, msg, per = gate_check(base, cand, policy(confidence=0.9, headroom=0.2))
    assert not ok and per["d"]["limit"] == pytest.approx(10.4) and "limit 10.4000" in msg
    assert gate_check(base, cand, policy(confidence=0.9, headroom=0.1))[0]
    # absolute mode: ppl ≤ base + budget·(1 − headroom)
    pol = policy(budget_mode="absolute", ppl_budget=0.5, headroom=0.2)
    assert gate_ppl_limit(10.0, pol) == pytest.approx(10.4)
    assert not gate_check(base, cand, pol)[0] and gate_check(base, _ev(10.39, delta_se=0.0), pol)[0]
    # kl: kl + t·se ≤ kl_budget·(1 − headroom)
    kl_cand = _ev(10.0, delta_se=0.0, kl=0.03, kl_se=0.005)
    upper = 0.03 + upper_quantile(0.9, 32) * 0.005
    assert gate_check(base, kl_cand, policy(metric="kl", kl_budget=0.05, confidence=0.9))[0]
    ok, _, per = gate_check(base, kl_cand, policy(metric="kl", kl_budget=upper / 0.85, confidence=0.9, headroom=0.2))
    assert not ok and per["d"]["limit"] == pytest.approx(upper / 0.85 * 0.8)
    with pytest.raises(ValueError):
        PolicyConfig(headroom=1.0)


def test_gate_without_paired_errors_uses_both_errors_conservatively():
    from compressor.evaluation.perplexity import Perplexity

    b = Perplexity(ppl=10.0, nll=math.log(10.0), tokens=4096, seq_len=256, stride=256, windows=16, nll_se=0.01, ppl_se=0.1)
    c = Perplexity(ppl=10.4, nll=math.log(10.4), tokens=4096, seq_len=256, stride=256, windows=16, nll_se=0.01, ppl_se=0.1)
    ok, _, per = gate_check(b, c, policy(confidence=0.9))
    assert not ok and not per["evaluation"]["paired"]
    assert per["evaluation"]["ppl_upper"] == pytest.approx(10.4 * math.exp(per["evaluation"]["quantile"] * math.sqrt(2) * 0.01))
