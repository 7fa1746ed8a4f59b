"""The round loop, in one place: draft -> translate -> verify -> commit -> learn.

`open_request` starts a request's drafting side (`Request`: all its per-request state, typed);
`propose` makes one round's proposal in target ids (a retrieved continuation, or a model draft
translated and run on into one); `settle` applies the target's verdict (the drafter rolls back and
re-syncs, the n-gram cache learns, the retrieval index and acceptance statistics see the round,
the next draft length is chosen). `run` is the whole loop against a target session. The pairing
(`Pairing.generate`, `stream`, `chat`) and llama.cpp's draft-model hook (llamacpp/hook.py, where
llama.cpp verifies) both drive these functions; neither has a copy of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch

from .draft.picking import NO_DRAFT, Adaptable, Draft
from .draft.session import DraftSession
from .retrieve.retriever import NO_RENT, Rent
from .rounds import decode_alone, draft_rows, relaxation, within_budget
from .stats import RoundRecord
from .translate.translator import Proposal, Source

if TYPE_CHECKING:
    from .adaptive.acceptance_head import Stopper
    from .pairing import Pairing
    from .retrieve import ContextIndex
    from .target import Rule

__all__ = [
    "Request",
    "Round",
    "begin_round",
    "observe",
    "open_request",
    "propose",
    "request_rounds",
    "run",
    "settle",
]


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


@dataclass
class Request:
    """A request's drafting state between rounds. `ids`: the target session, or anything with the
    committed target ids as `.ids`; `last`: the drafter context's last token, which token healing
    may let the next draft replace; `k`: the next draft length (0: no model draft); `idle`: the
    last round did not draft (the next draft also catches the drafter up: not a drafting cost)."""

    target: Any
    drafts: DraftSession
    rule: Rule
    index: ContextIndex | None
    generator: torch.Generator | None
    k: int
    stopper: Stopper | None
    last: int
    rent: Rent  # the deferred read of the prompt (retrieve/retriever.py); NO_RENT: none
    produced: int = 0
    idle: bool = False
    pending: tuple[int, float, int, float, float] | None = (
        None  # the last round's costs, observed at the next
    )


def open_request(
    p: Pairing,
    target: Any,
    prompt_ids: list[int],
    drafter_ids: list[int],
    rule: Rule,
    generator: torch.Generator | None = None,
) -> Request:
    """A request's drafting side: the drafter session (with the pairing's adapter), the retrieval
    index, the first draft length and the acceptance head's stopping rule."""
    with p._book:  # begin() also moves the shared acceptance history
        index = p.retriever.begin(prompt_ids) if p.retriever is not None and p.free_drafts else None
        k, stopper = p.lengths.begin_request()
    if isinstance(p.drafter, Adaptable):  # a fake or an exported graph has no adapters
        p.drafter.activate(p.adapter)
    deferral = p.retriever.deferral if index is not None else None  # the drafter's read, deferred
    return Request(
        target,
        p.drafter.begin(drafter_ids),
        rule,
        index,
        generator,
        k if p.model_drafts else 0,
        stopper,
        drafter_ids[-1] if drafter_ids else -1,
        deferral.begin(len(target.ids)) if deferral is not None else NO_RENT,
    )


def propose(
    p: Pairing, req: Request, k: int, room: int, free: bool = True, started: float | None = None
) -> Round:
    """This round's proposal, at most `room` tokens: retrieved (when `free` and the planner says
    so), else a model draft of up to `k` tokens translated and run on into a retrieved continuation.
    `started`: when the round began (default: now); its draft time counts from there."""
    started = time.perf_counter() if started is None else started
    translator, mode = p.translator, req.rule.mode
    only = {"exact": "direct", "omnidraft": "aligned"}.get(mode, "any")
    index = req.index if free else None
    used = None
    if index is not None:
        with p._book:
            used = p.retriever.plan(
                index, p.cost, p.policy.last_rates if p.policy else {}, room, drafting=k > 0
            )
    if used is not None:  # a retrieved draft: no drafter forward this round
        draft, drafted = NO_DRAFT, time.perf_counter()
        with p._book:
            proposal = translator.translate([], only=only).then(used.candidate.ids[: used.length])
    else:
        draft = NO_DRAFT if k == 0 else _draft(p, req, k)
        drafted = time.perf_counter()
        skip = len(p.drafter.token_bytes.table[req.last]) if draft.healed else 0
        with p._book:
            proposal = translator.translate(draft.ids, only=only, skip=skip)
            proposal = proposal.cut(min(len(proposal), room))
            if index is not None:
                proposal, used = p.retriever.extend(index, proposal, room)
    modeled = len(proposal) - proposal.retrieved  # proposed tokens that came from the model
    q = draft_rows(translator, proposal, modeled, draft) if only != "any" and len(proposal) else None
    return Round(draft, proposal, used, q, started, drafted)


def _draft(p: Pairing, req: Request, k: int) -> Draft:
    """One draft: up to k tokens (k_max once the head decides), stopped by the head or, until it
    decides, by the drafter's confidence; healed when the target's last committed token lets a
    longer drafter token replace the drafter context's `last` (greedy and match: where lossless)."""
    k, stop_confidence, extra = p.lengths.for_draft(k, req.stopper)
    ids = req.target.ids
    if p.healer is not None and ids and req.rule.mode in ("greedy", "match"):
        heal = p.healer.candidates(req.last, p.target.token_bytes.table[ids[-1]])
        if heal is not None:
            extra["heal"] = heal
    allowed = p._shared if req.rule.mode == "exact" else None
    return req.drafts.propose(
        k,
        temperature=req.rule.temperature,
        allowed=allowed,
        generator=req.generator,
        stop_confidence=stop_confidence,
        **extra,
    )


def settle(p: Pairing, req: Request, rnd: Round, new: list[int], accepted: int) -> int:
    """After the verdict (`new`: the committed target ids, `accepted` proposed tokens among them):
    the drafter keeps what matches the committed text and re-encodes the rest, the n-gram cache
    learns, the retrieval index and stats see the round, and the next draft length is chosen (into
    `req`). Returns how many accepted tokens were retrieved ones."""
    draft, proposal = rnd.draft, rnd.proposal
    retrieved = rnd.retrieved_among(accepted)
    with p._book:
        held = (
            p.drafter.token_bytes.table[req.last] if draft.healed else b""
        )  # committed bytes the draft starts with
        keep, tail = p.translator.resync(draft.ids, held + p.target.token_bytes.join(new))
        p.translator.learn(draft.ids[:keep] + tail, new, skip=len(held))
        req.drafts.commit(keep, tail)
        if req.index is not None:
            req.index.commit(new)
            p.retriever.observe(rnd.used, len(proposal), accepted)
        if p.model_drafts:
            modeled = len(proposal) - proposal.retrieved
            req.k = p.lengths.next(req.k, req.stopper, len(draft.ids), modeled, accepted - retrieved, keep)
    req.last = (draft.ids[:keep] + tail or [req.last])[-1]
    return retrieved


def observe(req: Request, rnd: Round, verify_s: float, verified: int) -> None:
    """Queue the round's costs (`verified` tokens scored in `verify_s`); `begin_round` observes them
    when the next round starts, so a round's overhead includes everything between two rounds. A
    draft right after rounds without one first caught the drafter up on the tokens committed
    meanwhile: not a drafting cost."""
    drafted = 0 if req.idle else len(rnd.draft.ids)
    req.pending = (drafted, rnd.drafted - rnd.started, verified, verify_s, rnd.started)
    req.idle = not rnd.draft.ids


def begin_round(p: Pairing, req: Request, now: float) -> None:
    """A new round starts at `now`: the cost model observes the previous round's costs."""
    if req.pending is not None:
        drafted, t_draft, verified, t_verify, started = req.pending
        with p._book:
            p.cost.observe(drafted, t_draft, verified, t_verify, (now - started) - t_draft - t_verify)
        req.pending = None


def run(
    p: Pairing, req: Request, max_new_tokens: int, topk: int = 0, rows: list | None = None
) -> Iterator[tuple[list[int], RoundRecord]]:
    """Algorithm 1's rounds against the target session `req.target`: propose, verify, settle,
    until `max_new_tokens` or EOS. `rows`: the target's top-k rows, kept for distillation when
    `topk` > 0. The first round also prefills the prompt: its verify is not a verification cost."""
    tsession, first = req.target, True
    while req.produced < max_new_tokens:
        t0 = time.perf_counter()
        begin_round(p, req, t0)
        model, free = p.plan.at(p.target, len(tsession.ids))  # what can pay at this context
        defer = model and req.k > 0 and req.rent.defer(p.policy.last_rates if p.policy else {}, req.produced)
        room, ask = within_budget(
            tsession, max_new_tokens - req.produced - 1, req.k if model and not defer else 0
        )
        if (
            room == 0 < max_new_tokens - req.produced - 1
        ):  # the server takes no draft now: it decodes the rest
            yield from decode_alone(tsession, max_new_tokens - req.produced)
            return
        rnd = propose(p, req, ask, room, free, started=t0)
        t2 = time.perf_counter()
        context = len(tsession.ids)
        verdict = tsession.verify(
            rnd.proposal.ids,
            req.rule,
            rnd.q,
            req.generator,
            topk=topk,
            **relaxation(p.config, req.rule, rnd.proposal),
        )
        t3 = time.perf_counter()
        new = tsession.ids[context:]
        eos = next((i for i, t in enumerate(new) if t in p.target.eos_ids), None)
        if eos is not None:
            new = new[: eos + 1]
        if topk and rows is not None:
            rows.append((verdict.topk[0][: len(new)], verdict.topk[1][: len(new)]))
        retrieved = settle(p, req, rnd, new, verdict.accepted)
        with p._book:
            req.rent.settle(
                defer,
                len(new),
                None if first else t3 - t0,
                len(rnd.draft.ids),
                rnd.drafted - t0,
                p.cost.draft,
                req.produced,
            )
        t4 = time.perf_counter()
        req.produced += len(new)
        if first:
            req.idle = not rnd.draft.ids
        else:
            observe(req, rnd, t3 - t2, len(rnd.proposal) + 1)
        first = False
        proposal = rnd.proposal
        yield (
            new,
            RoundRecord(
                context=context,
                drafted=len(rnd.draft.ids),
                proposed=len(proposal),
                accepted=verdict.accepted,
                emitted=len(new),
                from_cache=sum(1 for s in proposal.sources[: verdict.accepted] if s == Source.NGRAM),
                t_draft=rnd.drafted - t0,
                t_translate=t2 - rnd.drafted,
                t_verify=t3 - t2,
                t_resync=t4 - t3,
                retrieved=proposal.retrieved,
                retrieved_accepted=retrieved,
            ),
        )
        if new and new[-1] in p.target.eos_ids:
            return


def request_rounds(
    p: Pairing,
    prompt: str,
    rule: Rule,
    max_new_tokens: int,
    generator: torch.Generator | None,
    alone: bool,
    special: bool,
    rows: list,
) -> Iterator[tuple[list[int], RoundRecord]]:
    """One request's rounds from its prompt: the target session opened (and closed after), then
    the target decoding alone (`alone`) or `run`. `special`: the tokenizers add their special
    tokens (BOS) to `prompt`."""
    prompt_ids = p.target.tokenizer(prompt, add_special_tokens=special)["input_ids"]
    tsession = p.target.begin(prompt_ids)
    try:
        if alone:  # the target decodes the whole request on its side: no draft at all
            yield from decode_alone(tsession, max_new_tokens)
            return
        drafter_ids = p.drafter.tokenizer(prompt, add_special_tokens=special)["input_ids"]
        request = open_request(p, tsession, prompt_ids, drafter_ids, rule, generator)
        topk = p.learner.config.topk if p.learner is not None else 0
        yield from run(p, request, max_new_tokens, topk, rows)
    finally:
        if (close := getattr(tsession, "close", None)) is not None:
            close()  # a remote session frees its server-side KV cache now
