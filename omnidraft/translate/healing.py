"""Token healing for the drafter: let it merge its context's last token with what comes next.

The drafter's context is the committed text re-encoded round by round, so it can end where the
drafter's own tokenizer would not end a token: the target commits "\n" and the code goes on with
"    return", which SmolLM2 spells "\n   " + " return"; a drafter fed "\n" alone is out of its
training distribution and mispredicts what follows. Healing lets the draft's first token *replace*
the context's last token by a longer one that starts with the same bytes ("\n" -> "\n   "), when
the drafter prefers it at that position: the drafter session reads its logits one position back
(no extra forward when it keeps the token) and reports `Draft.healed`.

Which longer tokens may replace it is limited by what the target committed: the target ended its
last token T where it did, so a continuation it would have merged into T is unlikely. A candidate
whose first byte after the held ones, b, makes T + b the start of some target token is left out:
after Qwen2.5's "\n" no "\n\n..." (Qwen would have emitted "\n\n"), after " the" no " these".
Without that filter healing cost acceptance (docs/drafter-acceptance.md).

Drafter-side only: the replaced token's bytes are already committed, so translation skips them
(`Translator.translate(..., skip=)`) and the target's output cannot change. Shapes: Vd drafter vocabulary.
"""

from __future__ import annotations

from bisect import bisect_left
from functools import lru_cache

import torch

from .token_bytes import TokenBytes

__all__ = ["Healer"]


class Healer:
    """The drafter tokens that may replace a context token, given the target's last token."""

    def __init__(self, draft_bytes: TokenBytes, target_bytes: TokenBytes) -> None:
        self._table = draft_bytes.table
        self.size = len(self._table)
        ordered = sorted((data, i) for i, data in enumerate(self._table) if data)
        self._keys = [data for data, _ in ordered]
        self._ids = torch.tensor([i for _, i in ordered], dtype=torch.long)
        self._target_keys = sorted({t for t in target_bytes.table if t})
        self.candidates = lru_cache(maxsize=4096)(self._candidates)

    def _range(self, prefix: bytes, keys: list[bytes] | None = None) -> tuple[int, int]:
        """[lo, hi) of the sorted `keys` (default: the drafter's token bytes) that start with `prefix`:
        in sorted order they form one contiguous run."""
        keys = self._keys if keys is None else keys
        lo = bisect_left(keys, prefix)
        successor = prefix.rstrip(b"\xff")
        if not successor:
            return lo, len(keys)
        return lo, bisect_left(keys, successor[:-1] + bytes([successor[-1] + 1]))

    def _target_starts(self, prefix: bytes) -> bool:
        """Whether some target token starts with `prefix`."""
        lo, hi = self._range(prefix, self._target_keys)
        return hi > lo

    def _candidates(self, token: int, target_last: bytes | None) -> torch.Tensor | None:
        """(Vd,) bool: the drafter tokens that may replace context token `token`, itself included;
        None when no longer one may (nothing to heal). `target_last`: the bytes of the target's
        last committed token (None: unknown, no filter). The mask is shared: do not modify it."""
        held = self._table[token] if 0 <= token < self.size else None
        if not held:
            return None
        lo, hi = self._range(held)
        keep = [(lo, hi)]
        if target_last is not None:  # drop every run held + b with target_last + b a target token's start
            keep, start = [], lo
            for b in sorted({key[len(held)] for key in self._keys[lo:hi] if len(key) > len(held)}):
                run = self._range(held + bytes([b]))
                if self._target_starts(target_last + bytes([b])):
                    keep.append((start, run[0]))
                    start = run[1]
            keep.append((start, hi))
        rows = torch.cat([self._ids[a:b] for a, b in keep])
        if all(len(self._table[i]) == len(held) for i in rows.tolist()):
            return None
        mask = torch.zeros(self.size, dtype=torch.bool)
        mask[rows] = True
        return mask
