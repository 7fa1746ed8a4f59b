"""A pairing's retrieval side: when a round retrieves instead of drafting with the model, how far a
model draft runs on into a retrieved continuation, and what each source's history says.

The decision is the cost policy's, extended: a retrieved draft of m tokens commits E(m) tokens
(from the source's acceptance at that match length) in `other + V(m + 1)` seconds; it is used when
that rate beats the model draft's best and the target alone's (see adaptive/policy.py). Until the
pairing has measured its verification costs, a match of at least `min_match` tokens retrieves.
With model drafts beside it, a shorter match never retrieves: there a model draft, run on into the
source where its end matches, commits more a second (docs/retrieval.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..translate.translator import Proposal
from .datastore import Datastore
from .retriever import Candidate, ContextIndex, RetrievalConfig, RetrievalStats

__all__ = ["Retriever", "Used"]


@dataclass(frozen=True)
class Used:
    """A candidate a round proposed `length` tokens of, after `after` model tokens."""

    candidate: Candidate
    length: int
    after: int = 0


class Retriever:
    """Per pairing (shared by its requests): acceptance history by source, and the user's datastore
    (`history`, None without a user profile). `model=False`: no model drafts to compare against
    (retrieval only); a round either retrieves or lets the target decode one token."""

    def __init__(self, config: RetrievalConfig, history: Datastore | None = None, *, model: bool = True) -> None:
        self.config, self.history, self.model = config, history, model
        self.stats = RetrievalStats(config)

    @classmethod
    def for_user(cls, config: RetrievalConfig, user: str | None, saved: dict[str, Any] | None, fingerprint: str, *,
                 model: bool = True) -> Retriever:
        """A pairing's retriever: with a `user`, their past outputs are drafts too, kept in their
        profile (`saved`: its datastore document; `fingerprint`: the target tokenizer's)."""
        history = None
        if user is not None:
            history = (Datastore.from_doc(saved, where=f"profile of {user!r}", fingerprint=fingerprint)
                       if saved is not None else Datastore(fingerprint=fingerprint))
        return cls(config, history, model=model)

    def begin(self, prompt_ids: list[int]) -> ContextIndex:
        """A request's index (and its acceptance history moved back toward the priors)."""
        self.stats.refresh()
        return ContextIndex(prompt_ids, self.history)

    def plan(self, index: ContextIndex, cost: Any, rates: dict[int, float], room: int, *,
             drafting: bool = True) -> Used | None:
        """Whether this round retrieves (and what), given the model policy's `rates` (tokens per
        second by draft length, 0 = target alone; empty before they are measured) and `room`
        tokens the request may still propose. `drafting=False`: no model draft this round."""
        if room < 1:
            return None
        candidates = index.candidates(min(room, self.config.max_len))
        if self.model and drafting:  # a short match is left to the model draft, which a source may extend
            candidates = [c for c in candidates if c.match >= self.config.min_match]
        measured = len(getattr(cost, "verify", ())) >= 2 and (rates or not self.model)
        best = self.stats.best(candidates, cost if measured else None)
        if best is None:
            return None
        candidate, m, rate = best
        if measured:
            rival = max(rates.values()) if rates else 1.0 / (cost.other + cost.verify_cost(1))
            if rate <= rival and not (candidate.match >= self.config.min_match and self.stats.turned_down(candidate)):
                return None
        return Used(candidate, m)

    def extend(self, index: ContextIndex, proposal: Proposal, room: int) -> tuple[Proposal, Used | None]:
        """A model draft (in target ids) run on into what followed its end in a source, when that
        match is at least `min_match` tokens long (up to `room` tokens in all)."""
        free = min(room, self.config.max_len) - len(proposal)
        if not self.config.extend or len(proposal) == 0 or free < 1:
            return proposal, None
        candidates = index.candidates(free, ahead=proposal.ids.tolist())
        if not candidates or candidates[0].match < self.config.min_match:
            return proposal, None
        top = candidates[0]
        if self.stats.acceptance(top.source, top.match)[0] < self.config.prior / 2:  # this kind of match keeps failing
            return proposal, None
        return proposal.then(top.ids), Used(top, len(top.ids), after=len(proposal))

    def observe(self, used: Used | None, proposed: int, accepted: int) -> None:
        """The round's verdict: `accepted` of `proposed` target tokens. The retrieved part counts as
        tried only when every model token before it was accepted."""
        if used is None:
            return
        tried = min(used.length, proposed - used.after)
        if tried > 0 and accepted >= used.after:
            self.stats.observe(used.candidate.source, used.candidate.match, tried, accepted - used.after)

    def finish(self, output: list[int]) -> None:
        """A finished request: its output joins the user's datastore."""
        if self.history is not None and output:
            self.history.add(output)
