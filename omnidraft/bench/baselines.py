"""Same-process baselines on the pairing's own target model object, timed on the same prompts:
the target alone (greedy, on the kernels measured fastest here: kernels.py), the same model on
stock kernels (what an unmodified HF model does on this machine), HF prompt-lookup decoding
(`prompt_lookup_num_tokens`) and HF's cross-tokenizer assisted generation."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from ..runtime.kernels import stock_kernels

if TYPE_CHECKING:
    from ..target import DecodingSession, Target
    from ..targets.local import LocalTarget

__all__ = ["LOOKUP_TOKENS", "Timed", "hf_assisted", "prompt_lookup", "stock_generate", "target_alone"]

LOOKUP_TOKENS = 10  # HF prompt lookup's draft length in the peer row


@dataclass(frozen=True)
class Timed:
    token_ids: list[int]
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


def _generate(
    model: Any, encode: Any, prompt: str, max_new_tokens: int, eos: list[int], **extra: Any
) -> Timed:
    ids = encode(prompt, return_tensors="pt")["input_ids"]
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            **extra,
        )
    return Timed(out[0, ids.shape[1] :].tolist(), time.perf_counter() - started)


def target_alone(target: Target, prompt: str, max_new_tokens: int) -> Timed:
    """The target's own greedy decoding, one token per forward (HF generate), on the same model
    object and kernel plan that verifies for the pairing: the fair baseline. A target that is not
    a PyTorch model (llama.cpp) decodes alone through its own session (its engine's plain loop)."""
    from ..targets.local import LocalTarget

    if not isinstance(target, LocalTarget):
        ids = target.tokenizer(prompt)["input_ids"]
        started = time.perf_counter()
        out = list(cast("DecodingSession", target.begin(ids)).decode(max_new_tokens))
        return Timed(out, time.perf_counter() - started)
    return _generate(target.model, target.tokenizer, prompt, max_new_tokens, sorted(target.eos_ids))


def stock_generate(target: LocalTarget, prompt: str, max_new_tokens: int) -> Timed:
    """`target_alone` with every linear layer on stock `F.linear` (a labelled reference row)."""
    with stock_kernels(target.model):
        return target_alone(target, prompt, max_new_tokens)


def prompt_lookup(target: LocalTarget, prompt: str, max_new_tokens: int) -> Timed:
    """HF prompt-lookup decoding: drafts copied from the prompt's n-grams, no drafter model."""
    return _generate(
        target.model,
        target.tokenizer,
        prompt,
        max_new_tokens,
        sorted(target.eos_ids),
        prompt_lookup_num_tokens=LOOKUP_TOKENS,
    )


def hf_assisted(target: LocalTarget, drafter: Any, prompt: str, max_new_tokens: int) -> Timed:
    """HF assisted generation with a drafter of another tokenizer (universal assisted decoding), on
    the PyTorch drafter (the one a llama.cpp copy stands in for, backends.drafting_copy)."""
    drafter = getattr(drafter, "pytorch", drafter)
    return _generate(
        target.model,
        target.tokenizer,
        prompt,
        max_new_tokens,
        sorted(target.eos_ids),
        assistant_model=drafter.model,
        tokenizer=target.tokenizer,
        assistant_tokenizer=drafter.tokenizer,
    )
