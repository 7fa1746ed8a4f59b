"""Retrieval drafts (ReSpec's "when, what and how", with SAM-Decoding's index), in target ids.

Per request, `ContextIndex` keeps a suffix automaton over the request's own target ids (prompt and
committed output) and follows the committed context on it and on the user's `Datastore`. Each
source offers one `Candidate`: what followed the first occurrence of the longest suffix of the
context found there. Per pairing, `RetrievalStats` keeps how each source's drafts fared by
match length, and `plan` turns candidates into a draft:

- **when**: retrieve where a candidate's expected committed tokens per second beat the model
  draft's (both from the pairing's measured costs); before costs are measured, where the match is
  at least `min_match` tokens long. A model draft may be extended by what follows it in a source.
- **what**: candidates are ranked by their own acceptance history (per source and match length).
- **how**: a retrieved token is verified like any other, so every lossless mode stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..adaptive.policy import committed, ema
from .automaton import Matcher, SuffixAutomaton
from .datastore import SEP, Datastore

__all__ = ["DRAFT_SOURCES", "Candidate", "ContextIndex", "RetrievalConfig", "RetrievalStats"]

DRAFT_SOURCES = ("hybrid", "model", "retrieval")


@dataclass(frozen=True, kw_only=True)
class RetrievalConfig:
    """`max_len`: longest retrieved draft. `min_match`: the match length from which a source is used
    before the pairing has measured its costs, and always beside model drafts.
    `prior`: first-token acceptance assumed for a one-token match with no history yet (a match of n
    tokens is assumed to miss n times less often).
    `decay`: of the acceptance averages. `extend`: let a model draft run on into a retrieved
    continuation when the draft's end matches a source. `probe_every`: a kind of match (source and
    length) the costs turned down this many rounds in a row is tried once anyway, so one that
    failed before is measured again (acceptance depends on the request). `defer_read`: beside model
    drafts, a request starts without them until its rounds have lost what reading its context
    costs the drafter (planner.ReadDeferral; docs/retrieval.md has what it measured); False: the
    drafter reads every prompt at once. `history_tokens`: the most tokens of a user's past outputs
    their profile keeps for retrieval (newest kept); 0 keeps none: no output text is stored."""

    max_len: int = 16
    min_match: int = 3
    prior: float = 0.5
    decay: float = 0.8
    extend: bool = True
    probe_every: int = 8
    defer_read: bool = True
    history_tokens: int = 32_768

    def __post_init__(self) -> None:
        if (
            not isinstance(self.history_tokens, int)
            or isinstance(self.history_tokens, bool)
            or self.history_tokens < 0
        ):
            raise ValueError(
                "retrieval history_tokens must be an integer >= 0 (0: keep none), got "
                f"{self.history_tokens!r}"
            )
        if not isinstance(self.max_len, int) or self.max_len < 1:
            raise ValueError(f"retrieval max_len must be an integer >= 1, got {self.max_len!r}")
        if not isinstance(self.min_match, int) or self.min_match < 1:
            raise ValueError(f"retrieval min_match must be an integer >= 1, got {self.min_match!r}")
        if not isinstance(self.probe_every, int) or self.probe_every < 1:
            raise ValueError(f"retrieval probe_every must be an integer >= 1, got {self.probe_every!r}")
        if not 0.0 <= self.prior < 1.0 or not 0.0 <= self.decay < 1.0:
            raise ValueError(
                f"retrieval prior and decay must be in [0, 1), got {self.prior} and {self.decay}"
            )


@dataclass(frozen=True)
class Candidate:
    """A retrieved continuation: `ids` (target ids), from `source` ("context" or "history"),
    after a match of `match` tokens."""

    ids: list[int]
    source: str
    match: int


class ContextIndex:
    """One request's retrieval state: the request's automaton, its matcher, and a matcher on the
    user's datastore. `commit` costs O(1) amortised per token."""

    def __init__(self, prompt_ids: list[int], store: Datastore | None = None) -> None:
        self.sam = SuffixAutomaton()
        self.here = Matcher()
        self.store = store if store is not None and len(store) else None
        self.there = Matcher()
        self.commit(prompt_ids)

    def commit(self, ids: list[int]) -> None:
        for token in ids:
            self.here = self.here.advance(self.sam, token)  # matched before the token joins the text
            self.sam.extend(token)
            if self.store is not None:
                self.there = self.there.advance(self.store.sam, token)

    def candidates(self, n: int, ahead: Sequence[int] = ()) -> list[Candidate]:
        """Each source's continuation (up to n tokens) of the committed context followed by the
        uncommitted `ahead` (a model draft), longest match first."""
        here, there = self.here, self.there
        for token in ahead:
            here = here.advance(self.sam, token)
            if self.store is not None:
                there = there.advance(self.store.sam, token)
        out = []
        if here.length:
            out.append(Candidate(here.continuation(self.sam, n), "context", here.length))
        if self.store is not None and there.length:
            out.append(Candidate(there.continuation(self.store.sam, n, stop=SEP), "history", there.length))
        return sorted((c for c in out if c.ids), key=lambda c: -c.match)


BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)  # match lengths whose acceptance is tracked apart


def bucket(match: int) -> int:
    return max(i for i, b in enumerate(BUCKETS) if match >= b)


class RetrievalStats:
    """How retrieved drafts fare, by (source, match-length bucket). A copy is mostly all or nothing:
    either the context goes on as it went before or it does not from the first token on. So two
    moving averages per key: `first`, how often the first retrieved token is accepted, and `then`,
    the per-token acceptance after it (accepted tokens over trials, a rejection ending a trial)."""

    def __init__(self, config: RetrievalConfig) -> None:
        self.config = config
        self.first: dict[tuple[str, int], float] = {}
        self.kept: dict[tuple[str, int], float] = {}  # tokens accepted after the first
        self.trials: dict[tuple[str, int], float] = {}  # and their trials
        self.waiting: dict[tuple[str, int], int] = {}  # rounds turned down since the last trial

    def _prior(self, key: tuple[str, int]) -> float:
        return 1.0 - (1.0 - self.config.prior) / BUCKETS[key[1]]

    def refresh(self) -> None:
        """A new request: acceptance depends on the request, so each first-token average moves
        halfway back to its prior."""
        for key, value in self.first.items():
            self.first[key] = 0.5 * (value + self._prior(key))

    def turned_down(self, candidate: Candidate) -> bool:
        """The costs turned this candidate down; True when its kind is due for a probe anyway."""
        key = (candidate.source, bucket(candidate.match))
        self.waiting[key] = self.waiting.get(key, 0) + 1
        return self.waiting[key] >= self.config.probe_every

    def _ema(self, table: dict[tuple[str, int], float], key: tuple[str, int], value: float) -> None:
        table[key] = ema(table.get(key), value, self.config.decay)

    def acceptance(self, source: str, match: int) -> tuple[float, float]:
        """(first-token acceptance, per-token acceptance after it) of a candidate."""
        key = (source, bucket(match))
        prior = self._prior(key)  # with no history, a longer match is taken as likelier to go on as before
        first = self.first.get(key, prior)
        then = min(0.99, self.kept[key] / self.trials[key]) if self.trials.get(key) else max(prior, 0.8)
        return first, then

    def observe(self, source: str, match: int, proposed: int, accepted: int) -> None:
        if proposed < 1:
            return
        key = (source, bucket(match))
        self.waiting[key] = 0
        self._ema(self.first, key, float(accepted > 0))
        if accepted > 0 and proposed > 1:
            self._ema(self.kept, key, accepted - 1)
            self._ema(self.trials, key, accepted - 1 + (accepted < proposed))

    def expected(self, candidate: Candidate, m: int) -> float:
        """Committed tokens of a round that proposes the candidate's first m tokens."""
        return committed(*self.acceptance(candidate.source, candidate.match), m)

    def best(self, candidates: list[Candidate], cost: Any | None) -> tuple[Candidate, int, float] | None:
        """The candidate and length of highest expected tokens per second (`cost`: the pairing's
        CostModel, ready), or by the rule (longest match of at least `min_match`, whole) without
        one; None when no candidate qualifies. The rate is None-free: 0.0 without costs."""
        if not candidates:
            return None
        if cost is None:
            top = candidates[0]
            if top.match < self.config.min_match:
                return None
            return top, min(len(top.ids), self.config.max_len), 0.0
        best: tuple[Candidate, int, float] | None = None
        for c in candidates:
            for m in range(1, min(len(c.ids), self.config.max_len) + 1):
                rate = self.expected(c, m) / (cost.other + cost.verify_cost(m + 1))
                if best is None or rate > best[2]:
                    best = (c, m, rate)
        return best
