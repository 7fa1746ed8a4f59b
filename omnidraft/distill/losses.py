"""OmniDraft's hybrid distillation loss, eq. (3)-(4), as pure tensor functions.

L = KL over direct-mapped positions + lambda * NLL over the drafter sub-tokens of accepted n-gram
tokens. The KL is the reverse KL D_KL(q'_theta || p) in target space over the shared vocabulary,
from the target's top-k log-probabilities plus one remainder bucket, so a remote target never
ships full 150k-float rows. No models here: logits in, scalar losses out.
Shapes: N positions, K top-k entries, Vd drafter vocabulary, Vt target vocabulary.
"""

from __future__ import annotations

import torch

__all__ = ["direct_kl", "ngram_approx_kl", "ngram_nll", "position_weights"]

_EPS = 1e-12


def direct_kl(
    draft_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logp: torch.Tensor,
    t2d: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean reverse KL D_KL(q' || p) over N direct-mapped positions (OmniDraft eq. 3).

    draft_logits (N, Vd); topk_ids (N, K) target ids and topk_logp (N, K) their target
    log-probabilities; t2d (Vt,) drafter id of each target id or -1; weights (N,) optional.
    q'(t) = q(t2d[t]) on the top-k ids the drafter can spell (0 elsewhere); each side's mass
    outside the top-k forms one remainder bucket.
    """
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    d_ids = t2d[topk_ids]
    shared = d_ids >= 0
    logq_k = torch.where(shared, logq.gather(1, d_ids.clamp_min(0)), torch.full_like(topk_logp, -torch.inf))
    q_k = logq_k.exp()
    q_rest = (1 - q_k.sum(1)).clamp_min(_EPS)
    p_rest = (1 - topk_logp.float().exp().sum(1)).clamp_min(_EPS)
    terms = torch.where(shared, q_k * (logq_k - topk_logp.float()), torch.zeros_like(q_k)).sum(1)
    kl = terms + q_rest * (q_rest.log() - p_rest.log())
    return _mean(kl, weights)


def ngram_nll(
    draft_logits: torch.Tensor, sub_tokens: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean NLL of the drafter sub-tokens of accepted n-gram tokens (OmniDraft eq. 4).

    draft_logits (N, Vd) at each sub-token's position; sub_tokens (N,) drafter ids; weights (N,):
    1 for the fixed lambda (applied by the caller), or the target's p(t) for the dynamic weight.
    """
    nll = -torch.log_softmax(draft_logits.float(), dim=-1).gather(1, sub_tokens[:, None]).squeeze(1)
    return _mean(nll, weights)


def ngram_approx_kl(
    draft_logits: torch.Tensor, sub_tokens: torch.Tensor, group: torch.Tensor, target_logp: torch.Tensor
) -> torch.Tensor:
    """Approximate-KL variant for n-gram tokens: q'(t) (log q'(t) - log p(t)) with
    log q'(t) = sum_j log q(d_j) (eq. 1), averaged over G n-gram tokens.

    draft_logits (N, Vd), sub_tokens (N,), group (N,) index in [0, G) of each sub-token's n-gram
    token, target_logp (G,) the target's log p(t) of each n-gram token.
    """
    logq = torch.log_softmax(draft_logits.float(), dim=-1).gather(1, sub_tokens[:, None]).squeeze(1)
    logq_t = torch.zeros_like(target_logp, dtype=torch.float32).index_add(0, group, logq)
    return (logq_t.exp() * (logq_t - target_logp.float())).mean()


def position_weights(positions: torch.Tensor, beta: float, length: int) -> torch.Tensor:
    """EvoSpec position weights exp(-beta * L * (j - 1)) for 1-based draft positions j (N,)."""
    if beta < 0 or length < 1:
        raise ValueError(f"position weights need beta >= 0 and length >= 1, got beta={beta}, length={length}")
    return torch.exp(-beta * length * (positions.float() - 1))


def _mean(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return values.mean()
    return (values * weights).sum() / weights.sum().clamp_min(_EPS)
