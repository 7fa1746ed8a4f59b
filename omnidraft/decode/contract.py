"""The contract between a request's speculation (speculation.py) and its proposer: the request's
state a proposer reads (`RequestState`: its target session's committed ids are `session.ids`), the
`Budget` a round is proposed within, the `Round` proposed, its `Outcome` (what the target committed;
not the verify maths' `decode.verify.Verdict`, which a target session returns), and the
`Proposer` and `Extendable` protocols. The built-in proposers are in proposers.py;
docs/architecture.md has the recipe for one of your own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import torch

from ..adaptive.floor import Ledger
from ..draft.picking import NO_DRAFT, Draft
from ..retrieve.retriever import PromptRead
from ..translate.translator import Proposal, Source

if TYPE_CHECKING:
    from ..adaptive.acceptance_head import Stopper
    from ..target import Rule, TargetSession

__all__ = ["Booking", "Budget", "Extendable", "Outcome", "Proposer", "RequestState", "Round"]


@dataclass
class Round:
    """One round's proposal: the model draft (NO_DRAFT when none), the proposal in target ids, the
    retrieval plan it used (None: none), the rows rejection sampling verifies against, and when
    the round began, its draft was done and its proposal was ready (perf_counter seconds; the
    speculation fills in what a proposer leaves at 0)."""

    draft: Draft
    proposal: Proposal
    used: Any = None
    q: torch.Tensor | None = None
    started: float = 0.0
    drafted: float = 0.0
    ready: float = 0.0

    @classmethod
    def copied(cls, ids: list[int]) -> Round:
        """A round proposing target ids copied from elsewhere (no drafter model under them)."""
        return cls(NO_DRAFT, Proposal.copied(ids))

    @property
    def grows(self) -> bool:
        """Whether the drafter may draft on from this round's proposal: a model draft with nothing
        retrieved run on after it."""
        return bool(self.draft.ids) and self.used is None

    def retrieved_among(self, accepted: int) -> int:
        """How many of the first `accepted` proposed tokens were retrieved ones."""
        return sum(1 for s in self.proposal.sources[:accepted] if s == Source.RETRIEVED)

    def cached_among(self, accepted: int) -> int:
        """How many of the first `accepted` proposed tokens the n-gram cache translated."""
        return sum(1 for s in self.proposal.sources[:accepted] if s == Source.NGRAM)


@dataclass(frozen=True)
class Budget:
    """What a round may propose: up to `k` model-drafted tokens (0: none), at most `limit` target ids
    in all, retrieved tokens or not; `only`: which translations the request's verification accepts
    (translate/translator.py); `ahead`: draft k tokens whatever an acceptance head says (a device
    drafting ahead for a server's engine, whose budget decides what is verified)."""

    k: int
    limit: int
    retrieve: bool = True
    only: str = "any"
    ahead: bool = False


@dataclass(frozen=True)
class Outcome:
    """A round's outcome: `new`, the target ids the target committed, of which the first
    `accepted` are proposed tokens (then the target's own token, unless the request ended)."""

    new: list[int]
    accepted: int


class Proposer(Protocol):
    """Proposes a round's target ids. One proposer serves every request of its pairing, and
    requests may run at once (the server's sessions, an engine's steps): its calls are made with
    no lock held, so what it shares across requests it guards itself; what `begin` returns is one
    request's alone, and that request's calls come one at a time."""

    def begin(self, request: RequestState) -> Any:
        """A new request: the proposer's state for it (whatever `propose` and `settle` need)."""
        ...

    def propose(self, state: Any, budget: Budget) -> Round | None:
        """Up to `budget.limit` target ids after the committed text (`state`'s request's target
        ids), or None: nothing worth proposing this round."""
        ...

    def settle(self, state: Any, rnd: Round, outcome: Outcome) -> None:
        """The outcome of `rnd` (what the target committed): learn from it, and follow the committed text."""
        ...


@runtime_checkable
class Extendable(Protocol):
    """A proposer whose last proposal can grow while its verify is still out (a device drafting
    ahead of a server's engine, targets/remote_stream.py)."""

    def extend(self, state: Any, rnd: Round, k: int, limit: int) -> Round | None: ...

    def may_resume(self, state: Any, rnd: Round) -> bool: ...


class Booking(NamedTuple):
    """A round waiting to be booked against the target alone (adaptive/floor.py) when the next one
    begins: it committed `committed` tokens from `began` (perf_counter seconds); `proposed`: it
    proposed tokens, `drafted`: the drafter model drafted them, `alone`: the target decoded them
    alone (a stretch the floor stood aside for); `measures`: False where that stretch also read the
    prompt, not timed apart, so its time is no measure of the target's step."""

    committed: int
    began: float
    proposed: bool = False
    drafted: bool = False
    alone: bool = False
    measures: bool = True
    first: float | None = None  # an alone stretch's first token's seconds


@dataclass
class RequestState:
    """A request's state between rounds. `session`: the target session (or a stand-in holding the
    committed target ids, where an engine verifies in its own step); `k`: the next model draft
    length (0: none); `read`: the deferred read of the prompt (retrieve/retriever.py); `idle`: the
    last round did not draft (the next draft also catches the drafter up: not a drafting cost);
    `pending`: the last round's costs,
    observed when the next begins; `ledger`: what its rounds gained or lost against the target
    decoding alone (adaptive/floor.py), `booking` the last round's until the next begins;
    `may_decode`: the target may decode a stretch alone where the floor stands aside (greedy, and
    no top-k rows asked of each round)."""

    session: TargetSession
    rule: Rule
    generator: torch.Generator | None
    prompt_ids: list[int]
    drafter_ids: list[int]
    k: int
    stopper: Stopper | None
    read: PromptRead
    ledger: Ledger
    produced: int = 0
    idle: bool = False
    pending: tuple[int, float, int, float, float] | None = None
    booking: Booking | None = None
    may_decode: bool = False
