"""Grouped-query attention without copying the KV cache, for the multi-token forwards of a verify.

transformers' SDPA attention runs a grouped-query model (several query heads per key/value head:
Qwen2.5, SmolLM2, Gemma 3) on the key/value heads directly where it can: one query token, or no
mask. A forward of several new tokens after a cache (a verify) carries a mask, and there, on a
CPU, it first repeats every cached key and value once per query head (`repeat_kv`): a copy of
the whole cache per layer per call, which grows with the context. torch's SDPA takes the mask and
the grouped heads together (`enable_gqa=True`) and gives the same numbers bit for bit (tests).
`use_grouped_attention(model)` runs the model's attention through that where it timed faster on
this machine (once per head shape, remembered like the kernel plan); everything else (one token,
a prefill, softcaps, position biases, other attention kinds) stays transformers' own. Why and how
much: docs/kernels.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .kernels import median_ms
from .measured import remembered

__all__ = ["NAME", "attention_choice", "use_grouped_attention"]

NAME = "omnidraft_sdpa"


def _grouped_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (
        groups > 1
        and query.shape[2] > 1
        and attention_mask is not None
        and dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    ):
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _grouped_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA gets, built the same way


@torch.inference_mode()
def _time_attention(
    heads: int, kv_heads: int, dim: int, *, context: int = 1024, rows: int = 4, reps: int = 20
) -> dict[str, float]:
    """Median ms of one masked attention call of `rows` new tokens after `context` cached ones, the
    cache repeated per query head (transformers') and grouped."""
    q = torch.randn(1, heads, rows, dim)
    k, v = torch.randn(1, kv_heads, context + rows, dim), torch.randn(1, kv_heads, context + rows, dim)
    mask = torch.ones(rows, context + rows, dtype=torch.bool).tril(context)[None, None]
    n = heads // kv_heads

    def repeated(_: int) -> Any:
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(n, 1), v.repeat_interleave(n, 1), attn_mask=mask
        )

    def grouped(_: int) -> Any:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return {"repeated": median_ms(repeated, range(reps), 3), "grouped": median_ms(grouped, range(reps), 3)}


def _timings(model: Any) -> dict[str, float] | None:
    """The two forms' ms for `model`'s head shape (timed once per machine), or None where there is
    nothing to choose: another attention implementation, or no grouped heads."""
    config = model.config
    heads: int = getattr(config, "num_attention_heads", None) or 0
    kv_heads: int = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "_attn_implementation", None) not in ("sdpa", NAME) or not heads or kv_heads == heads:
        return None
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return remembered(
        "attention", f"{heads}x{kv_heads}x{dim}|v1", lambda: _time_attention(heads, kv_heads, dim)
    )


def use_grouped_attention(model: Any) -> bool:
    """Run `model`'s SDPA attention as above where that timed faster here; True when it now does.
    A model on another attention implementation (eager, flash), or without grouped heads, is left
    as it is."""
    ms = _timings(model)
    if ms is None or ms["grouped"] > ms["repeated"]:
        return False
    _register()
    model.set_attn_implementation(NAME)
    return True


def attention_choice(model: Any) -> str:
    """One line for `omnidraft doctor`: which form a verify's attention takes for `model`, and why."""
    ms = _timings(model)
    if ms is None:
        kind = getattr(model.config, "_attn_implementation", "?")
        return f"attention {kind} as transformers runs it (nothing to choose)"
    pick = (
        "grouped (the cache's own key/value heads)"
        if ms["grouped"] <= ms["repeated"]
        else "repeated per query head"
    )
    return (
        f"a verify's attention {pick}: grouped {ms['grouped']:.2f} ms, repeated {ms['repeated']:.2f} ms "
        "(4 tokens after 1,024, one layer)"
    )
