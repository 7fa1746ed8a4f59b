"""Fakes for the engine tests: an oracle drafter that proposes the target's own continuation."""

from __future__ import annotations

from itertools import accumulate

from omnidraft.draft.picking import Draft


class OracleDrafter:
    """Proposes the next tokens of a known continuation `reference` (ids in `base`'s vocabulary).

    With `wrong_at=j` the j-th drafted token of every round is replaced by another token, forcing a
    rejection there. Drafting in the target's own vocabulary with the "ngram" strategy (identity
    map) makes every correct proposal acceptable: the accept-all path.
    """

    def __init__(self, base, reference: list[int], wrong_at: int = 10**9) -> None:
        self.tokenizer, self.token_bytes, self.codec, self.name = (
            base.tokenizer,
            base.token_bytes,
            base.codec,
            "oracle",
        )
        self.reference, self.wrong_at = reference, wrong_at
        self.starts = {
            s: i
            for i, s in enumerate(
                accumulate((len(base.token_bytes.table[t] or b"") for t in reference), initial=0)
            )
        }

    def begin(self, ids):
        return _OracleSession(self)


class _OracleSession:
    def __init__(self, owner: OracleDrafter) -> None:
        self.owner, self.pos, self.draft = owner, 0, []
        self.stop_ids: frozenset[int] = frozenset()  # (a drafted token that ends a draft: none here)

    def propose(
        self, k, *, temperature=0.0, allowed=None, generator=None, stop_confidence=0.0, heal=None, more=False
    ):
        """The reference's next `k` tokens; `more`: those after the draft proposed last (grown on)."""
        o = self.owner
        i = o.starts.get(self.pos, len(o.reference)) + (len(self.draft) if more else 0)
        ids = o.reference[i : i + k] or ([] if more else [o.token_bytes.byte_token[ord("x")]])
        if not more and o.wrong_at < len(ids):
            ids[o.wrong_at] = next(
                t for t in o.token_bytes.byte_token if t is not None and t != ids[o.wrong_at]
            )
        self.draft = self.draft + ids if more else ids
        return Draft(ids)

    def commit(self, keep, tail):
        self.pos += len(self.owner.token_bytes.join(self.draft[:keep] + tail))
