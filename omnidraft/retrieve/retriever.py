"""A pairing's retrieval side: when a round retrieves instead of drafting with the model, how far a
model draft runs on into a retrieved continuation, and what each source's history says.

The decision is the cost policy's, extended: a retrieved draft of m tokens commits E(m) tokens
(from the source's acceptance at that match length) in `other + V(m + 1)` seconds; it is used when
that rate beats the model draft's best and the target alone's (see adaptive/policy.py). Until the
pairing has measured its verification costs, a match of at least `min_match` tokens retrieves.
With model drafts beside it, a shorter match never retrieves: there a model draft, run on into the
source where its end matches, commits more a second (docs/retrieval.md). A request's drafter reads
its context only once a model draft is worth that read (`ReadDeferral`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..adaptive.policy import ema
from ..translate.translator import Proposal
from .datastore import Datastore
from .index import Candidate, ContextIndex, RetrievalConfig, RetrievalStats

__all__ = ["NO_READ", "ReadDeferral", "PromptRead", "Retriever", "Used"]


@dataclass(frozen=True)
class Used:
    """A candidate a round proposed `length` tokens of, after `after` model tokens."""

    candidate: Candidate
    length: int
    after: int = 0


class ReadDeferral:
    """Whether a request's drafter may leave its context unread while retrieval serves it.

    A drafter reads the request's context (the prompt, and whatever was committed since) before its
    first draft; on a long prompt where retrieval copies most of the output, that read costs more
    than the model's drafts win back. So a request with a retrieval index may start without model
    drafts (rounds that retrieve, or let the target decode one token) until those rounds have lost,
    against committing the same tokens at the model's measured rate (the cost policy's best), as
    much time as the read costs (measured per context token at each request's first draft); a
    round that beat the model's rate is credited. Deferring until the time lost equals the read's
    cost costs at most twice the better choice made in hindsight (the ski-rental argument). One
    per pairing; `begin` gives a request its own `PromptRead`, so concurrent requests share only
    the read cost. On by default (`RetrievalConfig.defer_read`): docs/retrieval.md has what it
    measured.
    """

    def __init__(self, decay: float = 0.7) -> None:
        self.decay = decay
        self.per_token: float | None = None  # seconds the drafter takes to read one context token

    def begin(self, context: int) -> PromptRead:
        """A request whose drafter has `context` tokens (counted in target ids) to read."""
        return PromptRead(self, context)


@dataclass
class PromptRead:
    """One request's side of `ReadDeferral`."""

    owner: ReadDeferral
    unread: int  # the prompt's length; 0 once the request drafted (or for NO_READ)
    regret: float = 0.0  # seconds its rounds without the model lost against model drafts so far
    rates: dict[int, float] = field(default_factory=dict)  # the cost policy's, when `defer` last asked

    def defer(self, rates: dict[int, float], produced: int) -> bool:
        """Whether this round leaves the model out, by the cost policy's `rates` (committed tokens a
        second by draft length, 0: the target alone) with `produced` tokens committed so far."""
        if not self.unread or self.owner.per_token is None or 0 not in rates:
            return False
        self.rates = rates
        return self.regret < self.owner.per_token * (self.unread + produced)

    def settle(
        self,
        deferred: bool,
        committed: int,
        seconds: float | None,
        drafted: int,
        draft_s: float,
        step: float | None,
        produced: int,
    ) -> None:
        """A finished round that committed `committed` tokens in `seconds` (None: the request's first
        round, which also reads the prompt into the target): deferred, or one that `drafted`
        tokens in `draft_s` at a measured `step` per drafted token, after `produced` tokens."""
        if deferred:
            best = max((v for k, v in self.rates.items() if k > 0), default=0.0)
            if seconds is not None and best > 0:
                self.regret = max(0.0, self.regret + seconds - committed / best)
            return
        if self.unread and drafted:  # the request's first draft read its context first
            read = max(0.0, draft_s - drafted * (step or 0.0)) / (self.unread + produced)
            old = self.owner.per_token  # down at once, up slowly: a first call's warm-up is not the cost
            self.owner.per_token = read if old is None or read < old else ema(old, read, self.owner.decay)
            self.unread = 0


NO_READ = PromptRead(ReadDeferral(), 0)  # a request with nothing to defer: never defers, never measures


class Retriever:
    """Per pairing (shared by its requests): acceptance history by source, and the user's datastore
    (`history`, None without a user profile). `model=False`: no model drafts to compare against
    (retrieval only); a round either retrieves or lets the target decode one token."""

    def __init__(
        self, config: RetrievalConfig, history: Datastore | None = None, *, model: bool = True
    ) -> None:
        self.config, self.history, self.model = config, history, model
        self.stats = RetrievalStats(config)
        self.deferral = ReadDeferral() if model and config.defer_read else None

    @classmethod
    def for_user(
        cls,
        config: RetrievalConfig,
        user: str | None,
        saved: dict[str, Any] | None,
        fingerprint: str,
        *,
        model: bool = True,
    ) -> Retriever:
        """A pairing's retriever: with a `user`, their past outputs are drafts too, kept in their
        profile (`saved`: its datastore document; `fingerprint`: the target tokenizer's)."""
        history = None
        if user is not None and config.history_tokens > 0:  # 0: the user's outputs are never kept
            history = Datastore(config.history_tokens, fingerprint=fingerprint)
            if saved is not None:  # what the profile kept, within this config's retention
                for doc in Datastore.from_doc(
                    saved, where=f"profile of {user!r}", fingerprint=fingerprint
                ).docs:
                    history.add(list(doc))
        return cls(config, history, model=model)

    def begin(self, prompt_ids: list[int]) -> ContextIndex:
        """A request's index (and its acceptance history moved back toward the priors)."""
        self.stats.refresh()
        return ContextIndex(prompt_ids, self.history)

    def plan(
        self, index: ContextIndex, cost: Any, rates: dict[int, float], limit: int, *, drafting: bool = True
    ) -> Used | None:
        """Whether this round retrieves (and what), given the model policy's `rates` (tokens per
        second by draft length, 0 = target alone; empty before they are measured) and `limit`
        tokens the request may still propose. `drafting=False`: no model draft this round (the cost
        policy chose none, or the drafter's read is deferred), so a retrieved draft competes with a
        round of the target alone."""
        if limit < 1:
            return None
        candidates = index.candidates(min(limit, self.config.max_len))
        if self.model and drafting:  # a short match is left to the model draft, which a source may extend
            candidates = [c for c in candidates if c.match >= self.config.min_match]
        measured = len(getattr(cost, "verify", ())) >= 2 and (rates or not self.model)
        best = self.stats.best(candidates, cost if measured else None)
        if best is None:
            return None
        candidate, m, rate = best
        if measured:
            alone = rates.get(0) or 1.0 / (cost.other + cost.verify_cost(1))  # a round without a draft
            rival = (
                max(rates.values()) if rates and drafting else alone
            )  # no model draft this round: a plain one
            if rate <= rival and not (
                candidate.match >= self.config.min_match and self.stats.turned_down(candidate)
            ):
                return None
        return Used(candidate, m)

    def extend(self, index: ContextIndex, proposal: Proposal, limit: int) -> tuple[Proposal, Used | None]:
        """A model draft (in target ids) run on into what followed its end in a source, when that
        match is at least `min_match` tokens long (up to `limit` tokens in all)."""
        free = min(limit, self.config.max_len) - len(proposal)
        if not self.config.extend or len(proposal) == 0 or free < 1:
            return proposal, None
        candidates = index.candidates(free, ahead=proposal.ids.tolist())
        if not candidates or candidates[0].match < self.config.min_match:
            return proposal, None
        top = candidates[0]
        if (
            self.stats.acceptance(top.source, top.match)[0] < self.config.prior / 2
        ):  # this kind of match keeps failing
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
