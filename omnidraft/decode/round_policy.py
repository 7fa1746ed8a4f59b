"""`RoundPolicy`: sizes each round's budget for a request's speculation (speculation.py) and
tells the speculator's controllers what each round cost.

Behind it stay the controllers a speculator keeps (speculator.py): the drafting plan (which kinds
of draft can pay at this context: adaptive/policy.py), the deferred read of the prompt
(retrieve/retriever.py), the server's draft budget (server/budget.py), the draft-length policy or
acceptance head (adaptive/lengths.py) and the cost model (adaptive/costs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..target import TargetSession
    from .contract import RequestState, Round
    from .speculator import Speculator

__all__ = ["RoundPlan", "RoundPolicy", "within_budget"]


@dataclass(frozen=True)
class RoundPlan:
    """This round: up to `k` model-drafted tokens (0: none), at most `limit` proposed in all,
    retrieved drafts allowed or not, and whether the drafter's read of the prompt is deferred."""

    k: int
    limit: int
    retrieve: bool
    defer: bool


class RoundPolicy:
    """What a pairing proposes each round of a request, and what each round teaches it."""

    def __init__(self, speculator: Speculator) -> None:
        self.s = speculator

    def plan(
        self, req: RequestState, remaining: int, *, floor: bool = True, first: bool = False
    ) -> RoundPlan | None:
        """The next round's plan with `remaining` tokens to go; None when the target's server
        takes no draft now (a zero budget: it should decode the rest alone) or the request's
        balance against the target alone covers no draft (`req.ledger.aside`: where the request
        `may_decode`, its target decodes a stretch alone; else its rounds propose nothing).
        Without `floor` (a device drafting ahead for a server's engine, whose budget decides what
        it verifies) the balance is not asked. `first`: the round also reads the prompt, which
        gives its first token whatever it proposes, so a rejected proposal loses its whole verify
        (not a verify less one step, as later): under the floor it proposes nothing."""
        s = self.s
        if floor and first and req.ledger.on and req.ledger.step is not None:
            return RoundPlan(0, 0, False, False)
        model, free = s.plan.at(s.target, len(req.session.ids))  # what can pay at this context
        defer = model and req.k > 0 and req.read.defer(s.policy.last_rates if s.policy else {}, req.produced)
        limit, ask = within_budget(req.session, remaining - 1, req.k if model and not defer else 0)
        if limit == 0 < remaining - 1:
            return None
        # the floor: no more than the request's balance covers (adaptive/floor.py)
        if floor and (model or free):
            ask, limit = req.ledger.cap(s.cost, ask, limit, remaining)
            if req.ledger.aside and req.may_decode:  # (else a round that proposes nothing)
                return None
        return RoundPlan(ask, limit, free, defer)

    def settle_read(
        self, req: RequestState, plan: RoundPlan, rnd: Round, committed: int, seconds: float | None
    ) -> None:
        """What the round says about deferring the drafter's read of the prompt (`seconds`: the
        round's time, None for the first, which also prefilled)."""
        self.s.settle_read(
            req.read,
            plan.defer,
            committed,
            seconds,
            len(rnd.draft.ids),
            rnd.drafted - rnd.started,
            req.produced,
        )

    @staticmethod
    def observe(req: RequestState, rnd: Round, verify_s: float, verified: int) -> None:
        """Queue the round's costs (`verified` tokens scored in `verify_s`); `begin_round` observes
        them when the next round starts, so a round's overhead includes everything between two
        rounds. A draft right after rounds without one first caught the drafter up on the tokens
        committed meanwhile: not a drafting cost."""
        drafted = 0 if req.idle else len(rnd.draft.ids)
        req.pending = (drafted, rnd.drafted - rnd.started, verified, verify_s, rnd.started)
        req.idle = not rnd.draft.ids

    def begin_round(self, req: RequestState, now: float) -> None:
        """A new round starts at `now`: the cost model observes the previous round's costs."""
        if req.pending is not None:
            drafted, t_draft, verified, t_verify, started = req.pending
            self.s.observe_costs(drafted, t_draft, verified, t_verify, (now - started) - t_draft - t_verify)
            req.pending = None


def within_budget(tsession: TargetSession, limit: int, k: int) -> tuple[int, int]:
    """(limit, k) for this round's proposal, each capped by the draft budget the target session's
    server gave in its last reply (server/budget.py: a server under load takes fewer draft tokens)."""
    cap = tsession.budget
    return (limit, k) if cap is None else (min(limit, cap), min(k, cap))
