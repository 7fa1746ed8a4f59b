"""The round loop: propose -> verify -> commit, for targets verified call by call.

A request's `Speculation` (speculation.py) proposes each round (its policy sizes it, its proposer
fills it), the target session verifies, and the speculation commits the verdict. Engines
that verify in their own step drive the same speculation through `EngineProposals` (engine_proposals.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator, cast

from . import overlap
from .rounds import decode_alone, relaxation, through_eos
from .speculation import Speculation
from .stats import RoundRecord, round_record

if TYPE_CHECKING:
    from ..target import DecodingSession
    from .request import Request
    from .speculator import Speculator

__all__ = ["alone_rounds", "request_rounds", "run"]


def run(
    s: Speculator, spec: Speculation, max_new_tokens: int, topk: int = 0, rows: list | None = None
) -> Iterator[tuple[list[int], RoundRecord]]:
    """Algorithm 1's rounds against the target session `spec.request.session`, until
    `max_new_tokens` or EOS. `rows`: the target's top-k rows, kept for distillation when `topk` > 0.
    The first round also prefills the prompt: its verify is not a verification cost."""
    tsession, eos_ids = spec.request.session, s.target.eos_ids
    # where the floor stands aside the target decodes alone: greedy, and no rows asked of a round
    greedy = spec.request.rule.mode == "greedy"
    spec.request.may_decode = greedy and topk == 0 and s.target.capabilities.decodes_alone
    while spec.produced < max_new_tokens:
        remaining = max_new_tokens - spec.produced
        rnd = spec.propose(remaining)
        if rnd is None:  # no draft now (the server's budget, or the floor): the target decodes alone
            n, began, new, first = spec.aside(remaining), time.perf_counter(), [], None
            for ids, record in decode_alone(cast("DecodingSession", tsession), n):  # (may_decode)
                new += ids
                first = record.t_verify if first is None else first
                yield ids, record
            if len(new) < n or n == remaining or (new and new[-1] in eos_ids):
                return
            spec.decoded(new, began, first)
            continue
        context, asked = len(tsession.ids), time.perf_counter()
        relax = relaxation(s.config, spec.request.rule, rnd.proposal)
        verdict = tsession.verify(
            rnd.proposal.ids, spec.request.rule, rnd.q, spec.request.generator, topk=topk, **relax
        )
        answered = time.perf_counter()
        new = tsession.ids[context:]
        new = through_eos(new, eos_ids)
        if topk and rows is not None and verdict.topk is not None:
            chosen = verdict.chosen[: len(new)] if verdict.chosen is not None else None
            rows.append((verdict.topk[0][: len(new)], verdict.topk[1][: len(new)], chosen))
        spec.commit(new, verdict.accepted, answered - asked, answered)
        resync = time.perf_counter() - answered
        yield new, round_record(rnd, context, new, verdict.accepted, answered - asked, resync)
        if new and new[-1] in eos_ids:
            return


def request_rounds(s: Speculator, request: Request, rows: list) -> Iterator[tuple[list[int], RoundRecord]]:
    """One request's rounds from its prompt: the target session opened (and closed after), then
    `run`. `rows` collects the target's top-k rows of every round, as wide as distillation or
    `request.logprobs` (the caller's per-token log-probabilities) needs. Where the target verifies on
    threads of its own, a greedy request drafts beside its verifies instead (overlap.py)."""
    topk = max(s.learner.config.topk if s.learner is not None else 0, request.logprobs)
    if overlap.overlaps(s, request, topk):
        yield from overlap.run(s, request)
        return
    tsession = s.target.begin(request.target_ids(s.target))
    try:
        spec = Speculation(
            s, tsession, tsession.ids, request.ids_for(s.drafter), request.rule, request.generator
        )
        try:
            yield from run(s, spec, request.max_new_tokens, topk, rows)
        finally:
            spec.close()
    finally:
        tsession.close()  # a remote session frees its server-side KV cache now


def alone_rounds(s: Speculator, request: Request, rows: list) -> Iterator[tuple[list[int], RoundRecord]]:
    """One request the target decodes whole on its side (greedy): no draft at all."""
    tsession = s.target.begin(request.target_ids(s.target))
    try:
        yield from decode_alone(cast("DecodingSession", tsession), request.max_new_tokens)  # (decodes_alone)
    finally:
        tsession.close()
