"""Same-process baselines: the target alone (greedy) and HF transformers' cross-tokenizer assisted
generation (`assistant_model=, tokenizer=, assistant_tokenizer=`), timed on the same prompts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Timed", "hf_assisted", "target_alone"]


@dataclass(frozen=True)
class Timed:
    token_ids: list[int]
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


def _generate(model: Any, encode: Any, prompt: str, max_new_tokens: int, eos: list[int], **extra: Any) -> Timed:
    ids = encode(prompt, return_tensors="pt")["input_ids"]
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **extra)
    return Timed(out[0, ids.shape[1]:].tolist(), time.perf_counter() - started)


def target_alone(target: Any, prompt: str, max_new_tokens: int) -> Timed:
    """The target's own greedy decoding, one token per forward (HF generate)."""
    return _generate(target.model, target.tokenizer, prompt, max_new_tokens, sorted(target.eos_ids))


def hf_assisted(target: Any, drafter: Any, prompt: str, max_new_tokens: int) -> Timed:
    """HF assisted generation with a drafter of another tokenizer (universal assisted decoding)."""
    return _generate(target.model, target.tokenizer, prompt, max_new_tokens, sorted(target.eos_ids),
                     assistant_model=drafter.model, tokenizer=target.tokenizer,
                     assistant_tokenizer=drafter.tokenizer)
