"""Rounds that an engine verifies: omnidraft proposes, the engine's own speculative step checks.

llama-cpp-python's `draft_model` hook (llamacpp/hook.py), vLLM's proposer inside its engine step
(targets/vllm_proposer.py) and a device drafting for a server's engine (targets/remote_stream.py) call a
proposer with the committed ids of one sequence and verify what comes back themselves.
`EngineProposals` adapts that to the sequence's `Speculation` (speculation.py), the same state machine
the round loop drives: each call infers the last round's verdict from the ids (the accepted prefix
of its proposal, then the engine's token), commits it, and proposes again. Where the measured costs
say drafting cannot pay, it proposes nothing and the engine decodes alone.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterator, cast

from ..target import Rule, SessionBase
from .contract import Round
from .speculation import Speculation
from .stats import RoundRecord, round_record
from .verify import accepted_prefix

if TYPE_CHECKING:
    from ..target import EngineSession
    from .request import Request
    from .speculator import Speculator

__all__ = ["Committed", "EngineProposals", "request_rounds"]

GREEDY = Rule()


class Committed(SessionBase):
    """The stand-in target session a speculation reads where the engine verifies in its own step:
    the committed ids (the engine's verdicts arrive in them, never through `verify`)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def verify(
        self, proposal: Any, rule: Rule, q: Any = None, generator: Any = None, *, topk: int = 0
    ) -> Any:
        raise TypeError("an engine verifies these rounds in its own step: nothing verifies them here")


class EngineProposals:
    """One sequence's rounds of `speculator` while an engine verifies them. With `keep`, each
    proposal is kept by the context it was made at, for whoever reads the engine's steps (`record`).
    `prefills`: the first round's verify also read the prompt, so it is not booked as a round
    (decode/overlap.py, whose first verify is the prompt's prefill); an engine has read it before."""

    def __init__(self, speculator: Speculator, *, keep: bool = False, prefills: bool = False) -> None:
        self.speculator, self.keep, self.prefills = speculator, keep, prefills
        self.spec: Speculation | None = None
        self.proposals: dict[int, Round] = {}  # by context, while `keep`; the reader takes them
        self._ids: list[int] = []
        self._growable = False  # whether the last proposal is a model draft the drafter may draft on
        self.calls = self.proposed = 0

    def open(self, ids: list[int], drafter_ids: list[int] | None = None) -> None:
        """A new sequence over the committed `ids`; `drafter_ids`: the drafter's own encoding of
        its text (by default the ids' bytes re-encoded, without special tokens)."""
        s = self.speculator
        if self.spec is not None:
            self.spec.close()
        if drafter_ids is None:
            text = s.target.token_bytes.join(ids).decode("utf-8", errors="replace")
            drafter_ids = s.drafter.tokenizer(text, add_special_tokens=False)["input_ids"]
        self._committed = Committed(list(ids))
        self.spec = Speculation(s, self._committed, list(ids), drafter_ids, GREEDY, prefills=self.prefills)
        self._ids = list(ids)
        self.proposals.clear()

    def prepare(self, ids: list[int]) -> None:
        """Nothing to do before `next`: the drafter is here."""

    def extends(self, ids: list[int]) -> bool:
        """Whether `ids` continue this sequence (the ids of its last call, then more)."""
        n = len(self._ids)
        return self.spec is not None and len(ids) > n and ids[:n] == self._ids

    @property
    def token_s(self) -> float | None:
        """Seconds per drafted token on this machine, as measured so far (None before)."""
        return self.speculator.cost.draft

    def next(self, ids: list[int], limit: int, remaining: int, *, k: int | None = None) -> list[int]:
        """The proposal (target ids, at most `limit`) after the committed `ids`, which extend the
        last call's; `remaining`: tokens the sequence may still produce. `k` drafts that many
        tokens whatever the pairing's draft-length policy says (a device drafting ahead for a
        server's engine: its drafting is off the server's path, the server's budget decides)."""
        now, spec = time.perf_counter(), self.spec
        if spec is None:
            raise RuntimeError("next() before open(): no sequence")
        rnd = spec.round
        if rnd is not None:  # the engine verified it since it went back: the verdict is in the ids
            new = ids[len(self._ids) :]
            spec.commit(new, accepted_prefix(rnd.proposal.ids.tolist(), new), now - rnd.ready, now)
        self._ids = self._committed.ids = list(ids)
        rnd = spec.propose(max(1, remaining), limit=limit, k=k)
        assert rnd is not None  # with `limit`, an empty round rather than none
        self._growable = rnd.grows and len(rnd.draft.ids) >= spec.budget.k
        if self.keep:
            self.proposals[len(ids)] = rnd
        self.calls += 1
        self.proposed += len(rnd.proposal)
        return [int(t) for t in rnd.proposal.ids.tolist()]

    def extend(self, k: int, limit: int) -> list[int] | None:
        """The last proposal with its model draft drafted `k` tokens further (at most `limit` target
        ids in all), while the engine has not yet answered it: a device drafting ahead of a server.
        None where it cannot grow: a retrieved proposal, or a draft the drafter stopped itself
        (a stop token, low confidence)."""
        spec = self.spec
        if spec is None or spec.round is None or not self._growable or len(spec.round.proposal) >= limit:
            return None
        before = spec.round
        longer = spec.extend(k, limit)
        if longer is None or len(longer.draft.ids) < len(before.draft.ids) + k:
            self._growable = False  # the drafter stopped (a stop token, low confidence)
        if longer is None:
            return None
        if self.keep:
            self.proposals[len(self._ids)] = longer
        self.proposed += len(longer.proposal) - len(before.proposal)
        return [int(t) for t in longer.proposal.ids.tolist()]

    def resume(self) -> None:
        """Let the last proposal grow again after its draft stopped at a token of low confidence
        (not a stop token): the server has committed part of it since, so the uncertain token is
        within its next verify, and a continuation drafted now is there if it is accepted."""
        if self.spec is not None and self.spec.round is not None:
            self._growable = self.spec.may_resume()

    def record(self, context: int, tokens: list[int], t_verify: float) -> RoundRecord:
        """The record of an engine step that committed `tokens` after `context` ids: the round
        proposed there (kept with `keep`), or, where none was, the engine decoding alone."""
        rnd = self.proposals.pop(context, None)
        if rnd is None:
            return round_record(None, context, tokens, 0, t_verify)
        return round_record(
            rnd, context, tokens, accepted_prefix(rnd.proposal.ids.tolist(), tokens), t_verify
        )


def request_rounds(s: Speculator, request: Request, rows: list) -> Iterator[tuple[list[int], RoundRecord]]:
    """One request, greedy or match-sampled, on a target whose engine verifies the pairing's drafts
    in its own step (`drafts_in_engine`: vLLM with omnidraft's proposer; a sampled request through
    vLLM's rejection sampler, which takes each proposal as one-hot); the same signature as
    round_loop.request_rounds (no rows: no log-probabilities here). One (ids, record) per engine
    step: the step's committed ids and the round that proposed them (a step without a proposal:
    the engine decoding alone)."""
    rule, max_new_tokens = request.rule, request.max_new_tokens
    if rule.mode not in ("greedy", "match") or request.logprobs:
        raise ValueError(
            "engine rounds serve greedy or match-sampled requests without log-probabilities only"
        )
    prompt_ids, drafter_ids = request.target_ids(s.target), request.ids_for(s.drafter)
    tsession = cast("EngineSession", s.target.begin(prompt_ids))  # (a target that drafts_in_engine)
    source = EngineProposals(s, keep=True)
    context, last = len(prompt_ids), time.perf_counter()
    try:
        for tokens in tsession.steps(
            max_new_tokens, source, drafter_ids, rule=None if rule.mode == "greedy" else rule
        ):
            now = time.perf_counter()
            yield tokens, source.record(context, tokens, now - last)
            context, last = context + len(tokens), now
    finally:
        tsession.close()
