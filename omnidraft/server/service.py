"""The verification server's state and rules, independent of the web framework (server.py serves
it over HTTP): sessions with their locks, limits and KV budget, verify, streamed decoding and the
draft budget; refusals are `HTTPError`s (config.py). On an engine that runs one forward at a time
(PyTorch, llama.cpp) a fair model lock serialises model calls and a long prompt is fed in chunks,
so other sessions' verifies interleave with its prefill (the bound: docs/remote.md). On an engine
that batches sessions (vLLM) there is no model lock: each session's own lock orders its requests.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import torch

from ..decode.generation import TokenLogprob, token_logprobs
from ..target import BatchingTarget, ChunkedSession, Rule, StreamingSession, Target, check_target
from ..wire import (
    MAX_PROPOSAL,
    GenerateChunk,
    GenerateRequest,
    InfoReply,
    OpenReply,
    OpenRequest,
    PromptGenerateRequest,
    ServerLoad,
    VerifyReply,
    VerifyRequest,
)
from .budget import DraftBudget, DraftGate
from .config import HTTPError, ServerConfig, check_ids, dense_draft_rows, sampling_rule, shown, verify_rule
from .device_proposals import SpeculateRoutes
from .metrics import Metrics
from .sessions import FairLock, Session, ended, release_session, serving
from .text_routes import TextRoutes

# the last three re-exported
__all__ = ["PREFILL_CHUNK", "FairLock", "HTTPError", "ServerConfig", "Service", "sampling_rule"]

PREFILL_CHUNK = 512  # prompt tokens one model call may take at most
PREFILL_FIRST = 64  # a prefill's first call, before its time is known
PREFILL_LEAST = 16  # the smallest call: where even this takes past the slice (a long context on a CPU)
PREFILL_SLICE_S = 0.25  # seconds one prefill call aims to hold the model: what another session waits at most
ACTIVE_S = 1.0  # a session that verified within this many seconds counts in the load a draft budget serves


class Service(TextRoutes, SpeculateRoutes):
    """The server's state, independent of the web framework (so it can be tested directly)."""

    def __init__(self, target: Target, config: ServerConfig) -> None:
        self.target, self.config = target, config
        self.vocab = len(target.token_bytes)
        self.sessions: dict[str, Session] = {}
        check_target(target)
        can = target.capabilities
        cache = cast(BatchingTarget, target).prefix_cache_counters if can.batches_sessions else lambda: None
        self.metrics = Metrics(counters=target.engine_counters, cache=cache)
        # re-entrant: a stream's end may run from the garbage collector (sessions.ended), lock held
        self.table_lock = threading.RLock()
        # one model forward at a time on an engine that runs one; one that batches (vLLM) schedules them
        self.batches = can.batches_sessions
        self.model_lock: Any = contextlib.nullcontext() if self.batches else FairLock()
        self.inflight: dict[int, int] = {}  # per key: tokens of completions and streams served (KV budget)
        costs = target.verify_costs() if self.batches else None
        # step costs by tokens (server/budget.py): one sequence's verifies, then steps over many rows
        self.costs: dict[int, float] | None = (
            None if costs is None else {**costs, **cast(BatchingTarget, target).batch_costs()}
        )
        self.budget = DraftBudget(self.costs, self._active_sessions, MAX_PROPOSAL - 1) if self.costs else None
        # an in-process engine whose verify costs are measured (OpenVINO, llama.cpp) runs a speculate
        # stream in a step loop of the server's own (device_proposals.step_loop), one session's
        # verify at a time: its budget is one session's
        own = None if self.batches or not can.in_process else target.verify_costs()
        self.drafts = DraftBudget(own, lambda: 1, MAX_PROPOSAL - 1) if own else self.budget
        self.streams = can.drafts_in_engine or own is not None
        self.gate, self._gate_lock = DraftGate(), threading.Lock()  # streaming sessions' drafts, measured
        self._counted: tuple[int, float] | None = None  # the engine's counters at the last `load()`
        self.context: int | None = target.context_length  # None: unbounded
        with tempfile.TemporaryDirectory() as tmp:
            target.tokenizer.save_pretrained(tmp)
            self.tokenizer_files = {
                p.name: p.read_text(encoding="utf-8") for p in Path(tmp).iterdir() if p.is_file()
            }

    def info(self) -> InfoReply:
        return InfoReply(
            name=self.target.name,
            vocab_size=self.vocab,
            fingerprint=self.target.token_bytes.fingerprint,
            eos_ids=sorted(self.target.eos_ids),
            drafts_in_engine=self.streams,
            load=self.load(),
        )

    def load(self) -> ServerLoad:
        """The load the server advertises (wire.ServerLoad): sessions verifying lately, the mean
        engine step since the last call, and the draft budget a streaming session gets now."""
        counters = self.metrics.engine()
        step_s = None
        with self.table_lock:
            last, self._counted = self._counted, counters
        if last is not None and counters[0] > last[0]:
            step_s = (counters[1] - last[1]) / (counters[0] - last[0])
        return ServerLoad(
            sessions=self._active_sessions(),
            step_s=step_s,
            draft_budget=self.drafts() if self.drafts is not None else None,
        )

    def open(self, request: OpenRequest, key: int = 0) -> OpenReply:
        self._check_ids(request.prompt_ids, "prompt")
        self._check_context(len(request.prompt_ids) + 1, "the session")
        with self.table_lock:
            self._expire()
            share, most = self.config.key_sessions, self.config.max_sessions
            shared = len(self.config.keys) > 1 or self.config.max_sessions_per_key is not None
            if shared and sum(1 for v in self.sessions.values() if v.key == key) >= share:
                why = f"this API key holds its share of {share} of the server's {most} sessions"
                raise HTTPError(429, f"{why}; close one or retry later")
            if len(self.sessions) >= self.config.max_sessions:
                raise HTTPError(
                    503, f"the server holds its maximum of {self.config.max_sessions} sessions; retry later"
                )
            self._reserve(len(request.prompt_ids), key)
            sid = uuid.uuid4().hex
            self.sessions[sid] = Session(self.target.begin(list(request.prompt_ids)), time.monotonic(), key)
            self.metrics.opened += 1
        return OpenReply(session=sid, committed=len(request.prompt_ids))

    def verify(
        self, sid: str, request: VerifyRequest, key: int = 0, cancel: threading.Event | None = None
    ) -> VerifyReply:
        """Verify a proposal; `cancel` set (its client left) stops its prefill or its engine's work."""
        session = self._session(sid, key)
        self._check_ids(request.proposal, "proposal")
        rule = verify_rule(request)
        proposal = tuple(request.proposal)
        with session.lock, serving(session, self.table_lock):
            self._check_idle(session)
            if not self._replays(session, request):  # before any model work: a stale request costs nothing
                self._check_committed(session, request.committed)
            session.inner.cancel = cancel  # an engine computing elsewhere (vLLM) stops when it is set
            try:
                self._prefill(session, cancel)
                session.used = time.monotonic()  # a fresh session's idle time counts from its prefill's end
                with self.model_lock:  # one request of a session at a time: the committed check is race-free
                    return self._verify(session, request, rule, proposal)
            finally:
                session.inner.cancel = None

    @staticmethod
    def _replays(session: Session, request: VerifyRequest) -> bool:
        """Whether `request` is a retry of the request the session applied last (answered again)."""
        return session.last is not None and session.last[0] == request

    @staticmethod
    def _check_committed(session: Session, committed: int) -> None:
        """Refuse a request that does not build on the session's committed tokens (409)."""
        if committed != len(session.inner.ids):
            raise HTTPError(
                409,
                f"stale request: it builds on {committed} committed tokens, "
                f"the session has {len(session.inner.ids)}",
                committed=len(session.inner.ids),
            )

    def _verify(
        self, session: Session, request: VerifyRequest, rule: Rule, proposal: tuple[int, ...]
    ) -> VerifyReply:
        """The verify itself, under the session's lock and the model lock."""
        if session.last is not None and self._replays(session, request):
            return session.last[
                1
            ]  # a retry of the request applied last (all of it): same answer, applied once
        self._check_committed(session, request.committed)
        committed = len(session.inner.ids)
        self._check_context(committed + len(proposal) + 1, "the session")
        with self.table_lock:
            self._reserve(len(proposal) + 1, session.key)
        q = (
            dense_draft_rows(request, self.vocab)
            if rule.mode in ("exact", "omnidraft") and proposal
            else None
        )
        generator = torch.Generator().manual_seed(request.seed) if request.seed is not None else None
        started = time.perf_counter()
        try:
            verdict = session.inner.verify(
                torch.tensor(proposal, dtype=torch.long), rule, q, generator, topk=request.topk
            )
        except ValueError as exc:  # a rule this engine refuses (it names why); the session is unchanged
            raise HTTPError(422, str(exc)) from exc
        self.metrics.observe(time.perf_counter() - started)
        self.metrics.rounds += 1
        self.metrics.accepted += verdict.accepted
        self.metrics.proposed += len(proposal)
        if self.budget is not None:
            self.budget.acceptance.observe(len(proposal), verdict.accepted)
        reply = VerifyReply(
            committed=len(session.inner.ids),
            accepted=verdict.accepted,
            token=verdict.token,
            budget=self._budget(),
            topk_ids=verdict.topk[0].tolist() if verdict.topk else None,
            topk_logp=verdict.topk[1].tolist() if verdict.topk else None,
        )
        session.last, session.used, session.verified = (request, reply), time.monotonic(), True
        return reply

    def generate(self, sid: str, request: GenerateRequest, key: int = 0) -> Iterator[bytes]:
        """Checks `request` now (so a stale one is refused with its status), then returns the
        NDJSON stream that decodes alone: one token per step, the model lock held per step only,
        so other sessions' verifies interleave."""
        session = self._session(sid, key)
        with session.lock:
            end = self._claim_stream(session, request.committed, request.max_tokens)
        return ended(self._stream(session, request.max_tokens, end), end)

    def _claim_stream(self, session: Session, committed: int, max_tokens: int) -> Callable[[], None]:
        """Under the session's lock, for a stream of up to `max_tokens` more tokens after
        `committed`: refuse it while another stream runs, when it is stale, or past the context or
        the KV budget; else mark the session streaming and hold its tokens in the key's share for
        the stream's life. Returns the stream's end (once, however often called)."""
        self._check_idle(session)
        self._check_committed(session, committed)
        self._check_context(committed + max_tokens, "the session")
        release = self._hold(max_tokens, session.key)
        session.streaming = True
        session.cancelled.clear()

        def end() -> None:
            release()
            session.streaming = False

        return end

    def generate_alone(self, request: PromptGenerateRequest, key: int = 0) -> Iterator[bytes]:
        """A whole completion decoded alone with no session kept (what a device that will not
        speculate sends: one exchange). Its tokens count in the KV budget while it streams."""
        self._check_ids(request.prompt_ids, "prompt")
        budget = len(request.prompt_ids) + request.max_tokens
        self._check_context(budget, "the completion")
        rule = sampling_rule(request)
        release = self._hold(budget, key)
        session = Session(self.target.begin(list(request.prompt_ids)), time.monotonic(), key)

        def stream() -> Iterator[bytes]:
            try:
                yield from self._decode(session, request.max_tokens, rule)
            finally:
                release()

        return ended(stream(), release)

    def _stream(self, session: Session, max_tokens: int, end: Callable[[], None]) -> Iterator[bytes]:
        """The session's stream; while it runs the session refuses other requests (409)."""
        try:
            yield from self._decode(session, max_tokens)
        finally:
            end()

    def _decode(self, session: Session, max_tokens: int, rule: Rule = Rule()) -> Iterator[bytes]:
        """Stream up to `max_tokens` tokens decoded alone under `rule` (greedy by default)."""
        generator = torch.Generator().manual_seed(rule.seed) if rule.seed is not None else None
        tokens = (
            self._engine_decode(session, max_tokens, rule)
            if self.batches
            else self._stepwise(session, max_tokens, rule, generator)
        )
        for step, token in enumerate(tokens):
            if session.cancelled.is_set():  # its session was deleted: say so, stop (closing `tokens` aborts)
                yield GenerateChunk.cut(len(session.inner.ids))
                return
            self.metrics.rounds += 1
            session.last, session.used = None, time.monotonic()
            done = token in self.target.eos_ids or step == max_tokens - 1
            chunk = GenerateChunk(tokens=[token], committed=len(session.inner.ids), done=done)
            yield chunk.model_dump_json().encode() + b"\n"
            if done:
                return

    def _prefill(self, session: Session, cancel: threading.Event | None = None) -> None:
        """Feed a session's uncached prompt in model calls of about PREFILL_SLICE_S seconds each
        (each call sized by the last one's time, as a chunk's cost grows with the context it attends
        to; PREFILL_LEAST to PREFILL_CHUNK tokens), taking the model lock per call, so other
        sessions' verifies interleave with a long prompt's prefill (an engine that batches sessions
        bounds a prefill's tokens per step itself). Stops (499) once `cancel` is set or the session
        deleted."""
        if not self.target.capabilities.prefills_in_chunks:
            return
        inner, limit = cast(ChunkedSession, session.inner), PREFILL_FIRST
        while inner.pending:  # a session with nothing to feed does not queue for the model twice
            if session.cancelled.is_set() or (cancel is not None and cancel.is_set()):
                raise HTTPError(499, "the client or its session went away during the prefill")
            with self.model_lock:
                started = time.perf_counter()
                if inner.prefill(limit) == 0:
                    return
                took = time.perf_counter() - started
            limit = max(
                PREFILL_LEAST, min(PREFILL_CHUNK, 2 * limit, int(limit * PREFILL_SLICE_S / max(took, 1e-4)))
            )

    def _stepwise(
        self,
        session: Session,
        max_tokens: int,
        rule: Rule = Rule(),
        generator: torch.Generator | None = None,
        logprobs: list[TokenLogprob] | None = None,
        top: int = 0,
    ) -> Iterator[int]:
        """One token a step under `rule` (greedy by default), the model lock held per step only:
        other sessions' verifies interleave. With `logprobs` (a list), each token's log-prob and its
        `top` alternatives are appended to it before the token is yielded."""
        empty = torch.zeros(0, dtype=torch.long)
        self._prefill(session)
        for _ in range(max_tokens):
            with self.model_lock:
                started = time.perf_counter()
                verdict = session.inner.verify(
                    empty, rule, None, generator, topk=max(1, top) if logprobs is not None else 0
                )
                self.metrics.observe(time.perf_counter() - started)
            if logprobs is not None and verdict.topk is not None:
                logprobs += token_logprobs([verdict.token], [(*verdict.topk, verdict.chosen)], top)
            yield verdict.token

    def _engine_decode(self, session: Session, max_tokens: int, rule: Rule = Rule()) -> Iterator[int]:
        """The engine's own decoding loop (one request, batched with other sessions' work), greedy
        or sampled under `rule`; closing this iterator (the client went away) aborts the request."""
        inner = cast(StreamingSession, session.inner)  # (a target that batches sessions)
        tokens = inner.decode(max_tokens, rule) if rule.mode != "greedy" else inner.decode(max_tokens)
        try:
            yield from tokens
        finally:
            tokens.close()

    def close(self, sid: str, key: int = 0) -> None:
        """Drop a session; a stream it runs ends at its next token (its engine request aborted)."""
        self._session(sid, key)  # 404 unless it is there for this key
        with self.table_lock:
            session = self.sessions.pop(sid, None)
        if session is not None:
            session.cancel()
        release_session(session)

    def _session(self, sid: str, key: int = 0) -> Session:
        with self.table_lock:
            self._expire()
            session = self.sessions.get(sid)
            if session is None or session.key != key:  # another key's session is not there for this one
                raise HTTPError(404, f"no session {shown(sid)} (closed, expired or never opened)")
            return session  # only a request that is served refreshes `used` (a stale one keeps nothing alive)

    def _hold(self, tokens: int, key: int) -> Callable[[], None]:
        """Reserve `tokens` of the KV budget for a request that keeps no session (a completion, a
        /v1/generate stream); returns the release, which takes effect once however often called."""
        with self.table_lock:
            self._reserve(tokens, key)
            self.inflight[key] = self.inflight.get(key, 0) + tokens
        held = [tokens]

        def release() -> None:
            with self.table_lock:
                self.inflight[key] -= held.pop() if held else 0

        return release

    def _budget(self) -> int | None:
        """The draft tokens each session may send next round at the present load (server/budget.py),
        on an engine that batches sessions and reports its verify costs; None (no limit) otherwise."""
        return None if self.budget is None else self.budget(cast(BatchingTarget, self.target).verify_tail)

    def _active_sessions(self) -> int:
        now = time.monotonic()
        with self.table_lock:
            return sum(1 for v in self.sessions.values() if now - v.used < ACTIVE_S)

    @staticmethod
    def _check_idle(session: Session) -> None:
        if session.streaming:
            raise HTTPError(409, "the session is streaming a generate reply; wait for its last chunk")

    def _expire(self) -> None:
        now = time.monotonic()
        ttl = self.config.ttl_s
        for sid in [
            s
            for s, v in self.sessions.items()
            if not v.in_use and now - v.used > (ttl if v.verified else min(ttl, self.config.fresh_ttl_s))
        ]:
            release_session(self.sessions.pop(sid))

    def _reserve(self, extra: int, key: int) -> None:
        """Refuse `extra` KV tokens past the server's budget (503) or past the key's share (429)."""
        mine = sum(len(s.inner.ids) for s in self.sessions.values() if s.key == key) + self.inflight.get(
            key, 0
        )
        if mine + extra > self.config.key_tokens:
            raise HTTPError(
                429,
                f"this API key holds its KV quota of {self.config.key_tokens} tokens; "
                "close a session or retry later",
            )
        held = sum(len(s.inner.ids) for s in self.sessions.values()) + sum(self.inflight.values())
        if held + extra > self.config.max_tokens:
            raise HTTPError(
                503, f"the server's KV budget of {self.config.max_tokens} tokens is in use; retry later"
            )

    def _check_context(self, tokens: int, what: str) -> None:
        if self.context is not None and tokens > self.context:
            raise HTTPError(
                422, f"{what} would hold {tokens} tokens, past the target's context of {self.context}"
            )

    def _check_ids(self, ids: Any, what: str) -> None:
        check_ids(ids, self.vocab, what)
