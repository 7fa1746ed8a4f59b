"""Proposers: where a round's proposed target ids come from (as HF's candidate generators and
vLLM's proposers are for one vocabulary).

A proposer answers three calls, made by a request's `Speculation` (speculation.py), under the
contract in contract.py: `begin(request)` gives the request the proposer's own state,
`propose(state, budget)` proposes up to `budget.limit` target ids after the committed text (a
`Round`, or None for nothing worth proposing), and `settle(state, rnd, outcome)` learns what the
target committed. The pairing's `RoundPolicy` only sizes each budget.

- `ModelDrafts`: the drafter model drafts up to k tokens, translated into the target's ids;
- `RetrievedDrafts`: a continuation copied from the request's context or the user's past outputs
  (retrieve/), in the target's ids already, where the retrieval planner expects it to pay;
- `HybridDrafts`: the pairing's default: a retrieved draft where the planner prefers it, else a
  model draft run on into a retrieved continuation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..draft.picking import NO_DRAFT, Adaptable, Draft
from .contract import Budget, Outcome, RequestState, Round

if TYPE_CHECKING:
    from ..draft.session import DraftSession
    from ..retrieve import ContextIndex
    from .speculator import Speculator

__all__ = ["HybridDrafts", "ModelDrafts", "RetrievedDrafts", "default_proposer"]


@dataclass
class ModelState:
    """A request's model-draft side: its drafter session, and the drafter context's last token
    (token healing may let the next draft replace it)."""

    request: RequestState
    drafts: DraftSession
    last: int


class ModelDrafts:
    """The drafter model's draft of up to k tokens (k_max once an acceptance head decides),
    stopped by the head or by the drafter's confidence, healed where lossless, translated."""

    def __init__(self, speculator: Speculator) -> None:
        self.s = speculator

    def begin(self, request: RequestState) -> ModelState:
        s = self.s
        if isinstance(s.drafter, Adaptable):  # a fake or an exported graph has no adapters
            s.drafter.activate(s.adapter)
        ids = request.drafter_ids
        return ModelState(request, s.drafter.begin(ids), ids[-1] if ids else -1)

    def propose(self, state: ModelState, budget: Budget) -> Round:
        draft = NO_DRAFT if budget.k == 0 else self._draft(state, budget.k, ahead=budget.ahead)
        return self._round(state, draft, budget.only, budget.limit)

    def settle(self, state: ModelState, rnd: Round, outcome: Outcome) -> None:
        """The drafter keeps what matches the committed text and re-encodes the rest, the n-gram
        cache learns, and the next draft length is chosen (into the request)."""
        s, req, draft = self.s, state.request, rnd.draft
        held = (s.drafter.token_bytes.table[state.last] or b"") if draft.healed else b""  # the draft's start
        keep, tail = s.resync(draft.ids, held, outcome.new)
        state.drafts.commit(keep, tail)
        if s.model_drafts:
            retrieved = rnd.retrieved_among(outcome.accepted)
            modeled = len(rnd.proposal) - rnd.proposal.retrieved
            req.k = s.next_length(
                req.k, req.stopper, len(draft.ids), modeled, outcome.accepted - retrieved, keep
            )
        state.last = (draft.ids[:keep] + tail or [state.last])[-1]

    def extend(self, state: ModelState, rnd: Round, k: int, limit: int) -> Round | None:
        """`rnd` with its model draft drafted up to `k` tokens further (stopped as a draft is, by a
        stop token or low confidence), translated again (at most `limit` target ids); None where the
        drafter proposes nothing more, or `rnd` is not a model draft to grow."""
        if not rnd.grows:
            return None
        _, stop_confidence, _ = self.s.lengths.for_draft(k, None)
        more = state.drafts.propose(k, stop_confidence=stop_confidence, more=True)
        if not more.ids:
            return None
        grown = self._round(state, Draft(rnd.draft.ids + more.ids, None, rnd.draft.healed), "any", limit)
        grown.started = rnd.started
        return grown

    def may_resume(self, state: ModelState, rnd: Round) -> bool:
        """Whether `rnd`'s draft stopped at a token of low confidence (not a stop token)."""
        return rnd.grows and rnd.draft.ids[-1] not in state.drafts.stop_ids

    def _round(self, state: ModelState, draft: Draft, only: str, limit: int) -> Round:
        s, drafted = self.s, time.perf_counter()
        skip = len(s.drafter.token_bytes.table[state.last] or b"") if draft.healed else 0
        proposal = s.translate(draft.ids, only, skip)
        return Round(draft, proposal.cut(min(len(proposal), limit)), drafted=drafted)

    def _draft(self, state: ModelState, k: int, *, ahead: bool) -> Draft:
        """Up to k tokens; `ahead`: k, not an acceptance head's length."""
        s, req = self.s, state.request
        k, stop_confidence, extra = s.lengths.for_draft(k, None if ahead else req.stopper)
        ids = req.session.ids
        if s.healer is not None and ids and req.rule.mode in ("greedy", "match"):
            heal = s.healer.candidates(state.last, s.target.token_bytes.table[ids[-1]])
            if heal is not None:
                extra["heal"] = heal  # the target's last token lets a longer drafter token replace `last`
        allowed = s.shared_vocab if req.rule.mode == "exact" else None
        return state.drafts.propose(
            k,
            temperature=req.rule.temperature,
            allowed=allowed,
            generator=req.generator,
            stop_confidence=stop_confidence,
            **extra,
        )


class RetrievedDrafts:
    """A retrieved continuation, where the planner expects it to beat drafting (`propose`), or
    run on after a model draft (`run_on`). Its state is the request's retrieval index (None: the
    pairing retrieves nothing at this target)."""

    def __init__(self, speculator: Speculator) -> None:
        self.s = speculator

    def begin(self, request: RequestState) -> ContextIndex | None:
        return self.s.begin_retrieval(request.prompt_ids)

    def propose(self, index: ContextIndex | None, budget: Budget) -> Round | None:
        used = self.s.retrieve(index, budget.limit, budget.k > 0) if index is not None else None
        if used is None:
            return None
        rnd = Round.copied(used.candidate.ids[: used.length])
        rnd.used, rnd.drafted = used, time.perf_counter()  # no drafter forward
        return rnd

    def run_on(self, index: ContextIndex | None, rnd: Round, limit: int) -> Round:
        """`rnd` (a model draft) run on into a retrieved continuation, where its end matches one."""
        if index is not None:
            rnd.proposal, rnd.used = self.s.run_on(index, rnd.proposal, limit)
        return rnd

    def settle(self, index: ContextIndex | None, rnd: Round, outcome: Outcome) -> None:
        """The index reads the committed ids; the retrieval statistics see the round."""
        if index is not None:
            self.s.commit_retrieval(index, outcome.new, rnd.used, len(rnd.proposal), outcome.accepted)


class HybridDrafts:
    """Model drafts and retrieved drafts as one proposer (the pairing's default; `retrieved` None
    with `drafts="model"`): a retrieved draft where the planner prefers it, else a model draft
    (of 0 tokens where the model cannot pay) run on into a retrieved continuation."""

    def __init__(self, model: ModelDrafts, retrieved: RetrievedDrafts | None) -> None:
        self.model, self.retrieved = model, retrieved

    def begin(self, request: RequestState) -> tuple[ModelState, Any]:
        return self.model.begin(request), self.retrieved.begin(request) if self.retrieved else None

    def propose(self, state: tuple[ModelState, Any], budget: Budget) -> Round:
        model, index = state
        retrieved = self.retrieved if budget.retrieve else None
        rnd = retrieved.propose(index, budget) if retrieved is not None else None
        if rnd is None:
            rnd = self.model.propose(model, budget)
            if retrieved is not None:
                rnd = retrieved.run_on(index, rnd, budget.limit)
        return rnd

    def settle(self, state: tuple[ModelState, Any], rnd: Round, outcome: Outcome) -> None:
        model, index = state
        self.model.settle(model, rnd, outcome)
        if self.retrieved is not None:
            self.retrieved.settle(index, rnd, outcome)

    def extend(self, state: tuple[ModelState, Any], rnd: Round, k: int, limit: int) -> Round | None:
        return self.model.extend(state[0], rnd, k, limit)

    def may_resume(self, state: tuple[ModelState, Any], rnd: Round) -> bool:
        return self.model.may_resume(state[0], rnd)


def default_proposer(speculator: Speculator) -> HybridDrafts:
    """The proposer a pairing's `DecodeConfig.drafts` asks for: model drafts, with retrieved ones
    beside them unless `drafts="model"` (with `drafts="retrieval"` the model drafts nothing)."""
    retrieved = RetrievedDrafts(speculator) if speculator.retriever is not None else None
    return HybridDrafts(ModelDrafts(speculator), retrieved)
