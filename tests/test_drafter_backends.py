"""A drafter backend of one's own, defined here alone: a `Drafter` whose `Stream` recomputes the
whole sequence each call (no KV cache). The drafting loop, healing, rollback and translation are
the SDK's (draft/session.py); the backend only gives logits (docs/architecture.md)."""

from __future__ import annotations

import torch

from omnidraft.draft.base import Drafter

from .conftest import target_greedy, tiny_llama

PROMPTS = ["def add(a, b):\n    return", "The cat sat on the", "x"]


class RecomputeStream:
    """One token sequence on a model, recomputed whole at each `logits` call."""

    gives_hidden = False

    def __init__(self, model: torch.nn.Module, ids: list[int]) -> None:
        self.model, self.ids = model, list(ids)

    def extend(self, ids: list[int]) -> None:
        self.ids += ids

    def crop(self, n: int) -> None:
        del self.ids[n:]

    def logits(self, rows: int = 1, *, hidden: bool = False) -> tuple[torch.Tensor, None]:
        with torch.no_grad():
            out = self.model(torch.tensor([self.ids])).logits[0, -rows:]
        return out.float(), None


class RecomputeDrafter(Drafter):
    backend = "recompute"

    def __init__(self, model: torch.nn.Module, tokenizer, name: str) -> None:
        self.model, self.name = model.eval(), name
        self._init_vocabulary(tokenizer, model.config.vocab_size)

    def stream(self, ids: list[int]) -> RecomputeStream:
        return RecomputeStream(self.model, ids)


def test_a_drafter_backend_of_ones_own_drafts_for_any_target_losslessly(draft_tokenizer, tiny_target):
    drafter = RecomputeDrafter(
        tiny_llama(len(draft_tokenizer), seed=2, logit_scale=30.0), draft_tokenizer, "mine"
    )
    pair = drafter.pair(tiny_target, k=4)
    for prompt in PROMPTS:
        out = pair.generate(prompt, max_new_tokens=20)
        assert out.token_ids == target_greedy(tiny_target, prompt, 20), prompt
        assert sum(r.drafted for r in out.rounds) > 0
