"""One request's speculation: `propose` a round, `commit` the target's verdict on it.

`Speculation` is the one state machine of a request's rounds. The round loop (round_loop.run) drives
it for targets verified call by call; engines that verify in their own step (vLLM's proposer,
llama.cpp's draft-model hook, a device drafting for a server's engine) drive it through
`EngineProposals` (engine_proposals.py), which infers each verdict from the committed ids. Each round the
speculator's `RoundPolicy` (round_policy.py) sizes a budget, its proposer (proposers.py)
proposes within it, and the verdict settles the proposer, the cost model and the draft lengths.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..retrieve.retriever import NO_READ
from .contract import Booking, Budget, Extendable, Outcome, RequestState, Round
from .round_policy import RoundPlan, RoundPolicy
from .rounds import draft_rows

if TYPE_CHECKING:
    from ..target import Rule, TargetSession
    from .speculator import Speculator

__all__ = ["Speculation"]

# which translations a verification rule accepts (translate/translator.py)
ONLY = {"exact": "direct", "omnidraft": "aligned"}


class Speculation:
    """One request's rounds of speculator `s` against `session` (a target session, or a stand-in with
    the committed ids). `prefills`: the first verify also reads the prompt (the round loop's), so
    its time is not a verify's; an engine has read the prompt before it first asks."""

    def __init__(
        self,
        s: Speculator,
        session: TargetSession,
        prompt_ids: list[int],
        drafter_ids: list[int],
        rule: Rule,
        generator: torch.Generator | None = None,
        *,
        prefills: bool = True,
    ) -> None:
        self.s, self.policy, self.proposer = s, RoundPolicy(s), s.proposer
        k, stopper, ledger = s.begin_request(len(drafter_ids))
        deferral = s.retriever.deferral if s.retriever is not None and s.free_drafts else None
        read = deferral.begin(len(session.ids)) if deferral is not None else NO_READ
        self.request = RequestState(
            session,
            rule,
            generator,
            list(prompt_ids),
            list(drafter_ids),
            k if s.model_drafts else 0,
            stopper,
            read,
            ledger,
        )
        self.state = self.proposer.begin(self.request)
        self.round: Round | None = None  # the last proposal
        self.budget = Budget(0, 0)  # what it was proposed within
        self.rounds = 0  # rounds committed
        self._plan: RoundPlan | None = None
        self._prefills = prefills

    @property
    def produced(self) -> int:
        return self.request.produced

    @property
    def reads_prompt(self) -> bool:
        """Whether the next round's target call also reads the prompt (the request's first)."""
        return self.rounds == 0 and self._prefills

    def _prefill_s(self) -> float | None:
        """The seconds the session's first call spent reading the prompt, where it times that apart."""
        return getattr(self.request.session, "prefill_s", None)

    def propose(self, remaining: int, *, limit: int | None = None, k: int | None = None) -> Round | None:
        """The next round's proposal with `remaining` tokens to go; None when the target's server
        takes no draft now (it should decode the rest alone). `limit` caps the proposal (an engine's
        own limit: then an empty round, never None); `k` drafts that many tokens whatever the
        draft-length policy says (a device drafting ahead for a server's engine)."""
        started, req = time.perf_counter(), self.request
        self.policy.begin_round(req, started)
        self._book(started)
        plan = self.policy.plan(req, remaining, floor=k is None, first=self.reads_prompt)
        if plan is None and limit is None:
            return None
        plan = plan or RoundPlan(0, 0, False, False)
        cap = plan.limit if limit is None else max(0, min(plan.limit, limit))
        ask = (plan.k if k is None else min(k, cap)) if cap > 0 else 0
        self._plan = RoundPlan(ask, cap, plan.retrieve, plan.defer and k is None)
        self.budget = budget = Budget(ask, cap, plan.retrieve, ONLY.get(req.rule.mode, "any"), k is not None)
        rnd = self.proposer.propose(self.state, budget) or Round.copied([])
        proposal = rnd.proposal
        if budget.only != "any" and len(proposal):
            rnd.q = draft_rows(self.s.translator, proposal, len(proposal) - proposal.retrieved, rnd.draft)
        rnd.started, rnd.ready = started, time.perf_counter()
        rnd.drafted = rnd.drafted or rnd.ready
        self.round = rnd
        return rnd

    def commit(self, new: list[int], accepted: int, verify_s: float, now: float | None = None) -> Round:
        """The target's verdict on the last proposal: it committed `new`, whose first `accepted` are
        proposed tokens, in a verify of `verify_s` seconds (ending at `now`). The proposer settles,
        the draft lengths and the cost model learn. Returns the round settled."""
        rnd, plan, req = self.round, self._plan, self.request
        if rnd is None or plan is None:
            raise RuntimeError("commit() before propose(): no proposal to settle")
        now = time.perf_counter() if now is None else now
        first = self.rounds == 0
        self.proposer.settle(self.state, rnd, Outcome(new, accepted))
        seconds = None if self.reads_prompt else now - rnd.started
        self.policy.settle_read(req, plan, rnd, len(new), seconds)
        req.produced += len(new)
        if first:
            req.idle = not rnd.draft.ids
        else:
            self.policy.observe(req, rnd, verify_s, len(rnd.proposal) + 1)
        if seconds is not None:
            req.booking = Booking(len(new), rnd.started, len(rnd.proposal) > 0, bool(rnd.draft.ids))
        else:  # the first round also read the prompt
            self._book_first(rnd, len(new))
        self.rounds += 1
        return rnd

    def _book_first(self, rnd: Round, committed: int) -> None:
        """The first round's booking: the drafter's read of the prompt is charged (the target alone
        never reads with it), and where the session timed its own read of the prompt (with the first
        token) apart, the rest of the round is booked against the target alone."""
        req, read = self.request, 0.0
        if rnd.draft.ids:
            read = rnd.drafted - rnd.started
            self.s.read_prompt(req.ledger, len(req.drafter_ids), read)
            req.ledger.unread = 0
        prefill = self._prefill_s()
        if prefill is not None:
            req.ledger.prefill = prefill
            began = rnd.started + read + prefill
            req.booking = Booking(committed - 1, began, len(rnd.proposal) > 0, bool(rnd.draft.ids))

    def aside(self, remaining: int) -> int:
        """After `propose` returned None: how many of the `remaining` tokens the target decodes
        alone before the next round (the rest, unless the floor stood aside for a stretch)."""
        return min(remaining, self.s.floor.knobs.aside) if self.request.ledger.aside else remaining

    def decoded(self, new: list[int], began: float, first: float | None = None) -> None:
        """The target decoded `new` alone from `began` (perf_counter seconds; `first`: the seconds
        of its first token): the proposer follows the committed text, and the floor measures the
        target's step from it."""
        req = self.request
        self.proposer.settle(self.state, Round.copied([]), Outcome(new, 0))
        req.produced += len(new)
        req.idle, req.pending = True, None
        prefill = self._prefill_s() if self.reads_prompt else 0.0
        if prefill:
            req.ledger.prefill = prefill
        if prefill is None:  # the stretch read the prompt too: its time is no step
            req.booking = Booking(len(new), began, alone=True, measures=False)
        else:
            req.booking = Booking(
                len(new) - (1 if prefill else 0),
                began + prefill,
                alone=True,
                first=None if prefill else first,
            )
        self.rounds += 1

    def _book(self, now: float) -> None:
        """The last round's wall time, up to `now` (the caller's handling of its tokens included),
        booked against the target alone."""
        req = self.request
        if req.booking is None:
            return
        done, req.booking = req.booking, None
        if done.alone:
            req.ledger.alone(done.committed, now - done.began if done.measures else None, done.first)
            return
        if 1 in self.s.cost.verify:  # (a one-token verify extrapolated from longer ones misleads)
            req.ledger.seen(self.s.cost.verify_cost(1))
        req.ledger.book(done.committed, now - done.began, done.proposed, drafted=done.drafted)

    def close(self) -> None:
        """The request is over: its last round booked, its ledger handed to the pairing's floor."""
        self._book(time.perf_counter())
        self.s.end_request(self.request.ledger)

    def extend(self, k: int, limit: int) -> Round | None:
        """The last proposal with its model draft drafted `k` tokens further (at most `limit` target
        ids), while its verify is still out; None where the proposer cannot grow it."""
        rnd = self.round
        if rnd is None or not isinstance(self.proposer, Extendable):
            return None
        grown = self.proposer.extend(self.state, rnd, k, limit)
        if grown is not None:
            grown.ready = time.perf_counter()
            self.round = grown
        return grown

    def may_resume(self) -> bool:
        """Whether the last proposal's draft stopped at a token of low confidence, not a stop token."""
        rnd = self.round
        return (
            rnd is not None
            and isinstance(self.proposer, Extendable)
            and self.proposer.may_resume(self.state, rnd)
        )
