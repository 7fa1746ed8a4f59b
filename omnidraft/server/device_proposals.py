"""A device's rounds inside the server's engine step: the device drafts, the engine verifies.

A device may stream a session (`/speculate`): the rest of its completion is one engine request.
On `omnidraft serve --engine vllm`, after every engine step vLLM's proposer
(targets/vllm_proposer.py) asks this object for the row's next draft; on an in-process engine with
measured verify costs (OpenVINO, llama.cpp) the server runs the request's step loop itself
(`step_loop`) and asks it the same way. The device hears of the
committed ids at once (`prepare`, before the step's output travels vLLM's usual way), drafts after
them and posts its proposal (`offer`); the engine takes the newest proposal that still continues
the committed text, cut to the server's draft budget, and waits for one at most `wait_s()` (a step
without a draft decodes one token, which a round would cost anyway). Whatever the device sends,
the engine verifies it: the committed text is the engine's own greedy decoding.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

from ..decode.verify import accepted_prefix
from ..target import Rule
from ..wire import MAX_PROPOSAL, GenerateChunk, ProposalReply, ProposalRequest, SpeculateRequest
from .budget import DraftBudget, DraftGate
from .config import HTTPError, ServerConfig, sampling_rule
from .lookup import PromptLookup
from .metrics import Metrics
from .sessions import Session, ended

if TYPE_CHECKING:
    from ..target import StreamingSession, Target

__all__ = ["DeviceProposals", "SpeculateRoutes", "follow_engine", "step_loop"]

CANCELLED = object()  # on a stream's events: its session was deleted


class DeviceProposals:
    """One streaming session's side of the engine's speculative step (see the module docstring).

    `start`: the prompt's length; `budget()`: the draft tokens the server takes now (0: none);
    `observe(proposed, accepted)`: told each settled round's figures (the server's metrics)."""

    def __init__(
        self,
        start: int,
        max_tokens: int,
        eos_ids: frozenset[int] | set[int],
        budget: Callable[[], int],
        wait_s: Callable[[], float],
        observe: Callable[[int, int], None] = lambda proposed, accepted: None,
    ) -> None:
        self.start, self.max_tokens, self.eos_ids = start, max_tokens, frozenset(eos_ids)
        self.budget, self.wait_s, self.observe = budget, wait_s, observe
        # lists of generated ids told early, and the engine's outputs for this request (speculate)
        self.events: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._proposal: tuple[int, list[int]] | None = None  # (context length it drafts after, ids)
        self._given: tuple[int, list[int]] | None = None  # the last draft handed to the engine
        self.lookup = PromptLookup()  # drafts from the context, for steps the device has none for
        self._looked = False  # whether the last draft handed over came from the lookup
        self._published = 0
        self._misses = 0  # asks in a row the device did not answer in time: stop waiting after two
        self._asked: tuple[int, float] | None = None  # the committed length last asked for, and when
        self.committed = (
            start  # the committed length the engine has reached (a proposal builds on at most this)
        )
        self.waited = 0.0  # seconds the engine spent waiting for this device
        self._told: float | None = None  # when the ids of the step that just ran were told

    # the engine's side (vLLM's proposer, on the engine's thread)
    def open(self, ids: list[int], drafter_ids: list[int] | None = None) -> None:
        """Nothing to open: the device holds the drafter."""

    def prepare(self, ids: list[int]) -> None:
        """Tell the device the committed ids of a step that just ran (before the engine asks
        `next`, so the device drafts while the other rows are asked). Not while the budget takes
        no draft: the device drafts nothing then, and the engine's output tells it soon enough."""
        self._told = time.monotonic()  # every row is told at once: their waits end together
        if self.budget() <= 0:
            return
        generated = ids[self.start : self.start + self.max_tokens]
        end = next((i + 1 for i, t in enumerate(generated) if t in self.eos_ids), len(generated))
        if end > self._published:
            self._published = end
            self.events.put(list(generated[:end]))

    def stepped(self, ids: list[int]) -> None:
        """A step of the server's own loop (`step_loop`) committed up to `ids`, about to go out."""
        self._told = time.monotonic()
        self.committed = max(self.committed, len(ids))

    def next(self, ids: list[int], limit: int, remaining: int) -> list[int]:
        """The device's newest proposal that continues `ids`, at most the budget's length; waits
        up to `wait_s()` for the device to propose after `ids` when it has not yet."""
        self._settle(ids)
        self.committed = max(self.committed, len(ids))
        limit = min(limit, self.budget())
        draft: list[int] = []
        if limit > 0:
            began = time.monotonic()
            told = self._told if self._told is not None else began
            wait = self.wait_s()
            self._asked = (len(ids), told + wait)
            deadline = told + (wait if self._misses < 2 else 0.0)
            with self._cond:
                while not (draft := self._continuing(ids)) and not self._answered(len(ids)):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._misses += 1
                        break
                    self._cond.wait(left)
            self.waited += time.monotonic() - began
        self._looked = not draft and limit > 0
        if self._looked:
            draft = self.lookup.propose(ids, limit)
        self._given = (len(ids), draft[:limit])
        return draft[:limit]

    def cancel(self) -> None:
        """The session was deleted: the stream ends at once, its engine request aborted."""
        self.events.put(CANCELLED)

    # the device's side
    def offer(self, at: int, proposal: list[int]) -> None:
        """The device's proposal, drafted after the first `at` committed ids (ValueError past the
        committed length: a proposal for text not yet committed would shadow the ones that are).
        Only a proposal that answers an ask in time makes the engine wait again after misses: a
        device whose proposals arrive a step late (a long round trip) is not waited for."""
        with self._cond:
            if at > max(self.committed, self.start + self._published):
                raise ValueError(
                    f"a proposal builds on at most the committed {self.committed} tokens, got at={at}"
                )
            if self._proposal is None or at >= self._proposal[0]:
                self._proposal = (at, list(proposal))
            if self._asked is not None and at >= self._asked[0] and time.monotonic() <= self._asked[1]:
                self._misses = 0
            self._cond.notify_all()

    def _answered(self, n: int) -> bool:
        return self._proposal is not None and self._proposal[0] >= n

    def _continuing(self, ids: list[int]) -> list[int]:
        if self._proposal is None:
            return []
        at, proposal = self._proposal
        done = len(ids) - at
        return proposal[done:] if 0 <= done <= len(proposal) and ids[at:] == proposal[:done] else []

    def _settle(self, ids: list[int]) -> None:
        if self._given is None:
            return
        at, draft = self._given
        accepted = accepted_prefix(draft, ids[at:])
        self.observe(len(draft), accepted)
        if self._looked:
            self.lookup.observe(len(draft), accepted)
        self._given = None


def follow_engine(
    session: StreamingSession, source: DeviceProposals, rule: Rule = Rule()
) -> Iterator[list[int]]:
    """The generated ids of a streaming session as they become known: each yield is every id so far.
    vLLM's outputs arrive on `source.events`, beside the ids the proposer tells `source` earlier
    (while the budget takes drafts), which must agree with them: one queue, read here, no thread of
    its own per session. Greedy, or sampled under `rule` (vLLM's rejection sampler verifies the
    proposals). Closing the iterator aborts the request."""
    events = source.events
    stream = session.start(source.max_tokens, source, outputs=events, rule=rule)
    final: list[int] = []
    sent: list[int] = []
    finished = False
    try:
        while (item := events.get()) is not None:
            if item is CANCELLED:  # the session was deleted: abort (finally, unfinished)
                return
            if isinstance(item, list):  # told early by the proposer
                ids = item
            else:  # the engine's output: the record
                final += stream.take(item)
                ids = final
            if ids[: len(sent)] != sent[: len(ids)]:
                raise RuntimeError("the proposer's ids disagree with the engine's output")
            source.committed = max(
                source.committed, source.start + len(ids)
            )  # what the device may have heard
            if len(ids) > len(sent):
                sent = list(ids)
                yield sent
        if stream.error is not None:
            raise stream.error
        if final != sent:
            raise RuntimeError("the proposer's ids disagree with the engine's output")
        finished = True
    finally:
        stream.end(finished)


def step_loop(
    session: Session, source: DeviceProposals, model: Any, rule: Rule, timed: Callable[[float], None]
) -> Iterator[list[int]]:
    """An in-process engine's own step loop for a speculate stream, yielding every generated id so
    far after each step: a step takes the device's newest proposal that continues the committed ids
    (waiting for one at most `source.wait_s()` after the last step's ids went out, the model free
    meanwhile), verifies it in one forward under `model` (the server's model lock) and commits what
    the target accepts and the token it emits; with no proposal it decodes one token. Greedy, or
    sampled under `rule` (the verification rule keeps the target's distribution). `timed` is told
    each forward's seconds. Ends early once the session is deleted."""
    import torch

    generator = torch.Generator().manual_seed(rule.seed) if rule.seed is not None else None
    generated: list[int] = []
    inner = session.inner
    while len(generated) < source.max_tokens and not session.cancelled.is_set():
        remaining = source.max_tokens - len(generated)
        draft = source.next(list(inner.ids), remaining - 1, remaining)
        with model:
            started = time.perf_counter()
            verdict = inner.verify(torch.tensor(draft, dtype=torch.long), rule, None, generator)
            timed(time.perf_counter() - started)
        new = draft[: verdict.accepted] + [verdict.token]
        end = next((i + 1 for i, t in enumerate(new) if t in source.eos_ids), len(new))
        generated += new[:end]
        source.stepped(inner.ids)
        yield list(generated)
        if generated[-1] in source.eos_ids:
            return


class SpeculateRoutes:
    """`speculate` and `propose`, mixed into `Service` (over the state and checks it provides)."""

    target: Target
    config: ServerConfig
    metrics: Metrics
    costs: dict[int, float] | None
    _session: Callable[..., Session]
    _claim_stream: Callable[[Session, int, int], Callable[[], None]]
    _check_ids: Callable[[Any, str], None]
    budget: DraftBudget | None
    drafts: DraftBudget | None  # a streaming session's: `budget`, or an in-process engine's (one session's)
    streams: bool  # whether `speculate` is served (the engine's step loop, or the server's)
    model_lock: Any
    gate: DraftGate  # whether the budget's drafts measured faster than none at this load
    _gate_lock: threading.Lock

    def speculate(self, sid: str, request: SpeculateRequest, key: int = 0) -> Iterator[bytes]:
        """Checks `request` now (a stale one is refused with its status), then returns the NDJSON
        stream of the session's continuation, decoded in the engine's loop while the engine
        verifies the proposals the device posts to `propose`."""
        if not self.streams:
            raise HTTPError(
                409,
                "this server's engine verifies one request per round: use /verify "
                "(streaming speculation needs an engine with measured verify costs, or vLLM's)",
            )
        session = self._session(sid, key)
        rule = sampling_rule(request)
        with session.lock:
            end = self._claim_stream(session, request.committed, request.max_tokens)
            start, limit, eos = request.committed, request.max_tokens, self.target.eos_ids
            source = DeviceProposals(start, limit, eos, self._engine_budget, self._wait_s, self._observe)
            session.source, session.verified = source, True
        return ended(self._speculating(session, source, start, rule, end), end)

    def propose(self, sid: str, request: ProposalRequest, key: int = 0) -> ProposalReply:
        """A streaming session's newest proposal (the engine takes it at its next step if it still
        continues the committed text)."""
        session = self._session(sid, key)
        source = session.source
        if source is None:
            raise HTTPError(409, "the session is not streaming a speculate reply: open one first")
        self._check_ids(request.proposal, "proposal")
        try:
            source.offer(request.at, list(request.proposal))
        except ValueError as exc:
            raise HTTPError(422, str(exc)) from exc
        return ProposalReply(budget=self._engine_budget())

    def _speculating(
        self, session: Session, source: DeviceProposals, start: int, rule: Rule, end: Callable[[], None]
    ) -> Iterator[bytes]:
        sent, done = 0, False
        steps = (
            follow_engine(cast("StreamingSession", session.inner), source, rule)
            if self.target.capabilities.drafts_in_engine
            else step_loop(session, source, self.model_lock, rule, self.metrics.observe)
        )
        try:
            for ids in steps:
                session.used = time.monotonic()
                done = len(ids) >= source.max_tokens or ids[-1] in source.eos_ids
                chunk = GenerateChunk(
                    tokens=ids[sent:], committed=start + len(ids), done=done, budget=self._engine_budget()
                )
                with self._gate_lock:
                    self.gate.count(len(ids) - sent)
                sent = len(ids)
                yield chunk.model_dump_json().encode() + b"\n"
            if not done:  # the stream was cut (its session closed): its last chunk says so
                yield GenerateChunk.cut(start + sent)
        finally:
            session.source = None
            end()

    def _engine_budget(self) -> int:
        """The draft tokens a streaming session's proposal may have now (the engine verifies them
        in its own step: no context tail is recomputed), while the gate measures that they pay."""
        drafts = self.drafts
        if drafts is None:
            return MAX_PROPOSAL
        budget = drafts(0)
        with self._gate_lock:
            return budget if self.gate.allow(drafts.active_n, budget > 0) else 0

    def _wait_s(self) -> float:
        """How long a step waits for a streaming device's proposal: `proposal_wait_s`, at most a
        quarter of a step, shared by the active sessions (the whole batch waits)."""
        step = self.drafts.costs.get(1, 0.0) if self.drafts is not None else 0.0
        wait = min(self.config.proposal_wait_s, step / 4) if step else self.config.proposal_wait_s
        return wait / max(1, self.drafts.active_n if self.drafts is not None else 1)

    def _observe(self, proposed: int, accepted: int) -> None:
        self.metrics.rounds += 1
        self.metrics.proposed += proposed
        self.metrics.accepted += accepted
        if self.drafts is not None:
            self.drafts.acceptance.observe(proposed, accepted)
