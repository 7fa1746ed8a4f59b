"""`EngineProposer`: omnidraft's drafts inside vLLM's own speculative step.

vLLM builds this class itself (`speculative_config={"method": "custom_class", "model":
"omnidraft.targets.vllm_proposer.EngineProposer", ...}`; `VLLMTarget.load` does it) and, after each
engine step, asks it for the next draft of every running sequence: it passes each batch row's
committed target ids. The engine verifies the drafts in its next step, together with the other
sequences' decode tokens, and commits the accepted prefix and its own token: a verify costs what a
decode step with a few more tokens costs, not a request of its own.

A pairing announces a request before submitting it (`expect`: its prompt ids and its
`EngineProposals`, engine_proposals.py); the proposer finds each row's sequence by its ids (rows carry
no request id here), drafts for the announced ones and proposes nothing for every other request,
which vLLM then simply decodes. A drafter that fails proposes nothing from then on: vLLM verifies
whatever is proposed, so nothing a proposer does can change the output.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..target import ProposalSource

__all__ = ["EngineProposer", "Sequence", "built_since", "proposer_config"]

log = logging.getLogger(__name__)

_built_lock = threading.Lock()
_built: dict[str, Any] = {"count": 0, "latest": None}  # proposers vLLM built here; the newest only kept


def proposer_config(draft_tokens: int) -> dict[str, Any]:
    """The engine's `speculative_config` that makes vLLM ask `EngineProposer` for drafts of up to
    `draft_tokens` tokens."""
    return {
        "method": "custom_class",
        "model": f"{__name__}.EngineProposer",
        "num_speculative_tokens": int(draft_tokens),
    }


def built_since(count: int) -> EngineProposer | None:
    """The proposer built after the first `count` of this process (the one an engine just built),
    or None (vLLM built it in another process)."""
    with _built_lock:
        return _built["latest"] if _built["count"] > count else None


def built_count() -> int:
    """How many proposers vLLM has built in this process."""
    with _built_lock:
        return int(_built["count"])


class Sequence:
    """One announced request: its prompt ids, its proposal source, how many tokens it may produce."""

    def __init__(
        self, prompt: list[int], source: ProposalSource, max_tokens: int, drafter_ids: list[int] | None
    ):
        self.prompt, self.source, self.max_tokens = list(prompt), source, max_tokens
        self.drafter_ids = drafter_ids
        self.known = np.asarray(self.prompt, dtype=np.int64)  # the ids this sequence last drafted after
        self.opened = self.failed = False

    def matches(self, row: np.ndarray, n: int) -> bool:
        """Whether the row's first `n` ids continue this sequence."""
        m = len(self.known)
        return n > m - (0 if self.opened else 1) and np.array_equal(row[:m], self.known)

    def prepare(self, ids: list[int]) -> None:
        self.source.prepare(ids)

    def next(self, ids: list[int], limit: int) -> list[int]:
        if not self.opened:
            self.source.open(self.prompt, self.drafter_ids)
            self.opened = True
        remaining = self.max_tokens - (len(ids) - len(self.prompt))
        draft = self.source.next(ids, limit, remaining) if remaining > 1 else []
        self.known = np.asarray(ids, dtype=np.int64)
        return draft[: max(0, min(limit, remaining - 1))]


class EngineProposer:
    """vLLM's proposer for omnidraft's drafts (see the module docstring)."""

    def __init__(self, vllm_config: Any) -> None:
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self._sequences: list[Sequence] = []
        self._rows: dict[int, Sequence] = {}
        self._lock = threading.Lock()
        self.calls = 0
        with _built_lock:  # an engine's target takes it; older ones are not held here
            _built["count"] += 1
            _built["latest"] = self

    def expect(
        self, prompt: list[int], source: ProposalSource, max_tokens: int, drafter_ids: list[int] | None = None
    ) -> Sequence:
        """Announce a request about to be submitted: drafts for it come from `source`."""
        seq = Sequence(prompt, source, max_tokens, drafter_ids)
        with self._lock:
            self._sequences.append(seq)
        return seq

    def forget(self, seq: Sequence) -> None:
        """The request ended: no more drafts for it."""
        with self._lock:
            if seq in self._sequences:
                self._sequences.remove(seq)
            self._rows = {i: s for i, s in self._rows.items() if s is not seq}

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Per batch row, the draft after its committed ids (vLLM's custom-class interface)."""
        drafts: list[list[int]] = []
        with self._lock:
            self.calls += 1
            rows: dict[int, Sequence] = {}
            for i, sampled in enumerate(sampled_token_ids):
                n = int(num_tokens_no_spec[i])
                seq = self._find(i, token_ids_cpu[i], n, rows) if sampled and n < self.max_model_len else None
                if seq is not None:
                    rows[i] = seq
            committed = {i: token_ids_cpu[i, : int(num_tokens_no_spec[i])].tolist() for i in rows}
            for i, seq in rows.items():  # every row's ids first: remote drafters start at once
                self._guard(seq, seq.prepare, committed[i])
            for i in range(len(sampled_token_ids)):
                seq = rows.get(i)
                drafts.append([] if seq is None else self._draft(seq, committed[i]))
            self._rows = rows
        return drafts

    def _find(self, i: int, row: np.ndarray, n: int, claimed: dict[int, Sequence]) -> Sequence | None:
        """The sequence row `i` holds: the row's last one if its ids still continue it, else (the
        row holds another request now, or the batch was condensed) one already drafting, then one
        announced, that no other row of this step claimed."""
        seq = self._rows.get(i)
        if seq is not None and seq not in claimed.values() and seq.matches(row, n):
            return seq
        taken = set(map(id, claimed.values()))
        for candidate in sorted(self._sequences, key=lambda s: not s.opened):
            if id(candidate) not in taken and candidate.matches(row, n):
                return candidate
        return None

    def _draft(self, seq: Sequence, ids: list[int]) -> list[int]:
        return self._guard(seq, seq.next, ids, min(self.k, self.max_model_len - len(ids))) or []

    @staticmethod
    def _guard(seq: Sequence, call: Any, *args: Any) -> Any:
        """`call(*args)` unless the sequence's proposal source failed before; a failure ends its drafts."""
        if seq.failed:
            return None
        try:
            return call(*args)
        except Exception:  # the engine verifies whatever comes back: no draft is always safe
            log.exception("omnidraft's proposer failed; the request goes on without drafts")
            seq.failed = True
            return None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the drafter is the pairing's."""
