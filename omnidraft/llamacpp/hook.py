"""omnidraft's drafting inside llama-cpp-python's own speculative decoding.

    from llama_cpp import Llama
    hook = OmnidraftDraftModel(od.Drafter.load("smollm2-135m"), od.LlamaCppTarget("qwen2.5-coder-1.5b"))
    llm = Llama(model_path=str(od.presets.gguf_path("qwen2.5-coder-1.5b")), draft_model=hook)

`Llama.generate` calls its `draft_model` with every committed id (prompt, output, and the token
it just sampled) and verifies what comes back itself. The hook infers each round's verdict from the
next call (the ids after the last call's context: the accepted prefix of its proposal, then the
target's token), settles it with the pairing's own `RoundPolicy` (round_policy.py: drafter rolled
back and re-synced, n-gram cache, retrieval index and statistics, costs, next draft length), and
proposes again through the pairing's proposers (proposers.py): model drafts translated into the
target's ids, retrieved continuations, or both (`drafts=`). A call whose ids do not extend the last
call's starts a new request. Where the measured costs say drafting cannot pay, it returns no draft
and llama.cpp decodes alone. One generation at a time per hook.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from llama_cpp.llama_speculative import LlamaDraftModel

from ..proposers import Round, propose
from ..round_loop import Request, open_request
from ..round_policy import RoundPlan, RoundPolicy
from ..target import Rule

__all__ = ["OmnidraftDraftModel"]

GREEDY = Rule()


class _Committed:
    """The stand-in target session the round loop reads: the committed ids."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class OmnidraftDraftModel(LlamaDraftModel):
    """An omnidraft drafter as llama-cpp-python's `draft_model`. `target` describes the model
    llama.cpp runs (its tokenizer and byte view: a `LlamaCppTarget` on the same GGUF file, whose
    `rows_at` also caps a draft so that llama.cpp's one-call verification stays bit-exact);
    `options` go to `DecodeConfig` (drafts="hybrid" | "model" | "retrieval", k, ...). Build the
    `Llama` with `loading.open_llama(path, draft_model=hook)` so it runs as the target does."""

    def __init__(self, drafter: Any, target: Any, *, max_draft: int = 16, **options: Any) -> None:
        from ..draft.base import pair

        self.pairing = pair(drafter, target, **options)
        # llama-cpp-python verifies a draft in one call: keep it within what this engine evaluates
        # exactly at the context's length (no draft where no batch is exact)
        self.engine = getattr(target, "engine", None)
        self.max_draft = max_draft
        self._ids: list[int] | None = None
        self.policy = RoundPolicy(self.pairing)
        self.request: Request | None = None
        self._round: Round | None = None
        self._plan: RoundPlan | None = None
        self._returned = 0.0  # when the last proposal went back to llama.cpp
        self.calls = self.proposed = 0

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        now = time.perf_counter()
        ids = [int(t) for t in input_ids]
        p = self.pairing
        if (
            self.request is None
            or self._ids is None
            or len(ids) <= len(self._ids)
            or ids[: len(self._ids)] != self._ids
        ):
            self._open(ids)
        else:
            self._settle(ids[len(self._ids) :], now)
        self._ids = ids
        req = self.request
        assert req is not None
        req.target = _Committed(ids)
        started = time.perf_counter()
        self.policy.begin_round(req, started)
        # llama.cpp verifies a draft in one call: at most what it evaluates exactly at this context
        most = (
            self.max_draft
            if self.engine is None
            else min(self.max_draft, self.engine.rows_at(len(ids) - 1) - 1)
        )
        plan = self.policy.plan(req, self.max_draft + 1)
        plan = RoundPlan(0, 0, False, False) if plan is None else plan
        room = max(0, min(plan.room, most))
        self._plan = RoundPlan(plan.k if room > 0 else 0, room, plan.retrieve, plan.defer)
        self._round = propose(p, req, self._plan.k, room, plan.retrieve, started)
        self.calls += 1
        self.proposed += len(self._round.proposal)
        self._returned = time.perf_counter()
        return np.asarray(self._round.proposal.ids.tolist(), dtype=np.intc)

    def _open(self, ids: list[int]) -> None:
        p = self.pairing
        text = p.target.token_bytes.join(ids).decode("utf-8", errors="replace")
        drafter_ids = p.drafter.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.request = open_request(p, _Committed(ids), ids, drafter_ids, GREEDY)
        self._round = None

    def _settle(self, new: list[int], now: float) -> None:
        """The last round's verdict, inferred: the accepted prefix of its proposal, then the target's
        token."""
        rnd, req = self._round, self.request
        if rnd is None or req is None:
            return
        proposed = rnd.proposal.ids.tolist()
        accepted = next((j for j, t in enumerate(proposed) if j >= len(new) or new[j] != t), len(proposed))
        self.policy.settle(req, rnd, new, accepted)
        if self._plan is not None:
            self.policy.settle_rent(req, self._plan, rnd, len(new), now - rnd.started)
        req.produced += len(new)
        # llama.cpp verified between the proposal's return and this call: that is the verify's time
        self.policy.observe(req, rnd, now - self._returned, len(proposed) + 1)
