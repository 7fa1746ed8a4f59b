"""Proposers: where a round's proposed target ids come from (as HF's candidate generators and
vLLM's proposers are for one vocabulary).

- `ModelDrafts`: the drafter model drafts up to k tokens, translated into the target's ids;
- `RetrievedDrafts`: a continuation copied from the request's context or the user's past outputs
  (retrieve/), in the target's ids already, with the planner deciding when it beats drafting;
- `propose`: their combination, the hybrid the pairing runs: a retrieved draft where the planner
  prefers it, else a model draft run on into a retrieved continuation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..draft.picking import NO_DRAFT, Draft
from ..translate.translator import Proposal, Source
from .rounds import draft_rows

if TYPE_CHECKING:
    from ..pairing import Pairing
    from .round_loop import Request

__all__ = ["MODEL", "RETRIEVED", "ModelDrafts", "Proposer", "RetrievedDrafts", "Round", "propose"]


@dataclass
class Round:
    """One round's proposal: the model draft (NO_DRAFT when none), the proposal in target ids, the
    retrieval plan it used (None: none), the rows rejection sampling verifies against, and when
    the round began and its draft was done (perf_counter seconds)."""

    draft: Draft
    proposal: Proposal
    used: Any
    q: torch.Tensor | None
    started: float
    drafted: float

    def retrieved_among(self, accepted: int) -> int:
        """How many of the first `accepted` proposed tokens were retrieved ones."""
        return sum(1 for s in self.proposal.sources[:accepted] if s == Source.RETRIEVED)


class Proposer(Protocol):
    """Proposes up to `room` target ids after the request's committed text (a `Round`, its rows
    for rejection sampling not filled in yet), or None where it has nothing worth proposing.
    `only`: which translations the request's verification accepts (translate/translator.py)."""

    def propose(
        self, p: Pairing, req: Request, k: int, room: int, only: str, started: float
    ) -> Round | None: ...


class ModelDrafts:
    """The drafter model's draft of up to k tokens (k_max once an acceptance head decides),
    stopped by the head or by the drafter's confidence, healed where lossless, translated."""

    def propose(
        self, p: Pairing, req: Request, k: int, room: int, only: str, started: float, *, ahead: bool = False
    ) -> Round:
        draft = NO_DRAFT if k == 0 else self.draft(p, req, k, ahead=ahead)
        drafted = time.perf_counter()
        skip = len(p.drafter.token_bytes.table[req.last] or b"") if draft.healed else 0
        with p.shared_lock:
            proposal = p.translator.translate(draft.ids, only=only, skip=skip)
        return Round(draft, proposal.cut(min(len(proposal), room)), None, None, started, drafted)

    @staticmethod
    def extend(p: Pairing, req: Request, rnd: Round, k: int, room: int) -> Round | None:
        """`rnd` with its model draft drafted up to `k` tokens further (stopped as a draft is, by a
        stop token or low confidence), translated again (at most `room` target ids); None where the
        drafter proposes nothing more."""
        _, stop_confidence, _ = p.lengths.for_draft(k, None)
        more = req.drafts.propose(k, stop_confidence=stop_confidence, more=True)
        if not more.ids:
            return None
        draft = Draft(rnd.draft.ids + more.ids, None, rnd.draft.healed)
        skip = len(p.drafter.token_bytes.table[req.last] or b"") if draft.healed else 0
        with p.shared_lock:
            proposal = p.translator.translate(draft.ids, only="any", skip=skip)
        return Round(
            draft, proposal.cut(min(len(proposal), room)), None, None, rnd.started, time.perf_counter()
        )

    @staticmethod
    def draft(p: Pairing, req: Request, k: int, *, ahead: bool = False) -> Draft:
        """Up to k tokens; `ahead`: k, not an acceptance head's length (a device drafting ahead of
        a server, whose budget decides what is verified)."""
        k, stop_confidence, extra = p.lengths.for_draft(k, None if ahead else req.stopper)
        ids = req.target.ids
        if p.healer is not None and ids and req.rule.mode in ("greedy", "match"):
            heal = p.healer.candidates(req.last, p.target.token_bytes.table[ids[-1]])
            if heal is not None:
                extra["heal"] = heal  # the target's last token lets a longer drafter token replace `last`
        allowed = p.shared_vocab if req.rule.mode == "exact" else None
        return req.drafts.propose(
            k,
            temperature=req.rule.temperature,
            allowed=allowed,
            generator=req.generator,
            stop_confidence=stop_confidence,
            **extra,
        )


class RetrievedDrafts:
    """A retrieved continuation, where the planner expects it to beat drafting (`propose`), or
    run on after a model draft (`run_on`)."""

    def propose(self, p: Pairing, req: Request, k: int, room: int, only: str, started: float) -> Round | None:
        if req.index is None or p.retriever is None:
            return None
        with p.shared_lock:
            rates = p.policy.last_rates if p.policy else {}
            used = p.retriever.plan(req.index, p.cost, rates, room, drafting=k > 0)
            if used is None:
                return None
            drafted = time.perf_counter()  # no drafter forward this round
            proposal = p.translator.translate([], only=only).then(used.candidate.ids[: used.length])
        return Round(NO_DRAFT, proposal, used, None, started, drafted)

    def run_on(self, p: Pairing, req: Request, proposal: Proposal, room: int) -> tuple[Proposal, Any]:
        if req.index is None or p.retriever is None:
            return proposal, None
        with p.shared_lock:
            return p.retriever.extend(req.index, proposal, room)


MODEL, RETRIEVED = ModelDrafts(), RetrievedDrafts()


def propose(
    p: Pairing,
    req: Request,
    k: int,
    room: int,
    retrieve: bool = True,
    started: float | None = None,
    *,
    ahead: bool = False,
) -> Round:
    """This round's proposal, at most `room` tokens: retrieved (when `retrieve` and the planner
    says so), else a model draft of up to `k` tokens run on into a retrieved continuation; with the
    rows rejection sampling needs. `started`: when the round began (its draft time counts from it)."""
    started = time.perf_counter() if started is None else started
    only = {"exact": "direct", "omnidraft": "aligned"}.get(req.rule.mode, "any")
    rnd = RETRIEVED.propose(p, req, k, room, only, started) if retrieve else None
    if rnd is None:
        rnd = MODEL.propose(p, req, k, room, only, started, ahead=ahead)
        if retrieve:
            rnd.proposal, rnd.used = RETRIEVED.run_on(p, req, rnd.proposal, room)
    proposal = rnd.proposal
    modeled = len(proposal) - proposal.retrieved  # proposed tokens that came from the model
    if only != "any" and len(proposal):
        rnd.q = draft_rows(p.translator, proposal, modeled, rnd.draft)
    return rnd
