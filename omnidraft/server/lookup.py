"""Prompt lookup on the server: when a streaming device has no proposal that continues the
committed text (its last one was rejected and the next is still on its way), the engine's step
may still verify a draft found in the session's own context, as vLLM's n-gram proposer does
(prompt lookup decoding, Saxena 2023): the tokens that followed the latest earlier occurrence of
the context's last `n` tokens. Its acceptance is measured per session, and where it stays low the
lookup is tried again only now and then (a wrong draft costs a slot in the step). Pure
bookkeeping over token ids: no model, no tokenizer.
"""

from __future__ import annotations

__all__ = ["PromptLookup"]


class PromptLookup:
    """One session's lookup over its committed ids (which only grow)."""

    def __init__(self, n: int = 3, floor: float = 0.25, retry_every: int = 16) -> None:
        if n < 1 or not 0 <= floor < 1 or retry_every < 1:
            raise ValueError(
                f"need n >= 1, 0 <= floor < 1, retry_every >= 1; got {n}, {floor}, {retry_every}"
            )
        self.n, self.floor, self.retry_every = n, floor, retry_every
        # n-gram -> where what followed its latest occurrence starts
        self._follows: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams indexed so far: those starting before this position
        self.accepted = self.proposed = 0.0  # decayed sums of the lookup's own drafts
        self._skipped = 0

    def propose(self, ids: list[int], limit: int) -> list[int]:
        """Up to `limit` ids that followed the latest earlier occurrence of `ids`' last n ids; []
        where there is none or the lookup measures too poor here (tried again every so often)."""
        n = self.n
        if limit <= 0 or len(ids) <= n:
            return []
        if self.proposed >= 4 and self.accepted / self.proposed < self.floor:
            self._skipped += 1
            if self._skipped % self.retry_every:
                return []
        for i in range(self._indexed, len(ids) - n):  # every n-gram with a token after it
            self._follows[tuple(ids[i : i + n])] = i + n
        self._indexed = max(self._indexed, len(ids) - n)
        at = self._follows.get(tuple(ids[-n:]))
        return list(ids[at : at + limit]) if at is not None else []

    def observe(self, proposed: int, accepted: int) -> None:
        """How one of its drafts fared."""
        if proposed > 0:
            self.accepted = 0.9 * self.accepted + accepted
            self.proposed = 0.9 * self.proposed + proposed
