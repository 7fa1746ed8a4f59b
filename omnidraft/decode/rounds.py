"""What the round drivers (round_loop.py, overlap.py, engine_proposals.py) and the speculation share:
the draft rows rejection sampling verifies against, the relaxed rule's keyword, a target decoding
alone, and a round's ids cut at the end of generation."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ..translate.translator import Proposal, Source, Translator
from .config import RELAXED
from .stats import RoundRecord, round_record

if TYPE_CHECKING:
    from ..target import DecodingSession

__all__ = ["decode_alone", "draft_rows", "relaxation", "through_eos"]


def draft_rows(translator: Translator, proposal: Proposal, modeled: int, draft: Any) -> torch.Tensor | None:
    """q' rows (M, Vt) for rejection sampling: the model tokens' from the drafter's distributions,
    a retrieved token's one-hot (it was proposed with certainty, so rejection sampling stays exact)."""
    parts = []
    if modeled:
        if draft.q is None:
            return None
        parts.append(translator.draft_probs(proposal.cut(modeled), draft.ids, draft.q))
    retrieved = proposal.ids[modeled:]
    if len(retrieved):
        parts.append(torch.nn.functional.one_hot(retrieved, len(translator.map.t2d)).float())
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def relaxation(config: Any, rule: Any, proposal: Proposal) -> dict[str, Any]:
    """The verify's keyword for relaxed-lossy verification (greedy requests only): which proposed
    tokens were retrieved, and the top-r they may be accepted within; empty otherwise."""
    if config.mode != RELAXED or rule.mode != "greedy" or not proposal.retrieved:
        return {}
    mask = torch.tensor([s == Source.RETRIEVED for s in proposal.sources], dtype=torch.bool)
    return {"relax": (mask, config.relaxed_top_r)}


def decode_alone(tsession: DecodingSession, max_new_tokens: int) -> Iterator[tuple[list[int], RoundRecord]]:
    """The target session decodes alone (greedy); one record per token, as one forward each."""
    context, last = len(tsession.ids), time.perf_counter()
    for token in tsession.decode(max_new_tokens):
        now = time.perf_counter()
        yield [token], round_record(None, context, [token], 0, now - last)
        context, last = context + 1, now


def through_eos(new: list[int], eos_ids: frozenset[int]) -> list[int]:
    """`new` up to and with its first end-of-generation token (all of it where none is)."""
    return new[: next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))]
