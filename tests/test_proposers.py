"""A proposer of one's own, defined here alone: the pairing's speculation drives it as it drives
the drafter's model drafts and retrieved ones (decode/proposers.py, docs/architecture.md)."""

from __future__ import annotations

from typing import Any

from omnidraft.decode.contract import Budget, Outcome, Round
from omnidraft.decode.engine_proposals import EngineProposals

from .conftest import target_greedy

REPEATS = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"


class PromptLookup:
    """Proposes what followed the last two committed target ids where they occurred before."""

    def __init__(self) -> None:
        self.begun = self.settled = self.accepted = 0

    def begin(self, request: Any) -> Any:
        self.begun += 1
        return request

    def propose(self, request: Any, budget: Budget) -> Round | None:
        ids = request.session.ids
        for i in range(len(ids) - 3, -1, -1):
            if ids[i : i + 2] == ids[-2:]:
                follow = ids[i + 2 : i + 2 + budget.limit]
                return Round.copied(follow) if follow else None
        return None

    def settle(self, request: Any, rnd: Round, outcome: Outcome) -> None:
        self.settled += 1
        self.accepted += outcome.accepted


def test_a_proposer_of_ones_own_is_driven_round_by_round_and_stays_lossless(tiny_drafter, tiny_target):
    lookup = PromptLookup()
    # every round speculates (the floor of the latency objective would stand aside on a tiny
    # model's costs, decoding stretches alone: tests/test_floor.py)
    pair = tiny_drafter.pair(tiny_target, k=4, proposer=lookup, objective="compute")
    out = pair.generate(REPEATS, max_new_tokens=32)
    assert out.token_ids == target_greedy(tiny_target, REPEATS, 32)
    assert lookup.begun == 1 and lookup.settled == len(out.rounds)
    assert sum(r.proposed for r in out.rounds) > 0 and all(r.drafted == 0 for r in out.rounds)
    assert lookup.accepted == sum(r.accepted for r in out.rounds)


def test_sampled_requests_verify_a_proposer_of_ones_own_too(tiny_drafter, tiny_target):
    pair = tiny_drafter.pair(tiny_target, k=4, proposer=PromptLookup())
    one = pair.generate(REPEATS, max_new_tokens=16, temperature=0.8, seed=7)
    again = pair.generate(REPEATS, max_new_tokens=16, temperature=0.8, seed=7)
    assert one.token_ids == again.token_ids and len(one.token_ids) == 16


def test_engine_rounds_record_each_step_by_the_proposal_made_at_its_context(tiny_drafter, tiny_target):
    """An engine step's record is the round proposed at its context, or the engine alone where
    nothing was proposed; the verdict is inferred from the ids of the next call."""
    lookup = PromptLookup()
    pair = tiny_drafter.pair(tiny_target, k=4, proposer=lookup)
    rounds = EngineProposals(pair.speculator, keep=True)
    ids = tiny_target.tokenizer(REPEATS)["input_ids"]
    rounds.open(ids)
    proposal = rounds.next(ids, limit=4, remaining=10)
    assert proposal and lookup.settled == 0
    assert len(proposal) >= 3
    step = proposal[:2] + [(proposal[2] + 1) % 50]  # the engine accepts two, then its own token
    record = rounds.record(len(ids), step, 0.01)
    assert (record.proposed, record.accepted, record.emitted) == (len(proposal), 2, 3)
    rounds.next(ids + step, limit=4, remaining=7)
    assert lookup.settled == 1 and lookup.accepted == 2
    alone = rounds.record(len(ids) - 1, [5], 0.01)  # no proposal was made there
    assert (alone.proposed, alone.emitted) == (0, 1)
