"""The round loop, in one place: propose -> verify -> settle (draft, translate, verify, commit,
learn).

`open_request` starts a request's drafting side (`Request`: all its per-request state, typed).
Each round, the pairing's `RoundPolicy` (round_policy.py) says what to propose, a proposer
(proposers.py: model drafts, retrieved drafts, their combination) proposes it in target ids, the
target session verifies, and the policy settles the verdict. `run` is the whole loop against a
target session; llama.cpp's draft-model hook (llamacpp/hook.py), where llama.cpp verifies, drives
the same policy and proposers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ..draft.picking import Adaptable
from ..draft.session import DraftSession
from ..retrieve.retriever import NO_RENT, Rent
from ..translate.translator import Source
from .proposers import propose
from .round_policy import RoundPolicy
from .rounds import decode_alone, relaxation
from .stats import RoundRecord

if TYPE_CHECKING:
    from ..adaptive.acceptance_head import Stopper
    from ..pairing import Pairing
    from ..retrieve import ContextIndex
    from ..target import Rule

__all__ = ["Request", "open_request", "request_rounds", "run"]


@dataclass
class Request:
    """A request's drafting state between rounds. `target`: the target session, or anything with
    the committed target ids as `.ids`; `last`: the drafter context's last token, which token healing
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
    pending: tuple[int, float, int, float, float] | None = None  # the last round's costs, observed next


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
    with p.shared_lock:  # begin() also moves the shared acceptance history
        index = p.retriever.begin(prompt_ids) if p.retriever is not None and p.free_drafts else None
        k, stopper = p.lengths.begin_request()
    if isinstance(p.drafter, Adaptable):  # a fake or an exported graph has no adapters
        p.drafter.activate(p.adapter)
    deferral = None  # the drafter's read, deferred
    if index is not None and p.retriever is not None:
        deferral = p.retriever.deferral
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


def run(
    p: Pairing, req: Request, max_new_tokens: int, topk: int = 0, rows: list | None = None
) -> Iterator[tuple[list[int], RoundRecord]]:
    """Algorithm 1's rounds against the target session `req.target`: propose, verify, settle,
    until `max_new_tokens` or EOS. `rows`: the target's top-k rows, kept for distillation when
    `topk` > 0. The first round also prefills the prompt: its verify is not a verification cost."""
    tsession, first, policy = req.target, True, RoundPolicy(p)
    while req.produced < max_new_tokens:
        t0 = time.perf_counter()
        policy.begin_round(req, t0)
        plan = policy.plan(req, max_new_tokens - req.produced)
        if plan is None:  # the server takes no draft now: it decodes the rest
            yield from decode_alone(tsession, max_new_tokens - req.produced)
            return
        rnd = propose(p, req, plan.k, plan.room, plan.retrieve, started=t0)
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
        if topk and rows is not None and verdict.topk is not None:
            chosen = verdict.chosen[: len(new)] if verdict.chosen is not None else None
            rows.append((verdict.topk[0][: len(new)], verdict.topk[1][: len(new)], chosen))
        retrieved = policy.settle(req, rnd, new, verdict.accepted)
        policy.settle_rent(req, plan, rnd, len(new), None if first else t3 - t0)
        t4 = time.perf_counter()
        req.produced += len(new)
        if first:
            req.idle = not rnd.draft.ids
        else:
            policy.observe(req, rnd, t3 - t2, len(rnd.proposal) + 1)
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
    mode: str,
    special: bool,
    rows: list,
    logprobs: int = 0,
) -> Iterator[tuple[list[int], RoundRecord]]:
    """One request's rounds from its prompt: the target session opened (and closed after), then
    the target decoding alone (`mode` "alone") or `run` ("speculate"). `special`: the tokenizers
    add their special tokens (BOS) to `prompt`. `rows` collects the target's top-k rows of every
    round, as wide as distillation or `logprobs` (the caller's per-token log-probabilities) needs."""
    prompt_ids = p.target.tokenizer(prompt, add_special_tokens=special)["input_ids"]
    tsession = p.target.begin(prompt_ids)
    try:
        if mode == "alone":  # the target decodes the whole request on its side: no draft at all
            yield from decode_alone(tsession, max_new_tokens)
            return
        drafter_ids = p.drafter.tokenizer(prompt, add_special_tokens=special)["input_ids"]
        request = open_request(p, tsession, prompt_ids, drafter_ids, rule, generator)
        topk = max(p.learner.config.topk if p.learner is not None else 0, logprobs)
        yield from run(p, request, max_new_tokens, topk, rows)
    finally:
        tsession.close()  # a remote session frees its server-side KV cache now
