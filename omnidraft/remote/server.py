"""A verification server: one target model, many device sessions, over HTTP (FastAPI + uvicorn).

    POST   /v1/sessions                 OpenRequest  -> OpenReply
    POST   /v1/sessions/{id}/verify     VerifyRequest -> VerifyReply
    POST   /v1/sessions/{id}/generate   GenerateRequest -> NDJSON GenerateChunk per committed token
    POST   /v1/generate                 PromptGenerateRequest -> the same stream, with no session kept
    DELETE /v1/sessions/{id}
    GET    /v1/info, /v1/tokenizer      what a device needs to pair (name, vocab, fingerprint, files)
    GET    /health, /metrics            liveness; Prometheus text

Every /v1 route and /metrics need `Authorization: Bearer <key>` when the server has a key
(compared in constant time; missing or wrong -> 401; `open_metrics` opens /metrics to scrapers).
With several keys, a session belongs to the key that opened it (404 to any other) and each key
holds at most `max_sessions_per_key` sessions (429 past it).
A body is read within `body_timeout_s` (408) and a client gone mid-body is answered 400, not logged
as a crash. Bodies are read with a size cap (413) and validated by
the protocol models (422 with the reason); ids outside the vocabulary are refused (422). Sessions
expire after `ttl_s` idle, and a cap on sessions and on committed tokens across sessions (KV memory)
answers 503 rather than exhausting the host. One model forward runs at a time (a CPU has no spare
parallelism to give); requests queue in the thread pool. See protocol.py for the idempotency rule.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import tempfile
import threading
import time
import uuid
import weakref
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from ..target import Rule
from .budget import draft_budget
from .metrics import Metrics
from .protocol import (MAX_PROMPT, MAX_PROPOSAL, VERSION, GenerateChunk, GenerateRequest, InfoReply, OpenReply, OpenRequest,
                       PromptGenerateRequest, VerifyReply, VerifyRequest)

__all__ = ["ServerConfig", "create_app"]

log = logging.getLogger(__name__)

ACTIVE_S = 1.0  # a session that verified within this many seconds counts in the load a draft budget serves

@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    api_key: str | tuple[str, ...] | None = None  # one key, or several (each with its own session quota)
    max_sessions_per_key: int | None = None  # None: a key may hold all `max_sessions`
    max_sessions: int = 64
    ttl_s: float = 600.0
    max_body_bytes: int = 8 << 20
    max_tokens: int = 262_144  # committed tokens over all sessions: bounds KV-cache memory
    body_timeout_s: float = 30.0  # a request body not read completely within this is refused (408)
    open_metrics: bool = False  # True: /metrics without the API key (a scraper on a private network)

    def __post_init__(self) -> None:
        if (self.max_sessions < 1 or self.ttl_s <= 0 or self.max_body_bytes < 1024 or self.max_tokens < 1
                or self.body_timeout_s <= 0 or (self.max_sessions_per_key is not None and self.max_sessions_per_key < 1)):
            raise ValueError(f"server limits must be positive (body >= 1 KiB), got {self}")
        if isinstance(self.api_key, tuple) and (not self.api_key or not all(self.api_key)):
            raise ValueError("api_key: give one key or a non-empty tuple of non-empty keys")

    @property
    def keys(self) -> tuple[str, ...]:
        return () if self.api_key is None else (self.api_key,) if isinstance(self.api_key, str) else self.api_key


@dataclass
class _Session:
    inner: Any
    used: float
    key: int = 0  # which API key opened it: only that key may use it
    last: tuple[VerifyRequest, VerifyReply] | None = None  # the request applied last and its reply
    lock: threading.Lock = field(default_factory=threading.Lock)  # one request of this session at a time
    streaming: bool = False  # a generate stream is running: other requests are refused until it ends


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _Service:
    """The server's state, independent of the web framework (so it can be tested directly)."""

    def __init__(self, target: Any, config: ServerConfig) -> None:
        self.target, self.config = target, config
        self.vocab = len(target.token_bytes)
        self.sessions: dict[str, _Session] = {}
        self.metrics = Metrics()
        self.table_lock = threading.Lock()
        # one model forward at a time on an engine that runs one (PyTorch, llama.cpp); an engine that
        # batches sessions (vLLM) schedules concurrent requests itself, so only a session's own lock holds
        self.batches = bool(getattr(target, "batches_sessions", False))
        self.model_lock: Any = contextlib.nullcontext() if self.batches else threading.Lock()
        self.inflight = 0  # tokens of /v1/completions and /v1/generate requests being served (counted in the KV budget)
        costs = getattr(target, "verify_costs", None) if self.batches else None
        self.costs: dict[int, float] | None = costs() if costs is not None else None
        model = getattr(target, "model", None)  # None: unbounded
        self.context = getattr(target, "context_length", None) or getattr(getattr(model, "config", None),
                                                                            "max_position_embeddings", None)
        with tempfile.TemporaryDirectory() as tmp:
            target.tokenizer.save_pretrained(tmp)
            self.tokenizer_files = {p.name: p.read_text(encoding="utf-8") for p in Path(tmp).iterdir() if p.is_file()}

    def info(self) -> InfoReply:
        return InfoReply(name=self.target.name, vocab_size=self.vocab, fingerprint=self.target.token_bytes.fingerprint,
                         eos_ids=sorted(self.target.eos_ids))

    def open(self, request: OpenRequest, key: int = 0) -> OpenReply:
        self._check_ids(request.prompt_ids, "prompt")
        self._check_context(len(request.prompt_ids) + 1, "the session")
        with self.table_lock:
            self._expire()
            if len(self.sessions) >= self.config.max_sessions:
                raise _HTTPError(503, f"the server holds its maximum of {self.config.max_sessions} sessions; retry later")
            quota = self.config.max_sessions_per_key
            if quota is not None and sum(1 for v in self.sessions.values() if v.key == key) >= quota:
                raise _HTTPError(429, f"this API key holds its quota of {quota} sessions; close one or retry later")
            self._reserve(len(request.prompt_ids))
            sid = uuid.uuid4().hex
            self.sessions[sid] = _Session(self.target.begin(list(request.prompt_ids)), time.monotonic(), key)
            self.metrics.opened += 1
        return OpenReply(session=sid, committed=len(request.prompt_ids))

    def verify(self, sid: str, request: VerifyRequest, key: int = 0) -> VerifyReply:
        session = self._session(sid, key)
        self._check_ids(request.proposal, "proposal")
        try:
            rule = Rule(mode=request.mode, temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                        min_p=request.min_p)
        except ValueError as exc:
            raise _HTTPError(422, str(exc)) from exc
        proposal = tuple(request.proposal)
        with session.lock, self.model_lock:  # one request of a session at a time: the committed check is race-free
            self._check_idle(session)
            committed = len(session.inner.ids)
            if request.committed != committed:
                if session.last is not None and session.last[0] == request:
                    return session.last[1]  # a retry of the request applied last (all of it): same answer, applied once
                raise _HTTPError(409, f"stale request: it builds on {request.committed} committed tokens, "
                                      f"the session has {committed}")
            self._check_context(committed + len(proposal) + 1, "the session")
            with self.table_lock:
                self._reserve(len(proposal) + 1)
            q = self._dense(request) if rule.mode in ("exact", "omnidraft") and proposal else None
            generator = torch.Generator().manual_seed(request.seed) if request.seed is not None else None
            started = time.perf_counter()
            try:
                verdict = session.inner.verify(torch.tensor(proposal, dtype=torch.long), rule, q, generator,
                                               topk=request.topk)
            except ValueError as exc:  # a rule this engine refuses (it names why); the session is unchanged
                raise _HTTPError(422, str(exc)) from exc
            self.metrics.observe(time.perf_counter() - started)
        self.metrics.rounds += 1
        self.metrics.accepted += verdict.accepted
        self.metrics.proposed += len(proposal)
        reply = VerifyReply(committed=len(session.inner.ids), accepted=verdict.accepted, token=verdict.token,
                            budget=self._budget(),
                            topk_ids=verdict.topk[0].tolist() if verdict.topk else None,
                            topk_logp=verdict.topk[1].tolist() if verdict.topk else None)
        session.last, session.used = (request, reply), time.monotonic()
        return reply

    def generate(self, sid: str, request: GenerateRequest, key: int = 0) -> Iterator[bytes]:
        """Checks `request` now (so a stale one is refused with its status), then returns the
        NDJSON stream that decodes alone: one token per step, the model lock held per step only,
        so other sessions' verifies interleave."""
        session = self._session(sid, key)
        with session.lock:
            self._check_idle(session)
            if request.committed != len(session.inner.ids):
                raise _HTTPError(409, f"stale request: it builds on {request.committed} committed tokens, "
                                      f"the session has {len(session.inner.ids)}")
            self._check_context(request.committed + request.max_tokens, "the session")
            with self.table_lock:
                self._reserve(request.max_tokens)
            session.streaming = True
        return self._stream(session, request.max_tokens)

    def generate_alone(self, request: PromptGenerateRequest, key: int = 0) -> Iterator[bytes]:
        """A whole completion decoded alone with no session kept (what a device that will not
        speculate sends: one exchange). Its tokens count in the KV budget while it streams."""
        self._check_ids(request.prompt_ids, "prompt")
        budget = len(request.prompt_ids) + request.max_tokens
        self._check_context(budget, "the completion")
        with self.table_lock:
            self._reserve(budget)
            self.inflight += budget
        session = _Session(self.target.begin(list(request.prompt_ids)), time.monotonic(), key)

        held = [budget]

        def release() -> None:  # once, whether the stream ends, breaks or never starts
            with self.table_lock:
                self.inflight -= held.pop() if held else 0

        def stream() -> Iterator[bytes]:
            try:
                yield from self._decode(session, request.max_tokens)
            finally:
                release()
        chunks = stream()
        weakref.finalize(chunks, release)
        return chunks

    def _stream(self, session: _Session, max_tokens: int) -> Iterator[bytes]:
        """The session's stream; while it runs the session refuses other requests (409)."""
        try:
            yield from self._decode(session, max_tokens)
        finally:
            session.streaming = False

    def _decode(self, session: _Session, max_tokens: int) -> Iterator[bytes]:
        tokens = self._engine_decode(session, max_tokens) if self.batches else self._stepwise(session, max_tokens)
        for step, token in enumerate(tokens):
            self.metrics.rounds += 1
            session.last, session.used = None, time.monotonic()
            done = token in self.target.eos_ids or step == max_tokens - 1
            chunk = GenerateChunk(tokens=[token], committed=len(session.inner.ids), done=done)
            yield chunk.model_dump_json().encode() + b"\n"
            if done:
                return

    def _stepwise(self, session: _Session, max_tokens: int) -> Iterator[int]:
        """One token a step, the model lock held per step only: other sessions' verifies interleave."""
        empty, rule = torch.zeros(0, dtype=torch.long), Rule()
        for _ in range(max_tokens):
            with self.model_lock:
                started = time.perf_counter()
                token = session.inner.verify(empty, rule).token
                self.metrics.observe(time.perf_counter() - started)
            yield token

    def _engine_decode(self, session: _Session, max_tokens: int) -> Iterator[int]:
        """The engine's own decoding loop (one request, batched with other sessions' work); closing
        this iterator (the client went away) aborts the request."""
        tokens = session.inner.decode(max_tokens)
        try:
            yield from tokens
        finally:
            tokens.close()

    def complete(self, request: Any) -> dict[str, Any]:
        """The OpenAI-compatible /v1/completions (greedy, stateless; see remote/openai.py)."""
        from .openai import complete

        if self.batches:
            raise _HTTPError(501, "/v1/completions is not served on the vllm engine: use /v1/generate, or "
                                  "vLLM's own OpenAI server for plain completions")
        budget = min(len(request.prompt), MAX_PROMPT) + request.max_tokens  # a text prompt's characters bound its tokens
        if isinstance(request.prompt, list):
            self._check_context(budget, "the completion")
        with self.table_lock:
            self._reserve(budget)
            self.inflight += budget
        started = time.perf_counter()
        try:
            reply = complete(self.target, request, self.config.max_tokens, max_prompt=MAX_PROMPT, context=self.context,
                             lock=self.model_lock)
        except ValueError as exc:
            raise _HTTPError(422, str(exc)) from None
        finally:
            with self.table_lock:
                self.inflight -= budget
        self.metrics.observe(time.perf_counter() - started)
        self.metrics.rounds += 1
        return reply

    def close(self, sid: str, key: int = 0) -> None:
        self._session(sid, key)  # 404 unless it is there for this key
        with self.table_lock:
            _release(self.sessions.pop(sid, None))

    def _session(self, sid: str, key: int = 0) -> _Session:
        with self.table_lock:
            self._expire()
            session = self.sessions.get(sid)
            if session is None or session.key != key:  # another key's session is not there for this one
                raise _HTTPError(404, f"no session {sid!r} (closed, expired or never opened)")
            session.used = time.monotonic()
            return session

    def _budget(self) -> int | None:
        """The draft tokens each session may send next round at the present load (remote/budget.py),
        on an engine that batches sessions and reports its verify costs; None (no limit) otherwise."""
        if self.costs is None:
            return None
        now = time.monotonic()
        with self.table_lock:
            active = sum(1 for v in self.sessions.values() if now - v.used < ACTIVE_S)
        m = self.metrics
        acceptance = m.accepted / m.proposed if m.proposed >= 64 else 0.8
        return draft_budget(self.costs, acceptance, max(1, active), MAX_PROPOSAL - 1)

    @staticmethod
    def _check_idle(session: _Session) -> None:
        if session.streaming:
            raise _HTTPError(409, "the session is streaming a generate reply; wait for its last chunk")

    def _expire(self) -> None:
        now = time.monotonic()
        for sid in [s for s, v in self.sessions.items() if now - v.used > self.config.ttl_s]:
            _release(self.sessions.pop(sid))

    def _reserve(self, extra: int) -> None:
        held = sum(len(s.inner.ids) for s in self.sessions.values()) + self.inflight
        if held + extra > self.config.max_tokens:
            raise _HTTPError(503, f"the server's KV budget of {self.config.max_tokens} tokens is in use; retry later")

    def _check_context(self, tokens: int, what: str) -> None:
        if self.context is not None and tokens > self.context:
            raise _HTTPError(422, f"{what} would hold {tokens} tokens, past the target's context of {self.context}")

    def _check_ids(self, ids: Any, what: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab]
        if bad:
            raise _HTTPError(422, f"{what} has token ids outside the vocabulary [0, {self.vocab}): {bad[:5]}")

    def _dense(self, request: VerifyRequest) -> torch.Tensor:
        if request.q is None or len(request.q) != len(request.proposal):
            raise _HTTPError(422, f"mode {request.mode!r} needs one draft row q per proposed token")
        q = torch.zeros(len(request.q), self.vocab, dtype=torch.float64)
        for i, row in enumerate(request.q):
            self._check_ids(row.ids, "q")
            q[i, torch.tensor(row.ids, dtype=torch.long)] = torch.tensor(row.probs, dtype=torch.float64)
        return (q / q.sum(-1, keepdim=True)).float()  # a distribution, whatever the rows summed to


def _release(session: _Session | None) -> None:
    """Give a dropped session's engine resources back (a llama.cpp slot; nothing on vLLM)."""
    if session is not None and (close := getattr(session.inner, "close", None)) is not None:
        close()


def create_app(target: Any, config: ServerConfig = ServerConfig()) -> FastAPI:
    """The ASGI app serving `target` (a LocalTarget)."""
    service = _Service(target, config)
    app = FastAPI(title="omnidraft verification server", version=str(VERSION))
    app.state.service = service

    def fail(status: int, message: str) -> JSONResponse:
        if status != 404:
            service.metrics.rejected_requests += 1
        return JSONResponse({"version": VERSION, "error": message}, status_code=status)

    def key_of(request: Request) -> int | None:
        """Which key the request carries (0 without keys), None for none of them; every key is
        compared, in constant time each, whichever matches."""
        if not config.keys:
            return 0
        header = request.headers.get("authorization", "")
        given = (header[7:] if header.lower().startswith("bearer ") else "").encode()
        matches = [hmac.compare_digest(given, key.encode()) for key in config.keys]
        return matches.index(True) if any(matches) else None

    async def read(request: Request) -> bytes:
        data = b""
        async for chunk in request.stream():
            data += chunk
            if len(data) > config.max_body_bytes:
                raise _HTTPError(413, f"request body over the limit of {config.max_body_bytes} bytes")
        return data

    async def body(request: Request, model: type) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > config.max_body_bytes):
            raise _HTTPError(413, f"request body over the limit of {config.max_body_bytes} bytes")
        try:
            data = await asyncio.wait_for(read(request), timeout=config.body_timeout_s)
        except asyncio.TimeoutError:
            raise _HTTPError(408, f"request body not received within {config.body_timeout_s:g} s") from None
        except ClientDisconnect:
            raise _HTTPError(400, "the client disconnected while sending the body") from None
        try:
            return model.model_validate_json(data)
        except ValidationError as exc:
            reasons = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
            raise _HTTPError(422, f"invalid {model.__name__}: {reasons}") from exc

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        """Auth, and the one place a refusal (`_HTTPError`, raised anywhere below) becomes its reply."""
        guarded = request.url.path.startswith("/v1/") or (request.url.path == "/metrics" and not config.open_metrics)
        request.state.key = key_of(request)
        if guarded and request.state.key is None:
            return fail(401, "missing or wrong API key (send Authorization: Bearer <key>)")
        try:
            return await call_next(request)
        except _HTTPError as exc:
            return fail(exc.status, exc.message)
        except Exception:  # a bug, never expected: logged, and the client is told to reconnect
            log.exception("unhandled error serving %s %s", request.method, request.url.path)
            reply = fail(500, "internal server error (logged on the server)")
            reply.headers["connection"] = "close"
            return reply

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "sessions": len(service.sessions)}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.metrics.text(len(service.sessions)), media_type="text/plain; version=0.0.4")

    @app.get("/v1/info")
    async def info() -> dict:
        return service.info().model_dump()

    @app.get("/v1/tokenizer")
    async def tokenizer() -> dict:
        return {"version": VERSION, "files": service.tokenizer_files}

    @app.post("/v1/sessions")
    async def open_session(request: Request) -> Any:
        reply = await run_in_threadpool(service.open, await body(request, OpenRequest), request.state.key)
        return reply.model_dump()

    @app.post("/v1/sessions/{sid}/verify")
    async def verify(sid: str, request: Request) -> Any:
        reply = await run_in_threadpool(service.verify, sid, await body(request, VerifyRequest), request.state.key)
        return reply.model_dump(exclude_none=True)

    @app.post("/v1/sessions/{sid}/generate")
    async def generate(sid: str, request: Request) -> Any:
        stream = await run_in_threadpool(service.generate, sid, await body(request, GenerateRequest), request.state.key)
        return StreamingResponse(stream, media_type="application/x-ndjson")

    @app.post("/v1/generate")
    async def generate_alone(request: Request) -> Any:
        stream = await run_in_threadpool(service.generate_alone, await body(request, PromptGenerateRequest), request.state.key)
        return StreamingResponse(stream, media_type="application/x-ndjson")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        from .openai import CompletionRequest

        reply = await run_in_threadpool(service.complete, await body(request, CompletionRequest))
        return reply

    @app.delete("/v1/sessions/{sid}")
    async def close(sid: str, request: Request) -> Any:
        service.close(sid, request.state.key)
        return {"version": VERSION, "closed": sid}

    return app
