"""Translate a draft between vocabularies: drafter ids to target ids, and committed target text
back into the drafter's ids (tail only).

Draft to target (OmniDraft §3.1), one of two strategies:
- "ngram": the paper's. Walk the draft; the longest run found in the n-gram cache becomes one
  target token with q'(t) = prod q(d_j) (eq. 1); a direct-mapped token keeps its id and q; the
  first token that is neither ends the walk, and in greedy mode the rest of the draft is
  re-tokenized as text (in sampling modes the proposal is cut there).
- "text": re-tokenize the draft's bytes with the target tokenizer, then label each target token
  by how it lines up with drafter tokens (direct, merge of >= 2 = n-gram, or misaligned).
Both are lossless under greedy and `match` verification; only acceptance differs.

Target to draft: the drafter keeps the longest prefix of its draft whose bytes are a prefix of
what was committed, and only the remaining tail is encoded. Cost is bounded by the draft length,
never by the context length. Every committed target token that spells >= 2 drafter tokens is an
n-gram instance for the cache (the "Learn" step of Algorithm 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from itertools import accumulate

import torch

from .codec import ByteCodec
from .ngram_cache import NgramCache
from .vocab_map import VocabMap

__all__ = ["Proposal", "Source", "Translator"]


class Source(IntEnum):
    """Where a proposed target token came from."""

    DIRECT = 0
    NGRAM = 1
    TEXT = 2  # re-tokenized text whose boundaries do not line up with drafter tokens
    RETRIEVED = 3  # copied from the context or the user's past outputs, in target ids (retrieve/)


@dataclass(frozen=True)
class Proposal:
    """Target-space proposal. ids (M,) int64; sources (M,) as `Source`; spans: drafter token range
    [a, b) under each target token, or None where it is misaligned."""

    ids: torch.Tensor
    sources: tuple[Source, ...]
    spans: tuple[tuple[int, int] | None, ...]

    @classmethod
    def copied(cls, ids: list[int]) -> Proposal:
        """Target ids copied from elsewhere (a retrieved continuation, a proposer of your own):
        proposed with certainty, no drafter token under them."""
        return cls(torch.zeros(0, dtype=torch.long), (), ()).then(list(ids))

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def from_cache(self) -> int:
        return sum(s == Source.NGRAM for s in self.sources)

    @property
    def retrieved(self) -> int:
        return sum(s == Source.RETRIEVED for s in self.sources)

    def cut(self, m: int) -> Proposal:
        """The first `m` proposals."""
        return Proposal(self.ids[:m], self.sources[:m], self.spans[:m])

    def then(self, retrieved: list[int]) -> Proposal:
        """This proposal followed by `retrieved` target ids (no drafter span under them)."""
        if not retrieved:
            return self
        ids = torch.cat([self.ids, torch.tensor(retrieved, dtype=torch.long)])
        return Proposal(
            ids, self.sources + (Source.RETRIEVED,) * len(retrieved), self.spans + (None,) * len(retrieved)
        )


class Translator:
    """Holds both vocabularies' byte views, the direct map and the n-gram cache of one pairing."""

    def __init__(
        self,
        draft_codec: ByteCodec,
        target_codec: ByteCodec,
        vocab_map: VocabMap,
        cache: NgramCache,
        *,
        strategy: str = "text",
    ) -> None:
        if strategy not in ("ngram", "text"):
            raise ValueError(f"translation strategy must be 'ngram' or 'text', got {strategy!r}")
        self.draft, self.target = draft_codec, target_codec
        self.map, self.cache, self.strategy = vocab_map, cache, strategy
        self._d2t = vocab_map.d2t.tolist()

    # ----- drafter -> target -------------------------------------------------------------
    def translate(self, draft: list[int], *, only: str = "any", skip: int = 0) -> Proposal:
        """Target-space proposal for drafter ids `draft` (K,).

        `only="any"` (greedy, `match`): every strategy output. `only="aligned"` (`omnidraft`): stop
        at the first token with no drafter span (no q' exists for it). `only="direct"` (`exact`):
        the direct map alone, stopping at the first unmapped token; nothing may depend on later
        drafter samples, or the accepted tokens would no longer follow q'.
        `skip`: the draft's first `skip` bytes are already committed (token healing, healing.py):
        only the bytes after them are proposed, re-tokenized as text.
        """
        if only not in ("any", "aligned", "direct"):
            raise ValueError(f"translate(only=...) must be 'any', 'aligned' or 'direct', got {only!r}")
        if skip:
            if only != "any":
                raise ValueError(
                    "a healed draft (skip > 0) translates only with only='any' (greedy or match)"
                )
            return self._by_text(draft, skip=skip)
        if only == "direct":
            return self._direct(draft)
        out = (
            self._by_ngram(draft, allow_text=only == "any")
            if self.strategy == "ngram"
            else self._by_text(draft)
        )
        if only == "aligned":
            out = out.cut(next((i for i, s in enumerate(out.spans) if s is None), len(out)))
        return out

    def _direct(self, draft: list[int]) -> Proposal:
        ids = [self._d2t[d] for d in draft]
        m = next((i for i, t in enumerate(ids) if t < 0), len(ids))
        return Proposal(
            torch.tensor(ids[:m], dtype=torch.long), (Source.DIRECT,) * m, tuple((i, i + 1) for i in range(m))
        )

    def _by_ngram(self, draft: list[int], *, allow_text: bool) -> Proposal:
        ids: list[int] = []
        sources: list[Source] = []
        spans: list[tuple[int, int] | None] = []
        i, k, longest = 0, len(draft), self.cache.config.max_len
        while i < k:
            for n in range(min(longest, k - i), 1, -1):
                key = tuple(draft[i : i + n])
                if key in self.cache:
                    ids.append(self.cache.use(key))
                    sources.append(Source.NGRAM)
                    spans.append((i, i + n))
                    i += n
                    break
            else:
                t = self._d2t[draft[i]]
                if t < 0:
                    self.cache.misses += 1
                    if allow_text:
                        tail = self._by_text(draft[i:], offset=i)
                        ids += tail.ids.tolist()
                        sources += tail.sources
                        spans += tail.spans
                    break
                ids.append(t)
                sources.append(Source.DIRECT)
                spans.append((i, i + 1))
                i += 1
        return Proposal(torch.tensor(ids, dtype=torch.long), tuple(sources), tuple(spans))

    def _by_text(self, draft: list[int], offset: int = 0, skip: int = 0) -> Proposal:
        draft_table = self.draft.token_bytes.table
        stop = next((i for i, d in enumerate(draft) if draft_table[d] is None), len(draft))
        ids = self.target.encode(self.draft.token_bytes.join(draft[:stop])[skip:])
        if stop < len(draft) and self._d2t[draft[stop]] >= 0:  # a drafted special (EOS) maps by role
            ids.append(self._d2t[draft[stop]])
        # byte offset (after the skipped bytes) where each drafter token ends -> tokens up to it
        d_ends = {
            e - skip: j + 1
            for j, e in enumerate(accumulate(len(draft_table[d] or b"") for d in draft[:stop]))
        }
        if not skip:
            d_ends[0] = 0
        target_table = self.target.token_bytes.table
        sources: list[Source] = []
        spans: list[tuple[int, int] | None] = []
        pos = 0
        for t in ids:
            start, pos = pos, pos + len(target_table[t] or b"")
            a, b = d_ends.get(start), d_ends.get(pos)
            if target_table[t] is None:  # the role-mapped special after the text
                a, b = stop, stop + 1
            if a is None or b is None or b <= a:
                sources.append(Source.TEXT)
                spans.append(None)
                continue
            direct = b - a == 1 and self._d2t[draft[a]] == t
            sources.append(Source.DIRECT if direct else Source.NGRAM)
            spans.append((a + offset, b + offset))
        return Proposal(torch.tensor(ids, dtype=torch.long), tuple(sources), tuple(spans))

    def draft_probs(self, proposal: Proposal, draft: list[int], q: torch.Tensor) -> torch.Tensor:
        """q' rows in target space for rejection sampling. draft (K,) ids, q (K, Vd) -> (M, Vt).

        A direct token's row is q scattered through the direct map. An n-gram token t spelling
        d_a..d_b-1 gets q'(t) = prod_j q(d_j) (OmniDraft eq. 1), taken from the prefix sub-token's
        mass: q'(d_a) = q(d_a) - prod_j q(d_j) (eq. 2).
        """
        d2t = self.map.d2t
        mapped = d2t >= 0
        rows = torch.zeros(len(proposal), len(self.map.t2d), dtype=q.dtype)
        for i, span in enumerate(proposal.spans):
            if span is None:
                raise ValueError(
                    "rejection sampling needs aligned proposals; translate with only='aligned' or 'direct'"
                )
            a, b = span
            rows[i].index_add_(0, d2t[mapped], q[a, mapped])
            if b - a > 1:
                # OmniDraft eq. (1): q'(t) = prod_j q(d_j); eq. (2): prefix sub-token keeps q(d_a) - prod
                prod = q[torch.arange(a, b), torch.tensor(draft[a:b])].prod()
                prefix = self._d2t[draft[a]]
                if prefix >= 0:
                    rows[i, prefix] = (rows[i, prefix] - prod).clamp_min(0)
                rows[i, proposal.ids[i]] = prod
        return rows

    # ----- target -> drafter -------------------------------------------------------------
    def resync(self, draft: list[int], committed: bytes) -> tuple[int, list[int]]:
        """How many draft tokens to keep and the drafter ids of the rest of `committed`.

        `committed` is the bytes the target just committed (accepted proposals and its own token),
        starting where the draft started.
        """
        table = self.draft.token_bytes.table
        keep, pos = 0, 0
        for d in draft:
            data = table[d]
            if data is None or not committed.startswith(data, pos):
                break
            keep, pos = keep + 1, pos + len(data)
        return keep, self.draft.encode(committed[pos:])

    def learn(self, draft_ids: list[int], target_ids: list[int], skip: int = 0) -> int:
        """Add every target token of `target_ids` that spells >= 2 consecutive tokens of
        `draft_ids` to the n-gram cache. Both spell the same bytes, the drafter's starting `skip`
        bytes earlier (the bytes token healing held back)."""
        d_table, t_table = self.draft.token_bytes.table, self.target.token_bytes.table
        d_starts = {
            s - skip: j
            for j, s in enumerate(accumulate((len(d_table[d] or b"") for d in draft_ids), initial=0))
        }
        added, pos = 0, 0
        for t in target_ids:
            start, pos = pos, pos + len(t_table[t] or b"")
            a, b = d_starts.get(start), d_starts.get(pos)
            if a is not None and b is not None and b - a >= 2:
                self.cache.add(tuple(draft_ids[a:b]), t)
                added += 1
        return added
