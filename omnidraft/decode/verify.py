"""Acceptance maths of speculative decoding, as pure tensor functions.

Each function takes the target's scores at the M+1 verified positions and the M proposed target
ids, and returns an immutable `Verdict`: how many proposals were accepted and the one token the
target emits after them (a correction, or a bonus token when all M were accepted). No models, no
tokenizers, no per-token Python loops. Shapes: M proposed tokens, Vt target vocabulary.

| rule      | accepted while ...                                   | lossless |
|-----------|------------------------------------------------------|----------|
| greedy    | proposal == argmax p                                  | yes      |
| match     | proposal == a sample from p                          | yes      |
| rejection | u < p(t)/q'(t); then resample norm(max(0, p - q'))   | yes if the proposals were drawn from q' |
| relaxed   | greedy, or a retrieved token in p's top r whose next token is p's argmax | **no** (lossy) |

`rejection` is exact when each proposed token was sampled from the row of `q` given for it (the
`exact` mode: drafter sampling restricted to the shared vocabulary). With OmniDraft's n-gram rows
(eq. 1-2) the drafter did not sample from q' itself, so the result is an approximation of the
target distribution: the `omnidraft` mode documents that.

Where an engine verified a proposal itself, `accepted_prefix` reads how much of it was accepted
from the ids it committed (plain ints: a device's and a server's side use it too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

__all__ = ["Verdict", "accepted_prefix", "argmax", "greedy", "match", "probabilities", "rejection", "relaxed"]


@dataclass(frozen=True)
class Verdict:
    """`accepted` of the proposals were accepted; `token` is what the target emits next.
    `topk`, when the caller asked for it, is the target's (ids, log-probs), each (accepted + 1, K):
    row i is its distribution over the i-th committed token (what distillation learns from);
    `chosen` (accepted + 1,), where the target computed it, the log-prob of each committed token."""

    accepted: int
    token: int
    topk: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False, repr=False)
    chosen: torch.Tensor | None = field(default=None, compare=False, repr=False)


def accepted_prefix(proposed: Sequence[int], committed: Sequence[int]) -> int:
    """How many of the `proposed` ids were accepted, where a target committed `committed` after
    the same context: the length of their common prefix (the engine's own token ends it)."""
    n = min(len(proposed), len(committed))
    return next((j for j in range(n) if proposed[j] != committed[j]), n)


def probabilities(
    logits: torch.Tensor, temperature: float, *, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Softmax of `logits` (..., V) at `temperature` > 0, in float32, then (when set) restricted
    to tokens with at least `min_p` times the top probability, to the `top_k` most probable, and
    to the smallest most-probable set holding `top_p` of the mass (never less than the most
    probable token), and renormalised."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_k <= 0 and top_p >= 1.0 and min_p <= 0.0:
        return probs
    keep = torch.ones_like(probs, dtype=torch.bool)
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max(dim=-1, keepdim=True).values
    if 0 < top_k < probs.shape[-1]:
        keep &= probs >= probs.topk(top_k, dim=-1).values[..., -1:]
    if top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # mass of the more probable tokens
        nucleus = before < top_p
        nucleus[..., 0] = True  # the most probable token stays, however small top_p is
        keep &= torch.zeros_like(keep).scatter(-1, order, nucleus)
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)


def _first_false(ok: torch.Tensor) -> int:
    """Index of the first False in a (M,) bool tensor, or M if all are True."""
    return int(ok.long().cumprod(0).sum())


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of `logits` (..., Vt). fp32 rows on the CPU go through numpy, on the
    calling thread: torch's would wake its thread pool, whose spinning threads then slow an engine
    that runs its own (llama.cpp, OpenVINO) on the same cores (docs/llamacpp.md)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(np.asarray(np.argmax(logits.numpy(), axis=-1)))
    return logits.argmax(dim=-1)


def greedy(logits: torch.Tensor, proposal: torch.Tensor) -> Verdict:
    """Greedy verification. logits (M+1, Vt), proposal (M,) int64."""
    best = argmax(logits)
    n = _first_false(best[:-1] == proposal)
    return Verdict(n, int(best[n]))


def match(
    probs: torch.Tensor,
    proposal: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    keys: list[tuple[int, int]] | None = None,
) -> Verdict:
    """`match` sampling: sample every position from p (M+1, Vt); accept while the sample equals the proposal.

    Lossless for any proposal: the emitted tokens are the target's own samples. `keys` (seed,
    position), one per row: each row is drawn from its own generator seeded by its key, so a
    position's sample does not depend on how many draws came before it.
    """
    if keys is not None:
        samples = torch.stack(
            [
                torch.multinomial(
                    row, 1, generator=torch.Generator().manual_seed((seed * 1_000_003 + position) % 2**63)
                )
                for row, (seed, position) in zip(probs, keys)
            ]
        ).squeeze(1)
    else:
        samples = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    n = _first_false(samples[:-1] == proposal)
    return Verdict(n, int(samples[n]))


def rejection(
    probs: torch.Tensor, q: torch.Tensor, proposal: torch.Tensor, generator: torch.Generator | None = None
) -> Verdict:
    """Speculative rejection sampling (Leviathan et al. 2023; OmniDraft §3.1).

    probs (M+1, Vt) target distribution; q (M, Vt) the draft distribution each proposal was drawn
    from, in target space; proposal (M,). Accept t_i with probability min(1, p(t_i)/q'(t_i)); at the
    first rejection emit a sample of norm(max(0, p - q')); if all are accepted, a sample of p[M].
    """
    m = proposal.shape[0]
    rows = torch.arange(m)
    p_t, q_t = probs[rows, proposal], q[rows, proposal]
    u = torch.rand(m, generator=generator, dtype=probs.dtype)
    ratio = torch.where(q_t > 0, p_t / q_t.clamp_min(1e-30), torch.zeros_like(p_t))
    n = _first_false(u < ratio)
    if n == m:
        residual = probs[m]
    else:
        residual = (probs[n] - q[n]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q' on this row: any sample of p is right
            residual = probs[n]
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return Verdict(n, int(token))


def relaxed(logits: torch.Tensor, proposal: torch.Tensor, relax: torch.Tensor, top_r: int) -> Verdict:
    """LOSSY: ReSpec's source-aware relaxed verification; the output may differ from the target's
    greedy output. logits (M+1, Vt), proposal (M,), relax (M,) bool: the proposals that may be
    accepted without being the argmax (retrieved ones). Such a token is accepted when it is among
    the target's top `top_r` and the target's argmax at the next position is the next proposal (the
    target carries the copied text on); every other token is verified greedily."""
    best = logits.argmax(dim=-1)
    strict = best[:-1] == proposal
    m = int(proposal.shape[0])
    if m == 0:
        return Verdict(0, int(best[0]))
    rows = logits[:-1].float()
    kth = rows.topk(min(top_r, rows.shape[-1]), dim=-1).values[:, -1]
    in_top = rows.gather(1, proposal[:, None]).squeeze(1) >= kth
    ahead = torch.cat([strict[1:], torch.zeros(1, dtype=torch.bool)])
    n = _first_false(strict | (relax & in_top & ahead))
    return Verdict(n, int(best[n]))
