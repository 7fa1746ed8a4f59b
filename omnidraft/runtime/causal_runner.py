"""One token sequence of one HF causal LM with its KV cache: feed new tokens, crop back.

Both the drafter and a local target are a `CausalRunner` underneath. It knows token ids only:
no tokenizer, no acceptance rule.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

__all__ = ["CausalRunner", "cache_keyword"]


@functools.lru_cache(maxsize=None)
def _keyword_of(forward: Any) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_keyword(model: Any) -> str:
    """The keyword `model`'s forward takes its KV cache by: `cache` in newer transformers (which
    warn on the old name), `past_key_values` before. A peft wrapper passes it on to its base."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _keyword_of(type(base).forward)


class CausalRunner:
    """`ids` is the sequence; the KV cache holds its first `kv_len` tokens."""

    def __init__(self, model: Any, ids: list[int]) -> None:
        from transformers import DynamicCache

        self.model = model
        self.device = next(model.parameters()).device  # inputs are made where the weights are
        self.ids: list[int] = list(ids)
        # every layer keeps every position: a sliding-window layer (Gemma 3) that dropped old entries
        # could not be cropped back past them (a rejected draft, token healing)
        self.cache = DynamicCache()
        self.kv_len = 0
        self._cache_kw = cache_keyword(model)

    def extend(self, ids: list[int]) -> None:
        self.ids.extend(ids)

    @torch.inference_mode()
    def forward(self, keep: int = 1, *, hidden: bool = False) -> torch.Tensor:
        """Feed every token not yet in the cache; return logits (keep, V) of the last `keep` positions.

        With `hidden`, `self.hidden` becomes the last layer's hidden states (keep, d) of those positions.
        """
        if not 1 <= keep <= len(self.ids):
            raise ValueError(f"asked for logits of {keep} positions of a {len(self.ids)}-token sequence")
        if len(self.ids) - self.kv_len < keep:  # re-feed cached tokens whose logits are needed again
            self.crop_cache(len(self.ids) - keep)
        new = self.ids[self.kv_len :]
        out = self.model(
            input_ids=torch.tensor([new], dtype=torch.long, device=self.device),
            use_cache=True,
            **{self._cache_kw: self.cache},
            logits_to_keep=keep,
            output_hidden_states=hidden,
        )
        self.kv_len = len(self.ids)
        if hidden:
            self.hidden = out.hidden_states[-1][0, -keep:]
        return out.logits[0, -keep:]

    @property
    def pending(self) -> int:
        """Tokens a prefill would still feed: all uncached ones but the last."""
        return max(0, len(self.ids) - 1 - self.kv_len)

    @torch.inference_mode()
    def prefill(self, limit: int) -> int:
        """Feed at most `limit` of the tokens not yet cached, never the last one (a verify or decode
        step feeds it with what follows); returns how many remain to feed before it (`pending`)."""
        end = min(self.kv_len + limit, len(self.ids) - 1)
        if end > self.kv_len:
            self.model(
                input_ids=torch.tensor([self.ids[self.kv_len : end]], dtype=torch.long, device=self.device),
                use_cache=True,
                **{self._cache_kw: self.cache},
                logits_to_keep=1,
            )
            self.kv_len = end
        return self.pending

    def crop(self, n: int) -> None:
        """Keep only the first `n` tokens (sequence and cache)."""
        if not 0 <= n <= len(self.ids):
            raise ValueError(f"cannot crop a sequence of {len(self.ids)} tokens to {n}")
        del self.ids[n:]
        self.crop_cache(n)

    def crop_cache(self, n: int) -> None:
        """Drop cached positions past `n` (the sequence itself is kept)."""
        if self.kv_len > n:
            self.cache.crop(n - self.kv_len)  # transformers 5.x: a negative count of tokens to drop
            self.kv_len = n
