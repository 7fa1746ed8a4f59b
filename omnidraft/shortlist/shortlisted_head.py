"""`ShortlistHead`: a drafter's LM head evaluated only on a support of its vocabulary.

The vocabulary is cut into blocks (an id tensor each, with a linear layer over just those rows of
the head, packed once); a policy (supports.py) picks the blocks of each call. The head returns the
full-width logits with -inf outside the support, so everything downstream (greedy pick, sampling,
the q rows of `exact`) is unchanged and sees a drafter whose distribution is its own restricted to
the support and renormalised: verification stays exact. A block's rows are the head's own rows, in
the same numeric format (fp32, or int8 re-packed from the same int8 values), so on the support the
logits equal the full head's (tests/test_shortlist.py states the difference).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["Block", "Policy", "ShortlistHead", "dense_weight", "sub_linear"]

SIZES_KEPT = 1 << 16  # support sizes a head remembers: bounded, a long-running app's head does not grow


def _int8(head: nn.Module) -> bool:
    """Whether `head` is a dynamic int8 Linear (False: an nn.Linear); TypeError for anything else."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    if isinstance(head, DynamicLinear):
        return True
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"a shortlisted head needs an nn.Linear or dynamic int8 LM head, got {type(head).__name__}"
        )
    return False


def sub_linear(head: Any, ids: torch.Tensor) -> nn.Module:
    """A linear layer computing rows `ids` of `head` (an nn.Linear or a dynamic int8 Linear)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    if _int8(head):  # the same int8 values and per-row scales, re-packed: no re-quantization
        ints, scales, zeros, bias = _unpacked(head)
        rows = torch._make_per_channel_quantized_tensor(ints[ids], scales[ids], zeros[ids], 0)
        part = DynamicLinear(ints.shape[1], len(ids), dtype=torch.qint8)
        part.set_weight_bias(rows, None if bias is None else bias[ids].clone())
        return part
    dense = nn.Linear(head.in_features, len(ids), bias=head.bias is not None)
    dense.weight = nn.Parameter(head.weight.detach()[ids].clone(), requires_grad=False)
    if head.bias is not None:
        dense.bias = nn.Parameter(head.bias.detach()[ids].clone(), requires_grad=False)
    return dense


def dense_weight(head: Any) -> torch.Tensor:
    """The rows of `head` (an nn.Linear or a dynamic int8 Linear) as an fp32 (V, d) matrix."""
    return head.weight().dequantize().float() if _int8(head) else head.weight.detach().float()


def _unpacked(head: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A dynamic int8 head's (int8 values, per-row scales, zero points, bias), unpacked once and
    kept on the module: unpacking reads the whole matrix, and a clustered head cuts it many times."""
    cached = head.__dict__.get("_shortlist_unpacked")
    if cached is None:
        q, bias = head._weight_bias()
        if q.qscheme() not in (torch.per_channel_affine, torch.per_channel_symmetric):
            raise TypeError(
                "a shortlisted int8 head needs per-channel weights (int8.quantize_int8's default)"
            )
        cached = (q.int_repr(), q.q_per_channel_scales(), q.q_per_channel_zero_points(), bias)
        head.__dict__["_shortlist_unpacked"] = cached
    return cached


class Block:
    """Ids (sorted, int64) and the packed rows that compute their logits (none without a `head`:
    for a graph that gathers its own rows, export/onnx.py)."""

    def __init__(self, head: nn.Module | None, ids: torch.Tensor) -> None:
        self.ids = torch.as_tensor(ids, dtype=torch.long).unique()
        self.linear = sub_linear(head, self.ids) if head is not None else None

    def __len__(self) -> int:
        return len(self.ids)


class Policy(Protocol):
    """Which blocks a call evaluates. `begin`/`observe` see a request's drafter ids."""

    def blocks(self, hidden: torch.Tensor, step: int) -> list[Block]: ...

    def begin(self, ids: list[int]) -> None: ...

    def observe(self, ids: list[int]) -> None: ...


class ShortlistHead(nn.Module):
    """Replaces a drafter's `lm_head`: full-width logits, -inf outside the policy's support.
    `step` is the position inside the current draft (the session sets it; budgets may use it)."""

    def __init__(self, head: nn.Module | None, vocab_size: int, policy: Policy) -> None:
        super().__init__()
        self.full = head
        self.vocab_size, self.policy, self.step = vocab_size, policy, 0
        self.support_sizes: deque[int] = deque(maxlen=SIZES_KEPT)  # the latest calls', for benchmarks

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.requires_grad:  # a training forward reads the whole head
            if self.full is None:
                raise ValueError("this shortlisted head has no rows of its own to train through")
            return self.full(hidden)
        blocks = self.policy.blocks(hidden, self.step)
        out = hidden.new_full((*hidden.shape[:-1], self.vocab_size), float("-inf"))
        for block in blocks:
            if block.linear is None:
                raise ValueError("this shortlist has no rows (it serves a graph that gathers its own)")
            out[..., block.ids] = block.linear(hidden).to(out.dtype)
        self.support_sizes.append(sum(len(b) for b in blocks))
        return out


def install(model: Any, policy: Policy) -> ShortlistHead:
    """Put a ShortlistHead with `policy` on `model` (an HF causal LM) in place of its LM head."""
    head = model.get_output_embeddings()
    if isinstance(head, ShortlistHead):
        head = head.full
    short = ShortlistHead(head, int(model.config.vocab_size), policy)
    model.set_output_embeddings(short)
    return short
