"""omnidraft's drafting inside llama-cpp-python's own speculative decoding.

    from llama_cpp import Llama
    hook = OmnidraftDraftModel(od.Drafter.load("smollm2-135m"), od.LlamaCppTarget("qwen2.5-coder-1.5b"))
    llm = Llama(model_path=str(od.presets.gguf_path("qwen2.5-coder-1.5b")), draft_model=hook)

`Llama.generate` calls its `draft_model` with every committed id (prompt, output, and the token
it just sampled) and verifies what comes back itself. The hook infers each round's verdict from the
next call (the ids after the last call's context: the accepted prefix of its proposal, then the
target's token), settles it like the pairing's own loop (drafter rolled back and re-synced, n-gram
cache, retrieval index and statistics, next draft length), and proposes again: model drafts
translated into the target's ids, retrieved continuations, or both (`drafts=`). A call whose ids do
not extend the last call's starts a new request. Where the measured costs say drafting cannot pay,
it returns no draft and llama.cpp decodes alone. One generation at a time per hook.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from llama_cpp.llama_speculative import LlamaDraftModel

from ..target import Rule
from ..translate.translator import Source

__all__ = ["OmnidraftDraftModel"]

GREEDY = Rule()


class _Context:
    """The stand-in target session `propose_round` reads: the committed ids."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class OmnidraftDraftModel(LlamaDraftModel):
    """An omnidraft drafter as llama-cpp-python's `draft_model`. `target` describes the model
    llama.cpp runs (its tokenizer and byte view: a `LlamaCppTarget` on the same GGUF file, whose
    `rows_at` also caps a draft so that llama.cpp's one-call verification stays bit-exact);
    `options` go to `DecodeConfig` (drafts="hybrid" | "model" | "retrieval", k, ...). Build the
    `Llama` with `engine.open_llama(path, draft_model=hook)` so it runs as the target does."""

    def __init__(self, drafter: Any, target: Any, *, max_draft: int = 16, **options: Any) -> None:
        from ..pairing import pair

        self.pairing = pair(drafter, target, **options)
        # llama-cpp-python verifies a draft in one call: keep it within what this engine evaluates
        # exactly at the context's length (no draft where no batch is exact)
        self.engine = getattr(target, "engine", None)
        self.max_draft = max_draft
        self._ids: list[int] | None = None
        self._round: tuple[Any, ...] | None = None
        self.calls = self.proposed = 0

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        now = time.perf_counter()
        ids = [int(t) for t in input_ids]
        if self._ids is None or len(ids) <= len(self._ids) or ids[: len(self._ids)] != self._ids:
            self._open(ids)
        else:
            self._settle(ids[len(self._ids) :], now)
        self._ids = ids
        started = time.perf_counter()
        room = self.max_draft if self.engine is None else min(self.max_draft, self.engine.rows_at(len(ids) - 1) - 1)
        draft, proposal, used, _, t_draft = self.pairing.propose_round(
            _Context(ids), self.dsession, GREEDY, self.index, self.k if room > 0 else 0, self.stopper, self.last,
            max(0, room), None)
        self._round = (draft, proposal, used, t_draft - started, time.perf_counter())
        self.calls += 1
        self.proposed += len(proposal)
        return np.asarray(proposal.ids.tolist(), dtype=np.intc)

    def _open(self, ids: list[int]) -> None:
        p = self.pairing
        text = p.target.token_bytes.join(ids).decode("utf-8", errors="replace")
        self.dsession, self.index, self.last = p.open_drafts(ids, p.drafter.tokenizer(text, add_special_tokens=False)["input_ids"])
        self.k, self.stopper = p.first_k()
        self._idle = False

    def _settle(self, new: list[int], now: float) -> None:
        draft, proposal, used, t_draft, returned = self._round
        proposed = proposal.ids.tolist()
        accepted = next((j for j, t in enumerate(proposed) if j >= len(new) or new[j] != t), len(proposed))
        retrieved_accepted = sum(1 for s in proposal.sources[:accepted] if s == Source.RETRIEVED)
        # as in the pairing's loop: a draft right after rounds without one also caught the drafter up
        drafted = 0 if self._idle else len(draft.ids)
        self.pairing.cost.observe(drafted, t_draft, len(proposed) + 1, now - returned, 0.0)
        self._idle = not draft.ids
        self.last, self.k = self.pairing.settle_round(self.dsession, self.index, draft, proposal, used, new, accepted,
                                                      retrieved_accepted, self.last, self.k, self.stopper)
