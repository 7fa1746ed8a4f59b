"""Direct mapping between a drafter vocabulary and a target vocabulary: tokens with equal bytes.

Special tokens map only to their declared counterparts (EOS to EOS, BOS to BOS, and specials with
the same name), never by text. The map is a pair of id tensors; it knows nothing about n-grams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .token_bytes import TokenBytes

__all__ = ["ROLES", "VocabMap", "build_vocab_map"]

ROLES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")  # tokenizer ids mapped by role


@dataclass(frozen=True)
class VocabMap:
    """`d2t[i]` is the target id of drafter token i, or -1; `t2d` the reverse.

    Shapes: d2t (Vd,), t2d (Vt,), both int64.
    """

    d2t: torch.Tensor
    t2d: torch.Tensor

    @property
    def shared(self) -> int:
        """Size of the intersection: drafter tokens with a direct target counterpart."""
        return int((self.d2t >= 0).sum())

    def summary(self) -> str:
        vd, vt = len(self.d2t), len(self.t2d)
        return (
            f"shared {self.shared} tokens ({self.shared / vd:.1%} of drafter {vd}, "
            f"{self.shared / vt:.1%} of target {vt})"
        )


def build_vocab_map(
    draft: TokenBytes, target: TokenBytes, draft_tokenizer: Any = None, target_tokenizer: Any = None
) -> VocabMap:
    """Map every drafter token whose bytes are a target token's bytes; specials by declared role."""
    d2t = torch.full((len(draft),), -1, dtype=torch.long)
    t2d = torch.full((len(target),), -1, dtype=torch.long)
    for i, data in enumerate(draft.table):
        if data is not None and (j := target.id_of(data)) is not None:
            d2t[i] = j
    for j, data in enumerate(target.table):
        if data is not None and (d := draft.id_of(data)) is not None:
            t2d[j] = d
    for i, j in _special_pairs(draft, target, draft_tokenizer, target_tokenizer):
        d2t[i], t2d[j] = j, i
    return VocabMap(d2t, t2d)


def _special_pairs(draft: TokenBytes, target: TokenBytes, dtok: Any, ttok: Any) -> list[tuple[int, int]]:
    pairs = []
    if dtok is not None and ttok is not None:
        for role in ROLES:
            i, j = getattr(dtok, role, None), getattr(ttok, role, None)
            if isinstance(i, int) and isinstance(j, int) and i < len(draft) and j < len(target):
                pairs.append((i, j))
    by_name = {name: j for j, name in target.special.items()}
    pairs += [(i, by_name[name]) for i, name in draft.special.items() if name in by_name]
    return pairs
