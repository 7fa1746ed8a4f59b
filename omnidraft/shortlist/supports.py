"""The three shortlist policies (one mechanism: shortlisted_head.py's blocks).

- `Static` (FR-Spec): one block, the most frequent tokens of a corpus.
- `Evo` (EvoSpec): the static core plus a bounded dynamic buffer of tokens recalled from the
  request (its context tokens when it begins, every committed token the support missed) and from
  the requests before it (the user's history, its counts halved at each new request), evicted
  least-frequently-used with the running request's tokens kept first; the buffer's block is
  re-packed when its ids changed, at the next call.
- `Dyna` (DynaSpec): the head's rows outside a small core clustered (spherical k-means on the
  normalised rows), a linear router on the hidden state scores the clusters (build.py: by their
  centroids), and each call evaluates the core plus the top-scoring clusters: more of them at the
  first draft positions, fewer later.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from .shortlisted_head import Block

__all__ = ["Dyna", "Evo", "Static"]


class Static:
    """One fixed block."""

    def __init__(self, head: nn.Module | None, core: torch.Tensor) -> None:
        self.core = Block(head, core)

    def blocks(self, hidden: torch.Tensor, step: int) -> list[Block]:
        return [self.core]

    def begin(self, ids: list[int]) -> None:
        pass

    def observe(self, ids: list[int]) -> None:
        pass


class Evo:
    """The core plus a buffer of at most `capacity` ids outside it (LFU: the least seen leave first)."""

    def __init__(self, head: nn.Module | None, core: torch.Tensor, capacity: int = 2048) -> None:
        if capacity < 1:
            raise ValueError(f"the buffer capacity must be >= 1, got {capacity}")
        self.head, self.capacity = head, capacity
        self.core = Block(head, core)
        self._in_core = set(self.core.ids.tolist())
        self.counts: Counter[int] = Counter()
        self._request: set[int] = set()  # the running request's tokens outside the core
        self._block: Block | None = None
        self._dirty = False

    def begin(self, ids: list[int]) -> None:
        """A request: what earlier requests left ages (counts halve) and the request's context
        tokens are recalled ahead of it. Aged tokens leave only when the buffer is full, the least
        used first: a token each request uses once (a style word, "Let", " total") stays."""
        self.counts = Counter({t: c / 2 for t, c in self.counts.items()})
        self._request = set()
        self.observe(ids)

    def observe(self, ids: list[int]) -> None:
        """Tokens the request committed (or holds): those outside the core enter or stay in the
        buffer; past its capacity the least frequent leave, the running request's last."""
        outside = [t for t in ids if t not in self._in_core]
        if not outside:
            return
        before = set(self.counts)
        self.counts.update(outside)
        self._request.update(outside)
        if len(self.counts) > self.capacity:
            newest_first = list(self.counts)[::-1]  # ties: the token that entered last stays
            ranked = sorted(newest_first, key=lambda t: (t in self._request, self.counts[t]), reverse=True)
            for token in ranked[self.capacity :]:
                del self.counts[token]
        self._dirty |= set(self.counts) != before

    def blocks(self, hidden: torch.Tensor, step: int) -> list[Block]:
        if self._dirty:
            self._block = Block(self.head, torch.tensor(sorted(self.counts))) if self.counts else None
            self._dirty = False
        return [self.core] if self._block is None else [self.core, self._block]


class Dyna:
    """The core plus the router's top clusters: `budget[step]` of them at draft position `step`
    (the last entry for every later step)."""

    def __init__(
        self,
        head: nn.Module | None,
        core: torch.Tensor,
        clusters: list[torch.Tensor],
        router: nn.Linear,
        budget: tuple[int, ...] = (8, 6, 4),
    ) -> None:
        if not budget or min(budget) < 1:
            raise ValueError(f"budget must list positive cluster counts, got {budget}")
        self.core = Block(head, core)
        in_core = torch.zeros(int(max(int(c.max()) for c in clusters if len(c)) + 1), dtype=torch.bool)
        in_core[self.core.ids[self.core.ids < len(in_core)]] = True
        self.clusters = [Block(head, c[~in_core[c]]) if (~in_core[c]).any() else None for c in clusters]
        self.router, self.budget = router, budget

    def blocks(self, hidden: torch.Tensor, step: int) -> list[Block]:
        scores = self.router(hidden.reshape(-1, hidden.shape[-1])[-1].float())
        top = scores.topk(
            min(self.budget[min(step, len(self.budget) - 1)], len(self.clusters))
        ).indices.tolist()
        return [self.core] + [self.clusters[c] for c in top if self.clusters[c] is not None]

    def begin(self, ids: list[int]) -> None:
        pass

    def observe(self, ids: list[int]) -> None:
        pass
