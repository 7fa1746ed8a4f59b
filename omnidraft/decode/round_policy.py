"""`RoundPolicy`: sizes each round's budget for a request's speculation (speculation.py) and
tells the pairing's controllers what each round cost.

Behind it stay the controllers a pairing keeps: the drafting plan (which kinds of draft can pay at
this context: adaptive/policy.py), the deferred read of the prompt (retrieve/retriever.py), the
server's draft budget (remote/budget.py), the draft-length policy or acceptance head
(adaptive/lengths.py) and the cost model (adaptive/costs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .rounds import within_budget

if TYPE_CHECKING:
    from ..pairing import Pairing
    from ..target import Rule
    from .proposers import Round
    from .speculation import Request
    from .stats import GenerationStats, RoundRecord

__all__ = ["RoundPlan", "RoundPolicy", "finish_request", "request_mode"]


@dataclass(frozen=True)
class RoundPlan:
    """This round: up to `k` model-drafted tokens (0: none), at most `room` proposed in all,
    retrieved drafts allowed or not, and whether the drafter's read of the prompt is deferred."""

    k: int
    room: int
    retrieve: bool
    defer: bool


class RoundPolicy:
    """What a pairing proposes each round of a request, and what each round teaches it."""

    def __init__(self, pairing: Pairing) -> None:
        self.p = pairing

    def plan(self, req: Request, remaining: int) -> RoundPlan | None:
        """The next round's plan with `remaining` tokens to go; None when the target's server
        takes no draft now (a zero budget): it should decode the rest alone."""
        p = self.p
        model, free = p.plan.at(p.target, len(req.target.ids))  # what can pay at this context
        defer = model and req.k > 0 and req.read.defer(p.policy.last_rates if p.policy else {}, req.produced)
        room, ask = within_budget(req.target, remaining - 1, req.k if model and not defer else 0)
        if room == 0 < remaining - 1:
            return None
        return RoundPlan(ask, room, free, defer)

    def settle_read(
        self, req: Request, plan: RoundPlan, rnd: Round, committed: int, seconds: float | None
    ) -> None:
        """What the round says about deferring the drafter's read of the prompt (`seconds`: the
        round's time, None for the first, which also prefilled)."""
        with self.p.shared_lock:
            req.read.settle(
                plan.defer,
                committed,
                seconds,
                len(rnd.draft.ids),
                rnd.drafted - rnd.started,
                self.p.cost.draft,
                req.produced,
            )

    @staticmethod
    def observe(req: Request, rnd: Round, verify_s: float, verified: int) -> None:
        """Queue the round's costs (`verified` tokens scored in `verify_s`); `begin_round` observes
        them when the next round starts, so a round's overhead includes everything between two
        rounds. A draft right after rounds without one first caught the drafter up on the tokens
        committed meanwhile: not a drafting cost."""
        drafted = 0 if req.idle else len(rnd.draft.ids)
        req.pending = (drafted, rnd.drafted - rnd.started, verified, verify_s, rnd.started)
        req.idle = not rnd.draft.ids

    def begin_round(self, req: Request, now: float) -> None:
        """A new round starts at `now`: the cost model observes the previous round's costs."""
        if req.pending is not None:
            drafted, t_draft, verified, t_verify, started = req.pending
            with self.p.shared_lock:
                self.p.cost.observe(
                    drafted, t_draft, verified, t_verify, (now - started) - t_draft - t_verify
                )
            req.pending = None


def finish_request(
    p: Pairing, mode: str, out: list[int], rounds: list[RoundRecord], stats: GenerationStats
) -> None:
    """A finished request's bookkeeping: the user's datastore, the mode chooser, the head."""
    if p.retriever is not None:
        p.retriever.finish(out)
    if p.modes is not None and len(rounds) > 1:  # decode-phase rate: the first round also prefills
        p.modes.observe(
            mode,
            len(out) - rounds[0].emitted,
            stats.seconds - rounds[0].seconds,
            label=f"{p.drafter.name} -> {p.target.name}",
        )
    if (row := p.lengths.end_request(p.learner)) is not None:
        p.metrics.append(row)


def request_mode(p: Pairing, rule: Rule, logprobs: int) -> str:
    """How a request is served: "engine" (the target's engine verifies the pairing's drafts in its
    own step: vLLM with omnidraft's proposer, greedy or sampled without a seed), "alone" (the target
    decodes it alone: drafting cannot pay, or the mode chooser measured it faster) or "speculate"
    (the round loop). A request for per-token log-probabilities speculates: each round's verify
    returns its rows; so does a seeded sampled one (the round loop keys each sample by seed and
    position, so the output depends on the seed alone, not on which drafts reached the engine)."""
    if logprobs:
        return "speculate"
    greedy = rule.mode == "greedy"
    can = p.target.capabilities
    if greedy and not p.drafting and can.decodes_alone:
        return "alone"
    in_engine = greedy or (rule.mode == "match" and rule.seed is None)
    if in_engine and p.learner is None and can.drafts_in_engine:
        return "engine"
    return p.modes.choose() if p.modes is not None and greedy else "speculate"
