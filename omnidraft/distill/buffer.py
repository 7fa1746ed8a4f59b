"""From verified requests to distillation examples, and the buffer they wait in (OmniDraft Alg. 2).

A verified request is what one generation taught us: the prompt, the target tokens committed and
the target's top-k log-probabilities at each committed position (the verify forward computes them
anyway; a remote target ships only those K numbers). In greedy mode none of it depends on the
drafter, so a recorded trace gives the very same examples as a live request.

An example is teacher-forced over the drafter's own tokenization of the same text. Lining the two
tokenizations up by bytes labels each committed target token:
- direct: exactly one drafter token spells it: the KL term at the drafter position before it;
- n-gram: >= 2 drafter tokens spell it exactly: the NLL term on each sub-token;
- misaligned (the boundaries differ): no loss in the paper. With `spans=True` the shortest run of
  target tokens whose two ends are also drafter boundaries (a "span", e.g. Gemma's "\n" + "    "
  against SmolLM2's "\n   " + " return") is labelled like an n-gram token: NLL on the drafter
  tokens that spell it, with the span's target log-probability the sum over its tokens. An n-gram
  token is the one-target-token case of a span.
Shapes: L drafter positions, A direct tokens, B n-gram sub-tokens, G n-gram tokens (or spans), K top-k.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

__all__ = ["Buffer", "Example", "VerifiedRequest", "build_example"]


@dataclass(frozen=True)
class VerifiedRequest:
    """prompt text; tokens (N,) committed target ids; topk_ids/topk_logp (N, K) target rows;
    positions (N,) 1-based index of each token within its round (for position weights)."""

    prompt: str
    tokens: list[int]
    topk_ids: torch.Tensor
    topk_logp: torch.Tensor
    positions: list[int]

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if (
            self.topk_ids.shape[0] != n
            or self.topk_logp.shape != self.topk_ids.shape
            or len(self.positions) != n
        ):
            raise ValueError(
                f"a verified request needs one top-k row and one position per token: {n} tokens, "
                f"rows {tuple(self.topk_ids.shape)}/{tuple(self.topk_logp.shape)}, {len(self.positions)} "
                "positions"
            )


@dataclass(frozen=True)
class Example:
    """ids (L,) drafter ids of prompt + continuation. Logit row r predicts ids[r + 1].
    kl_rows (A,), kl_ids/kl_logp (A, K), kl_pos (A,): direct tokens' rows, target top-k, round position.
    ng_rows (B,), ng_tokens (B,), ng_group (B,), ng_pos (B,): n-gram (or span) sub-tokens; ng_logp (G,) target
    log p of each n-gram token (or span: the sum over its tokens)."""

    ids: torch.Tensor
    kl_rows: torch.Tensor
    kl_ids: torch.Tensor
    kl_logp: torch.Tensor
    kl_pos: torch.Tensor
    ng_rows: torch.Tensor
    ng_tokens: torch.Tensor
    ng_group: torch.Tensor
    ng_pos: torch.Tensor
    ng_logp: torch.Tensor

    @property
    def labelled(self) -> int:
        """Target tokens that carry a loss."""
        return int(self.kl_rows.numel() + self.ng_logp.numel())


def build_example(
    request: VerifiedRequest,
    drafter: Any,
    target_bytes: Any,
    t2d: torch.Tensor,
    max_len: int = 1024,
    *,
    spans: bool = False,
    context: int = 0,
) -> Example:
    """Label `request` for the drafter (see module doc). `max_len` caps L, cutting from the end;
    `spans` also labels misaligned runs of target tokens; `context` > 0 keeps only that many of the
    prompt's last tokens before the reply (a long prompt's forward and backward cost the most, and
    no loss reads its rows; 0 keeps the whole prompt)."""
    prompt = drafter.tokenizer(request.prompt)["input_ids"]
    if context > 0:
        prompt = prompt[-context:]
    pieces = [target_bytes.table[t] or b"" for t in request.tokens]
    cont = drafter.codec.encode(b"".join(pieces)) if any(pieces) else []
    ids = list(prompt) + cont
    starts = {
        s: i
        for i, s in enumerate(accumulate((len(drafter.token_bytes.table[d] or b"") for d in cont), initial=0))
    }
    base = len(prompt) - 1  # logit row that predicts continuation token 0
    kl, ng, ng_logp = [], [], []
    opened: tuple[int, int] | None = None  # (first byte, first token) of a span not yet closed
    for j, (t, a, b) in enumerate(
        zip(
            request.tokens,
            accumulate((len(p) for p in pieces), initial=0),
            accumulate(len(p) for p in pieces),
        )
    ):
        if a == b:  # special token: only a trailing one the drafter can name (EOS) is learnt
            opened = None
            if j == len(request.tokens) - 1 and int(t2d[t]) >= 0:
                ids.append(int(t2d[t]))
                kl.append((base + len(cont), j))
            continue
        if opened is None and a not in starts:
            continue  # after a special token, inside a drafter token: no boundary to start from
        first, j0 = opened or (a, j)
        if b not in starts:  # the drafter token runs on past this target token
            opened = (first, j0)
            continue
        opened = None
        i0, i1 = starts[first], starts[b]
        if j0 == j and i1 - i0 == 1:
            if int(t2d[t]) == cont[i0]:
                kl.append((base + i0, j))
        elif j0 == j or spans:
            ng_logp.append(sum(_target_logp(request, i) for i in range(j0, j + 1)))
            ng += [(base + i, cont[i], len(ng_logp) - 1, j0) for i in range(i0, i1)]
    kl = [(r, j) for r, j in kl if r + 1 < max_len]
    keep = [x for x in ng if x[0] + 1 < max_len]
    groups = sorted({g for _, _, g, _ in keep})
    regroup = {g: n for n, g in enumerate(groups)}
    pos = torch.tensor(request.positions, dtype=torch.long)
    kl_j = torch.tensor([j for _, j in kl], dtype=torch.long)
    return Example(
        ids=torch.tensor(ids[:max_len], dtype=torch.long),
        kl_rows=torch.tensor([r for r, _ in kl], dtype=torch.long),
        kl_ids=request.topk_ids[kl_j],
        kl_logp=request.topk_logp[kl_j].float(),
        kl_pos=pos[kl_j],
        ng_rows=torch.tensor([x[0] for x in keep], dtype=torch.long),
        ng_tokens=torch.tensor([x[1] for x in keep], dtype=torch.long),
        ng_group=torch.tensor([regroup[x[2]] for x in keep], dtype=torch.long),
        ng_pos=pos[torch.tensor([x[3] for x in keep], dtype=torch.long)],
        ng_logp=torch.tensor([ng_logp[g] for g in groups], dtype=torch.float32),
    )


def _target_logp(request: VerifiedRequest, j: int) -> float:
    """The target's log p of its committed token j, from the top-k row (the row's minimum, an upper
    bound, in the rare case the token fell outside the top-k)."""
    row = request.topk_ids[j] == request.tokens[j]
    return float(request.topk_logp[j][row][0]) if bool(row.any()) else float(request.topk_logp[j].min())


class Buffer:
    """The verified examples since the last update (bounded: the oldest go first)."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, got {capacity}")
        self._items: deque[Example] = deque(maxlen=capacity)

    def add(self, example: Example) -> None:
        if example.labelled:
            self._items.append(example)

    def __len__(self) -> int:
        return len(self._items)

    def batches(self, size: int, rng: random.Random) -> list[list[Example]]:
        """The buffer shuffled into batches of `size` (the last one may be smaller)."""
        items = list(self._items)
        rng.shuffle(items)
        return [items[i : i + size] for i in range(0, len(items), size)]

    def clear(self) -> None:
        self._items.clear()
