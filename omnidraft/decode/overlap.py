"""Rounds whose next proposal is drafted while the target verifies this one (docs/overlap.md).

On a target whose verify runs on threads of its own and costs nearly what one decoding step costs
whatever the proposal's length (OpenVINO here), the drafter's own time is what a round adds to
decoding alone. Here the target verifies on a worker thread while the drafter, on the other
cores, drafts on past the proposal as if all of it were accepted (the drafter's next token
standing for the target's own); when the target's tokens follow the proposal, the next verify is
ready the moment this one ends, so a round costs max(draft, verify), not their sum.

The request's `Speculation` is driven through `EngineProposals` (engine_proposals.py), as a device
drafting for a server's engine drives it: a proposal stays one round while the committed ids
follow it, verified a piece at a time, and is committed (and the drafter re-synced) where the
target's tokens leave it; while the drafter drafts a new round the target decodes its next token,
for which the new draft's first token stands, so the target never waits for the drafter. The
floor (adaptive/floor.py) books those rounds as any others; where it stands aside, no round
drafts and the target decodes a token a verify. Greedy only: every committed token is the
target's own greedy token, as the round loop's.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Iterator

import torch

from ..llamacpp.loading import cpu_threads
from ..target import Rule
from .config import RELAXED
from .engine_proposals import EngineProposals
from .rounds import through_eos
from .stats import RoundRecord, round_record

if TYPE_CHECKING:
    from ..target import TargetSession
    from .request import Request
    from .speculator import Speculator

__all__ = ["overlaps", "run"]

GREEDY = Rule()
STEP = 1  # drafter tokens drafted between two looks at the verify in flight


def overlaps(s: Speculator, request: Request, topk: int) -> bool:
    """Whether `request` drafts beside its target's verifies: greedy, no rows asked of a verify, model
    drafts that can pay, a target that verifies on its own threads and a drafter that drafts on
    the cores those leave (`DecodeConfig.overlap` turns it off)."""
    threads = s.target.capabilities.verifies_beside
    return (
        s.config.overlap
        and s.config.mode != RELAXED
        and request.rule.mode == "greedy"
        and topk == 0
        and s.model_drafts
        and threads > 0
        and s.drafter.drafts_beside
        and cpu_threads() > threads
    )


def run(s: Speculator, request: Request) -> Iterator[tuple[list[int], RoundRecord]]:
    """One greedy request's rounds with the drafter drafting beside the target's verifies: one
    (committed ids, record) per verify, as round_loop.request_rounds yields them."""
    tsession = s.target.begin(request.target_ids(s.target))
    worker = ThreadPoolExecutor(1, thread_name_prefix="omnidraft-verify")
    s.drafter.use_threads(max(1, cpu_threads() - s.target.capabilities.verifies_beside))
    source = EngineProposals(s, prefills=True)
    try:
        yield from _rounds(s, source, tsession, worker, request)
    finally:
        if source.spec is not None:
            source.spec.close()
        worker.shutdown(wait=True)
        s.drafter.use_threads(None)
        tsession.close()


def _rounds(
    s: Speculator,
    source: EngineProposals,
    tsession: TargetSession,
    worker: ThreadPoolExecutor,
    request: Request,
) -> Iterator[tuple[list[int], RoundRecord]]:
    ids = list(tsession.ids)  # (the worker appends to the session's own)
    eos, prompt = s.target.eos_ids, len(ids)
    # the prompt's prefill and first token on the worker; the drafter reads its prompt meanwhile
    began = time.perf_counter()
    pending = worker.submit(_verify, tsession, [])
    source.open(ids, request.ids_for(s.drafter))
    assert source.spec is not None
    spec = source.spec
    spec.request.may_decode = s.target.capabilities.decodes_alone
    proposal, at, context = _propose(source, ids, request.max_new_tokens), prompt, prompt
    sent: list[int] = []
    first = True
    while True:
        accepted, done = pending.result()
        if first and spec.round is not None:  # the drafter's read of its prompt beside the prefill:
            rnd = spec.round  # only what it took past the prefill is its cost
            rnd.started = min(rnd.drafted, max(rnd.started, done))
        new = through_eos(tsession.ids[context:], eos)
        yield new, _record(context, len(sent), accepted, new, done - began)
        remaining = request.max_new_tokens - (len(tsession.ids) - prompt)
        if not new or new[-1] in eos or remaining <= 0:
            return
        context, first = len(tsession.ids), False
        left = _left(proposal, at, tsession.ids)
        began = time.perf_counter()
        if left is None:  # a new round: the target decodes its next token while the drafter drafts
            ids, sent = list(tsession.ids), []  # after the committed ones, its first token for that one
            pending = worker.submit(_verify, tsession, sent)
            proposal, at = _propose(source, ids, remaining), context
            want = 1 + max(1, spec.budget.k)
        else:
            source.resume()  # the proposal's last token may have been uncertain: it is verified now
            sent = left[: min(len(left), max(1, spec.budget.k), remaining - 1)]
            pending = worker.submit(_verify, tsession, sent)
            want = context - at + len(sent) + 1 + max(1, spec.budget.k)
        proposal = _draft_on(source, pending, proposal, want)


def _verify(tsession: TargetSession, sent: list[int]) -> tuple[int, float]:
    """The worker's part: verify `sent` after the committed ids (greedy); (accepted, when done)."""
    verdict = tsession.verify(torch.tensor(sent, dtype=torch.long), GREEDY)
    return verdict.accepted, time.perf_counter()


def _propose(source: EngineProposals, ids: list[int], remaining: int) -> list[int]:
    """A new round's proposal after `ids` (committing the last round's verdict, read off them)."""
    return source.next(list(ids), max(0, remaining - 1), remaining)


def _left(proposal: list[int], at: int, ids: list[int]) -> list[int] | None:
    """What of `proposal` (drafted after the first `at` ids) is left after `ids`; None where the
    ids left it or nothing of it is left."""
    done = len(ids) - at
    if done < 0 or ids[at:] != proposal[:done] or len(proposal) <= done:
        return None
    return proposal[done:]


def _draft_on(
    source: EngineProposals, pending: Future[tuple[int, float]], proposal: list[int], want: int
) -> list[int]:
    """While `pending` verifies, the drafter drafts `proposal` on, `STEP` tokens at a time, until
    the verify is done or the proposal holds `want` ids (the verify in flight, the target's token
    after it, for which the drafter's stands, and the next verify)."""
    while not pending.done() and len(proposal) < want:
        longer = source.extend(STEP, want)
        if longer is None:
            break
        proposal = longer
    return proposal


def _record(context: int, sent: int, accepted: int, new: list[int], seconds: float) -> RoundRecord:
    """One verify's record: `sent` proposed ids (drafted beside earlier verifies: no drafting time
    of its own), `accepted` of them, `new` committed, the verify's `seconds`."""
    return replace(round_record(None, context, new, 0, seconds), proposed=sent, accepted=accepted)
