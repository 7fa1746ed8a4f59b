"""A bounded datastore of a user's past outputs (target token ids), searchable by suffix automaton.

Documents are kept whole, oldest first, separated in the automaton's text by `SEP` (never a token
id), so a match never spans two documents and a continuation stops at a document's end. Adding a
document past `cap` tokens drops the oldest ones and rebuilds the automaton (linear in the cap).
The datastore belongs to one target tokenizer: `from_doc` refuses a document whose fingerprint
differs. Saved inside the pairing profile (profiles.py), which writes it atomically.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..errors import CorruptFileError, IncompatibleError
from .automaton import SuffixAutomaton

__all__ = ["DATASTORE_CAP", "Datastore", "SEP"]

SEP = -1  # between documents in the automaton's text
DATASTORE_CAP = 32_768  # tokens kept per user by default
FORMAT, VERSION = "omnidraft.datastore", 1


class Datastore:
    """Past outputs, at most `cap` tokens in all, newest kept."""

    def __init__(self, cap: int = DATASTORE_CAP, *, fingerprint: str = "") -> None:
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise ValueError(f"datastore cap must be an integer >= 1 (tokens), got {cap!r}")
        self.cap, self.fingerprint = cap, fingerprint
        self.docs: deque[list[int]] = deque()
        self.tokens = 0
        self.sam = SuffixAutomaton()

    def __len__(self) -> int:
        return self.tokens

    def add(self, ids: list[int]) -> None:
        """Keep one output; the oldest are dropped once the total passes the cap."""
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError("datastore documents are lists of token ids >= 0")
        doc = list(ids[-self.cap :])
        if not doc:
            return
        self.docs.append(doc)
        self.tokens += len(doc)
        if self.tokens <= self.cap:
            self._index(doc)
            return
        while self.tokens > self.cap:
            self.tokens -= len(self.docs.popleft())
        self.sam = SuffixAutomaton()
        for old in self.docs:
            self._index(old)

    def _index(self, doc: list[int]) -> None:
        if len(self.sam):
            self.sam.extend(SEP)
        for token in doc:
            self.sam.extend(token)

    def to_doc(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "fingerprint": self.fingerprint,
            "cap": self.cap,
            "docs": [list(d) for d in self.docs],
        }

    @classmethod
    def from_doc(cls, doc: Any, *, where: str, fingerprint: str, cap: int | None = None) -> Datastore:
        """A datastore from `to_doc`'s output; `where` names its source in errors."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CorruptFileError(f"{where}: not an omnidraft datastore")
        if doc.get("version") != VERSION:
            raise IncompatibleError(
                f"{where}: datastore version {doc.get('version')!r}, this library reads {VERSION}"
            )
        if doc.get("fingerprint") != fingerprint:
            raise IncompatibleError(
                f"{where}: the datastore was built for another target tokenizer "
                f"({doc.get('fingerprint')!r}, this pairing has {fingerprint!r})"
            )
        docs = doc.get("docs")
        if not isinstance(docs, list) or any(not isinstance(d, list) for d in docs):
            raise CorruptFileError(f"{where}: datastore documents are not lists of token ids")
        store = cls(cap if cap is not None else int(doc.get("cap", DATASTORE_CAP)), fingerprint=fingerprint)
        try:
            for d in docs:
                store.add(d)
        except ValueError as exc:
            raise CorruptFileError(f"{where}: {exc}") from None
        return store
