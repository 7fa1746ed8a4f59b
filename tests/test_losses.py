"""distill/losses.py against naive per-position reference implementations."""

from __future__ import annotations

import math

import pytest
import torch

from omnidraft.distill.losses import direct_kl, ngram_approx_kl, ngram_nll, position_weights


def _naive_direct_kl(draft_logits, topk_ids, topk_logp, t2d):
    total = 0.0
    for n in range(draft_logits.shape[0]):
        q = torch.softmax(draft_logits[n].double(), 0)
        qk, pk = [], []
        for t, lp in zip(topk_ids[n].tolist(), topk_logp[n].tolist()):
            d = int(t2d[t])
            qk.append(float(q[d]) if d >= 0 else 0.0)
            pk.append(math.exp(lp))
        kl = sum(a * (math.log(a) - math.log(b)) for a, b in zip(qk, pk) if a > 0)
        q_rest, p_rest = max(1 - sum(qk), 1e-12), max(1 - sum(pk), 1e-12)
        total += kl + q_rest * (math.log(q_rest) - math.log(p_rest))
    return total / draft_logits.shape[0]


def test_direct_kl_matches_the_naive_formula():
    g = torch.Generator().manual_seed(0)
    vd, vt, n, k = 40, 60, 5, 8
    t2d = torch.full((vt,), -1, dtype=torch.long)
    t2d[:30] = torch.randperm(vd, generator=g)[:30]
    draft_logits = torch.randn(n, vd, generator=g)
    target_logp = torch.log_softmax(torch.randn(n, vt, generator=g) * 2, -1)
    topk_logp, topk_ids = target_logp.topk(k, dim=-1)
    got = direct_kl(draft_logits, topk_ids, topk_logp, t2d)
    assert float(got) == pytest.approx(_naive_direct_kl(draft_logits, topk_ids, topk_logp, t2d), rel=1e-5)


def test_direct_kl_is_zero_when_the_drafter_matches_the_target_exactly():
    vt = 10
    p = torch.softmax(torch.randn(3, vt), -1)
    topk_logp, topk_ids = p.log().topk(vt, dim=-1)
    assert float(direct_kl(p.log(), topk_ids, topk_logp, torch.arange(vt))) == pytest.approx(0.0, abs=1e-5)


def test_ngram_losses_match_naive_formulas():
    g = torch.Generator().manual_seed(1)
    logits, subs = torch.randn(4, 12, generator=g), torch.tensor([3, 5, 7, 1])
    naive = sum(-math.log(float(torch.softmax(logits[i].double(), 0)[subs[i]])) for i in range(4)) / 4
    assert float(ngram_nll(logits, subs)) == pytest.approx(naive, rel=1e-6)
    weights = torch.tensor([0.5, 0.1, 1.0, 0.2])
    naive_w = sum(
        float(weights[i]) * -math.log(float(torch.softmax(logits[i].double(), 0)[subs[i]])) for i in range(4)
    ) / float(weights.sum())
    assert float(ngram_nll(logits, subs, weights)) == pytest.approx(naive_w, rel=1e-6)
    group, target_logp = torch.tensor([0, 0, 1, 1]), torch.tensor([-1.0, -2.0])
    terms = []
    for gidx in range(2):
        lq = sum(
            math.log(float(torch.softmax(logits[i].double(), 0)[subs[i]]))
            for i in range(4)
            if int(group[i]) == gidx
        )
        terms.append(math.exp(lq) * (lq - float(target_logp[gidx])))
    assert float(ngram_approx_kl(logits, subs, group, target_logp)) == pytest.approx(sum(terms) / 2, rel=1e-5)


def test_gradients_reach_the_drafter_logits_only_through_shared_tokens():
    t2d = torch.tensor([0, -1, 2])
    logits = torch.zeros(1, 3, requires_grad=True)
    direct_kl(logits, torch.tensor([[0, 1]]), torch.log(torch.tensor([[0.6, 0.3]])), t2d).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_position_weights_follow_evospec_and_check_inputs():
    w = position_weights(torch.tensor([1, 2, 3]), beta=0.1, length=4)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.4), math.exp(-0.8)]))
    with pytest.raises(ValueError, match="beta >= 0"):
        position_weights(torch.tensor([1]), beta=-1, length=4)
