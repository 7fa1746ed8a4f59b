"""The drafting loop, once for every backend.

A backend gives a `Stream`: one token sequence on its model, fed lazily, cropped back, read as
next-token logits. `DraftSession` drafts on any stream: greedy or sampled picks, the restriction to
the vocabulary the target shares, token healing, the stop tests (stop token, low confidence, an
acceptance head's rule), the rollback to what the target accepted, and a shortlisted head's
bookkeeping. PyTorch (and its int8 form), ONNX Runtime and llama.cpp are each a short `Stream`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .picking import Draft, confidence, heal_pick, pick

if TYPE_CHECKING:
    from ..adaptive.acceptance_head import Stopper

__all__ = ["DraftSession", "Stream"]


class Stream(Protocol):
    """One token sequence on a drafting model: the interface a drafting backend implements.

    `ids` is the sequence; tokens appended with `extend` are fed at the next `logits` call, which
    returns fp32 CPU logits (rows, V) of the last `rows` positions (re-feeding cached ones as needed)
    and, with `hidden`, the last layer's hidden states (rows, d) there. `gives_hidden` says whether
    the backend has hidden states at all."""

    ids: list[int]
    gives_hidden: bool

    def extend(self, ids: list[int]) -> None: ...

    def crop(self, n: int) -> None: ...

    def logits(self, rows: int = 1, *, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class DraftSession:
    """One generation on a drafter: `propose(k)` drafts up to k tokens after the committed text,
    `commit(keep, tail)` rolls back to what the target accepted and appends what it added."""

    def __init__(
        self,
        stream: Stream,
        stop_ids: frozenset[int],
        lock: threading.RLock,
        head: Any = None,
        *,
        backend: str = "this drafter",
    ) -> None:
        self.stream, self.stop_ids, self.lock = stream, stop_ids, lock
        self.head = head  # a shortlisted LM head: told the draft position, and what the context holds
        self.backend = backend
        self._base = len(stream.ids)
        if head is not None:
            head.policy.begin(list(stream.ids))

    @property
    def ids(self) -> list[int]:
        return self.stream.ids

    def propose(
        self,
        k: int,
        *,
        temperature: float = 0.0,
        allowed: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        stop_confidence: float = 0.0,
        stopper: Stopper | None = None,
        heal: torch.Tensor | None = None,
        more: bool = False,
    ) -> Draft:
        """Draft up to k tokens; `allowed` (Vd,) bool restricts sampling to those tokens. `more`:
        draft on after the last draft instead of after the committed text (a device drafting ahead
        while a server verifies; `commit` then counts from the first draft's start). `heal`
        (Vd,) bool: the tokens that may replace the context's last token (token healing): when the
        drafter prefers another of them at that position, the draft starts with it (`Draft.healed`).
        Drafting stops after a stop token, after a token the drafter gave less than `stop_confidence`
        probability (the next step would most likely be wasted), or when `stopper` (an acceptance
        head's rule, fed each token's hidden state) says so."""
        if k < 1:
            raise ValueError(f"draft length k must be >= 1, got {k}")
        if stopper is not None and not self.stream.gives_hidden:
            raise ValueError(
                f"{self.backend} gives no hidden states: an acceptance head needs the PyTorch drafter"
            )
        with self.lock:  # an optimizer step in another thread waits for the draft, and vice versa
            if not more:
                self._base = len(self.stream.ids)
            return self._propose(
                k, temperature, allowed, generator, stop_confidence, stopper, None if more else heal
            )

    def _propose(
        self,
        k: int,
        temperature: float,
        allowed: torch.Tensor | None,
        generator: torch.Generator | None,
        stop_confidence: float,
        stopper: Stopper | None,
        heal: torch.Tensor | None,
    ) -> Draft:
        stream, hidden = self.stream, stopper is not None
        ids, rows, healed = [], [], False
        for step in range(k):
            if self.head is not None:
                self.head.step = step
            if step == 0 and heal is not None and len(stream.ids) > 1:
                logits, state, token, probs, healed = self._heal_step(
                    heal, temperature, allowed, generator, hidden
                )
            else:
                last, states = stream.logits(1, hidden=hidden)
                logits, state = last[0], states[0] if states is not None else None
                token, probs = pick(logits, temperature, allowed, generator)
            ids.append(token)
            if probs is not None:
                rows.append(probs)
            stream.extend([token])
            halt = stopper is not None and stopper.stop_after(step, token, logits, state)
            if (
                halt
                or token in self.stop_ids
                or (stop_confidence > 0 and confidence(logits, token, probs) < stop_confidence)
            ):
                break
        return Draft(ids, torch.stack(rows) if rows else None, healed)

    def _heal_step(
        self,
        heal: torch.Tensor,
        temperature: float,
        allowed: torch.Tensor | None,
        generator: torch.Generator | None,
        hidden: bool,
    ) -> tuple[torch.Tensor, Any, int, torch.Tensor | None, bool]:
        """Step 0 under token healing, from the logits at the context's last two positions:
        (logits, hidden state, token, probs, healed) of the first drafted token."""
        both, states = self.stream.logits(2, hidden=hidden)
        chosen = heal_pick(both[0], heal, self.stream.ids[-1], temperature, allowed, generator)
        if chosen is None:  # the drafter keeps its last token: draft after it, as usual
            token, probs = pick(both[1], temperature, allowed, generator)
            return both[1], states[1] if states is not None else None, token, probs, False
        self.stream.crop(len(self.stream.ids) - 1)  # a longer token replaces it
        self._base -= 1
        back, token, probs = chosen
        return back, states[0] if states is not None else None, token, probs, True

    def commit(self, keep: int, tail: list[int]) -> None:
        """Keep the first `keep` drafted tokens, then append `tail` (fed at the next propose)."""
        self.stream.crop(self._base + keep)
        self.stream.extend(tail)
        self._base = len(self.stream.ids)
        if self.head is not None and tail:
            self.head.policy.observe(tail)  # committed text the draft missed (an EvoSpec buffer recalls it)
