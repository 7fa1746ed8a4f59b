"""Rounds that an engine verifies: omnidraft proposes, the engine's own speculative step checks.

llama-cpp-python's `draft_model` hook (llamacpp/hook.py) and vLLM's proposer inside its engine step
(targets/vllm_proposer.py) both call a proposer with the committed ids of one sequence and verify
what comes back themselves. `EngineRounds` is one sequence's side of that: each call infers the
last round's verdict from the ids (the accepted prefix of its proposal, then the engine's token),
settles it with the pairing's own `RoundPolicy` (drafter rolled back and re-synced, n-gram cache,
retrieval index, costs, next draft length) and proposes again through the pairing's proposers
(proposers.py). Where the measured costs say drafting cannot pay, it proposes nothing and the
engine decodes alone.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator

from ..target import Rule, SessionBase
from .proposers import MODEL, Round, propose
from .round_loop import Request, open_request
from .round_policy import RoundPlan, RoundPolicy
from .stats import RoundRecord

if TYPE_CHECKING:
    from ..pairing import Pairing

__all__ = ["Committed", "EngineRounds", "request_rounds"]

GREEDY = Rule()


class Committed(SessionBase):
    """The stand-in target session the round loop reads: the committed ids."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class EngineRounds:
    """One sequence's rounds for `pairing` while an engine verifies them. `records` collects a
    `RoundRecord` per settled round (the engine's verify time is the time between a proposal's
    return and the next call), for whoever reads the sequence's output."""

    def __init__(self, pairing: Pairing) -> None:
        self.pairing = pairing
        self.policy = RoundPolicy(pairing)
        self.request: Request | None = None
        self.records: deque[RoundRecord] = deque()
        self._ids: list[int] = []
        self._round: Round | None = None
        self._plan: RoundPlan | None = None
        self._returned = 0.0  # when the last proposal went back to the engine
        self._growable = False  # whether the last proposal is a model draft the drafter may draft on
        self.calls = self.proposed = self._settled = 0

    def open(self, ids: list[int], drafter_ids: list[int] | None = None) -> None:
        """A new sequence over the committed `ids`; `drafter_ids`: the drafter's own encoding of
        its text (by default the ids' bytes re-encoded, without special tokens)."""
        p = self.pairing
        if drafter_ids is None:
            text = p.target.token_bytes.join(ids).decode("utf-8", errors="replace")
            drafter_ids = p.drafter.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.request = open_request(p, Committed(list(ids)), list(ids), drafter_ids, GREEDY)
        self._ids, self._round, self._plan, self._settled = list(ids), None, None, 0

    def prepare(self, ids: list[int]) -> None:
        """Nothing to do before `next`: the drafter is here."""

    def extends(self, ids: list[int]) -> bool:
        """Whether `ids` continue this sequence (the ids of its last call, then more)."""
        n = len(self._ids)
        return self.request is not None and len(ids) > n and ids[:n] == self._ids

    @property
    def token_s(self) -> float | None:
        """Seconds per drafted token on this machine, as measured so far (None before)."""
        return self.pairing.cost.draft

    def next(self, ids: list[int], most: int, remaining: int, *, k: int | None = None) -> list[int]:
        """The proposal (target ids, at most `most`) after the committed `ids`, which extend the
        last call's; `remaining`: tokens the sequence may still produce. `k` drafts that many
        tokens whatever the pairing's draft-length policy says (a device drafting ahead for a
        server's engine: its drafting is off the server's path, the server's budget decides)."""
        now = time.perf_counter()
        self._settle(ids[len(self._ids) :], now)
        self._ids = list(ids)
        req = self.request
        assert req is not None
        req.target.ids = self._ids
        started = time.perf_counter()
        self.policy.begin_round(req, started)
        plan = self.policy.plan(req, max(1, remaining))
        plan = RoundPlan(0, 0, False, False) if plan is None else plan
        room = max(0, min(plan.room, most))
        if k is not None:
            plan = RoundPlan(min(k, room), room, plan.retrieve, False)
        self._plan = RoundPlan(plan.k if room > 0 else 0, room, plan.retrieve, plan.defer)
        self._round = propose(
            self.pairing, req, self._plan.k, room, plan.retrieve, started, ahead=k is not None
        )
        rnd = self._round
        self._growable = bool(rnd.draft.ids) and rnd.used is None and len(rnd.draft.ids) >= self._plan.k
        self.calls += 1
        self.proposed += len(self._round.proposal)
        self._returned = time.perf_counter()
        return [int(t) for t in self._round.proposal.ids.tolist()]

    def extend(self, k: int, most: int) -> list[int] | None:
        """The last proposal with its model draft drafted `k` tokens further (at most `most` target
        ids in all), while the engine has not yet answered it: a device drafting ahead of a server.
        None where it cannot grow: a retrieved proposal, or a draft the drafter stopped itself
        (a stop token, low confidence)."""
        rnd, req = self._round, self.request
        if rnd is None or req is None or not self._growable or len(rnd.proposal) >= most:
            return None
        longer = MODEL.extend(self.pairing, req, rnd, k, most)
        if longer is None or len(longer.draft.ids) < len(rnd.draft.ids) + k:
            self._growable = False  # the drafter stopped (a stop token, low confidence)
        if longer is None:
            return None
        self._round = longer
        self.proposed += len(longer.proposal) - len(rnd.proposal)
        self._returned = time.perf_counter()
        return [int(t) for t in longer.proposal.ids.tolist()]

    def resume(self) -> None:
        """Let the last proposal grow again after its draft stopped at a token of low confidence
        (not a stop token): the server has committed part of it since, so the uncertain token is
        within its next verify, and a continuation drafted now is there if it is accepted."""
        rnd, req = self._round, self.request
        if rnd is not None and req is not None and rnd.draft.ids and rnd.used is None:
            self._growable = rnd.draft.ids[-1] not in req.drafts.stop_ids

    def _settle(self, new: list[int], now: float) -> None:
        """The last round's verdict, inferred: the accepted prefix of its proposal, then the
        engine's token."""
        rnd, req = self._round, self.request
        if rnd is None or req is None:
            return
        proposed = rnd.proposal.ids.tolist()
        accepted = next((j for j, t in enumerate(proposed) if j >= len(new) or new[j] != t), len(proposed))
        retrieved = self.policy.settle(req, rnd, new, accepted)
        if self._plan is not None:
            self.policy.settle_rent(req, self._plan, rnd, len(new), now - rnd.started)
        req.produced += len(new)
        # the engine verified between the proposal's return and this call: the verify's time; the
        # first round's draft also read the prompt (as the round loop's first verify prefills)
        if self._settled:
            self.policy.observe(req, rnd, now - self._returned, len(proposed) + 1)
        self._settled += 1
        self.records.append(
            RoundRecord(
                context=len(self._ids),
                drafted=len(rnd.draft.ids),
                proposed=len(proposed),
                accepted=accepted,
                emitted=len(new),
                from_cache=0,
                t_draft=rnd.drafted - rnd.started,
                t_translate=self._returned - rnd.drafted,
                t_verify=now - self._returned,
                t_resync=time.perf_counter() - now,
                retrieved=rnd.proposal.retrieved,
                retrieved_accepted=retrieved,
            )
        )


def request_rounds(
    p: Pairing,
    prompt: str,
    rule: Rule,
    max_new_tokens: int,
    generator: Any,
    mode: str,
    special: bool,
    rows: list,
    logprobs: int = 0,
) -> Iterator[tuple[list[int], RoundRecord]]:
    """One request, greedy or match-sampled, on a target whose engine verifies the pairing's drafts
    in its own step (`drafts_in_engine`: vLLM with omnidraft's proposer; a sampled request through
    vLLM's rejection sampler, which takes each proposal as one-hot); the same signature as
    round_loop.request_rounds. One (ids, record) per engine step: the step's committed ids and the
    round that proposed them (a step without a draft: a record of none)."""
    if mode != "engine" or rule.mode not in ("greedy", "match") or logprobs:
        raise ValueError(
            "engine rounds serve greedy or match-sampled requests without log-probabilities only"
        )
    prompt_ids = p.target.tokenizer(prompt, add_special_tokens=special)["input_ids"]
    drafter_ids = p.drafter.tokenizer(prompt, add_special_tokens=special)["input_ids"]
    tsession: Any = p.target.begin(prompt_ids)  # a VLLMTarget session: it streams engine steps
    rounds = EngineRounds(p)
    context, last = len(prompt_ids), time.perf_counter()
    try:
        for tokens in tsession.steps(
            max_new_tokens, rounds, drafter_ids, rule=None if rule.mode == "greedy" else rule
        ):
            now = time.perf_counter()
            record = rounds.records.popleft() if rounds.records else None
            if record is None or record.emitted != len(tokens):
                record = RoundRecord(
                    context=context,
                    drafted=0,
                    proposed=0,
                    accepted=0,
                    emitted=len(tokens),
                    from_cache=0,
                    t_draft=0.0,
                    t_translate=0.0,
                    t_verify=now - last,
                    t_resync=0.0,
                )
            yield tokens, replace(record, context=context)
            context, last = context + len(tokens), now
    finally:
        tsession.close()
