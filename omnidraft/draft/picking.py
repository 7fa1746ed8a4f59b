"""`Draft` (what one `propose` returns) and the pure functions that pick a drafted token (`pick`,
`restrict`, `confidence`, `heal_pick`): no model and no tokenizer here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Adaptable", "Draft", "NO_DRAFT", "confidence", "heal_pick", "pick", "restrict"]


@dataclass(frozen=True)
class Draft:
    """Drafted ids (K,) and, when sampling, the distributions they were drawn from: q (K, Vd).
    `healed`: the first id replaces the context's last token (token healing, translate/healing.py),
    so the draft's bytes begin with that token's, which were already committed."""

    ids: list[int]
    q: torch.Tensor | None = None
    healed: bool = False


NO_DRAFT = Draft([])  # a round that does not speculate: the target decodes one token alone


@runtime_checkable
class Adaptable(Protocol):
    """A drafter that carries LoRA adapters, one per (target, user) pairing, and can learn: the
    `TorchDrafter`. An exported graph drafts with the adapter it was exported with."""

    lock: Any
    trainable: Any

    def adapter_name(self, target: str, user: str | None) -> str: ...

    def add_adapter(
        self, name: str, config: Any = None, state: dict[str, torch.Tensor] | None = None
    ) -> None: ...

    def activate(self, name: str | None) -> None: ...


def restrict(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """logits (Vd,) with every token outside `mask` (Vd,) bool at -inf; unchanged for None."""
    return logits if mask is None else logits.masked_fill(~mask, float("-inf"))


def confidence(logits: torch.Tensor, token: int, probs: torch.Tensor | None) -> float:
    """Drafter probability of the token it just drafted."""
    return float(probs[token] if probs is not None else torch.softmax(logits.float(), -1)[token])


def pick(
    logits: torch.Tensor, temperature: float, allowed: torch.Tensor | None, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """One token from logits (Vd,): argmax at temperature 0, else a sample and its distribution."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if temperature == 0:
        return int(logits.argmax()), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator)), probs


def heal_pick(
    logits: torch.Tensor,
    heal: torch.Tensor,
    held: int,
    temperature: float,
    allowed: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, int, torch.Tensor | None] | None:
    """Token healing's choice at the position of the context's last token `held`, from the logits
    (Vd,) one position back: (those logits restricted to `heal`, token, probs) when a longer token
    replaces `held`, None when the drafter keeps it. Also None when `held` has no logit there (-inf:
    outside a shortlisted or pruned head's support): with nothing to compare, any candidate in the
    support would win by default, or token 0 when none is (translate/healing.py)."""
    if not bool(torch.isfinite(logits[held])):
        return None
    back = restrict(logits, heal)
    token, probs = pick(back, temperature, allowed, generator)
    return None if token == held else (back, token, probs)
