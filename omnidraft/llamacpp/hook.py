"""omnidraft's drafting inside llama-cpp-python's own speculative decoding.

    from llama_cpp import Llama
    hook = OmnidraftDraftModel(od.Drafter.load("smollm2-135m"), od.LlamaCppTarget("qwen2.5-coder-1.5b"))
    llm = Llama(model_path=str(od.presets.gguf_path("qwen2.5-coder-1.5b")), draft_model=hook)

`Llama.generate` calls its `draft_model` with every committed id (prompt, output, and the token
it just sampled) and verifies what comes back itself. The hook's proposals come from `EngineProposals`
(engine_proposals.py, shared with vLLM's in-engine proposer): each call commits the last round's
inferred verdict to the request's speculation and proposes again through the pairing's proposer:
model drafts translated into the target's ids, retrieved continuations, or both (`drafts=`). A call
whose ids do not extend the last call's starts a new request. Where the measured costs say drafting
cannot pay, it returns no draft and llama.cpp decodes alone. One generation at a time per hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from llama_cpp.llama_speculative import LlamaDraftModel

from ..decode.engine_proposals import EngineProposals
from .llama_target import LlamaCppTarget

if TYPE_CHECKING:
    from ..target import Target

__all__ = ["OmnidraftDraftModel"]


class OmnidraftDraftModel(LlamaDraftModel):
    """An omnidraft drafter as llama-cpp-python's `draft_model`. `target` describes the model
    llama.cpp runs (its tokenizer and byte view: a `LlamaCppTarget` on the same GGUF file, whose
    `rows_at` also caps a draft so that llama.cpp's one-call verification stays bit-exact);
    `options` go to `DecodeConfig` (drafts="hybrid" | "model" | "retrieval", k, ...). Build the
    `Llama` with `loading.open_llama(path, draft_model=hook)` so it runs as the target does."""

    def __init__(self, drafter: Any, target: Target, *, max_draft: int = 16, **options: Any) -> None:
        from ..pairing import pair

        self.pairing = pair(drafter, target, **options)
        # llama-cpp-python verifies a draft in one call: keep it within what this engine evaluates
        # exactly at the context's length (no draft where no batch is exact)
        self.engine = target.engine if isinstance(target, LlamaCppTarget) else None
        self.max_draft = max_draft
        self.source = EngineProposals(self.pairing.speculator)

    @property
    def calls(self) -> int:
        return self.source.calls

    @property
    def proposed(self) -> int:
        return self.source.proposed

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        ids = [int(t) for t in input_ids]
        if not self.source.extends(ids):
            self.source.open(ids)
        # llama.cpp verifies a draft in one call: at most what it evaluates exactly at this context
        limit = (
            self.max_draft
            if self.engine is None
            else min(self.max_draft, self.engine.rows_at(len(ids) - 1) - 1)
        )
        return np.asarray(self.source.next(ids, limit, self.max_draft + 1), dtype=np.intc)
