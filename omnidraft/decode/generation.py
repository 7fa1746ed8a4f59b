"""What a request returns (`Generation`, with per-token `TokenLogprob`s where asked) and a
finished request as distillation input (`verified`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .stats import GenerationStats, RoundRecord

__all__ = ["Generation", "TokenLogprob", "token_logprobs", "verified"]


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one generated token (None where the target did not give
    it: a remote or vLLM target sampling a token outside its top rows) and its `top` alternatives
    {token id: log-prob}, from the target's own distribution (temperature 1, no filtering)."""

    token: int
    logprob: float | None
    top: dict[int, float]


@dataclass(frozen=True)
class Generation:
    """Result of `Pairing.generate`: the text, the target token ids generated, stats and rounds;
    with `logprobs=N` asked for, one TokenLogprob per generated token (else None)."""

    text: str
    token_ids: list[int]
    stats: GenerationStats
    rounds: list[RoundRecord]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None


def token_logprobs(out: list[int], rows: list, n: int) -> list[TokenLogprob]:
    """Per generated token: its log-prob and the top `n` alternatives, from the rounds' rows; a
    token no row covers (the target decoded it alone, a server's budget) gets None and {}."""
    found: list[TokenLogprob] = []
    for ids, logp, chosen in rows:
        for i in range(len(ids)):
            if len(found) == len(out):
                break
            top = dict(zip(ids[i, :n].tolist(), logp[i, :n].tolist()))
            token = out[len(found)]
            exact = float(chosen[i]) if chosen is not None else top.get(token)
            found.append(TokenLogprob(token, exact, top))
    return found + [TokenLogprob(t, None, {}) for t in out[len(found) :]]


def verified(prompt: str, out: list[int], rounds: list[RoundRecord], rows: list, width: int) -> Any:
    """A finished request as distillation input (committed tokens with the target's top `width` rows)."""
    from ..distill.buffer import VerifiedRequest

    ids, logp = (torch.cat([row[part] for row in rows])[: len(out), :width] for part in (0, 1))
    positions = [j + 1 for r in rounds for j in range(r.emitted)][: len(out)]
    return VerifiedRequest(prompt, out, ids, logp, positions)
