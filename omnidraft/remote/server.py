"""A verification server: one target model, many device sessions, over HTTP (FastAPI + uvicorn).

    POST   /v1/sessions                 OpenRequest  -> OpenReply
    POST   /v1/sessions/{id}/verify     VerifyRequest -> VerifyReply
    POST   /v1/sessions/{id}/generate   GenerateRequest -> NDJSON GenerateChunk per committed token
    POST   /v1/sessions/{id}/speculate  SpeculateRequest -> the same stream, the engine verifying proposals
    POST   /v1/sessions/{id}/proposal   ProposalRequest -> ProposalReply (while it streams; vLLM engine)
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
answers 503 rather than exhausting the host. The rules behind the routes (locks, prefill chunks,
limits, the draft budget) live in service.py; see protocol.py for the idempotency rule.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from functools import partial
from typing import Any, AsyncIterator, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.requests import ClientDisconnect

from ..target import Rule
from .openai_api import OPENAI_PATHS, ChatRequest, chat_prompt, error_body, models_reply, respond
from .protocol import (
    VERSION,
    GenerateRequest,
    OpenRequest,
    PromptGenerateRequest,
    ProposalRequest,
    SpeculateRequest,
    VerifyRequest,
)
from .service import HTTPError, ServerConfig, Service

__all__ = ["HEADER_TIMEOUT_S", "Auth", "ServerConfig", "create_app", "http_protocol"]

log = logging.getLogger(__name__)


HEADER_TIMEOUT_S = 10.0  # a connection's request line and headers must arrive within this


def streamed(stream: Iterator[bytes], media_type: str) -> StreamingResponse:
    """A streamed reply that closes `stream` as soon as it ends, its client gone included: closing
    runs the stream's own clean-up (an engine request aborted, a hold on the KV budget freed) at
    once, where an abandoned generator waits for the garbage collector, seconds later on vLLM."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in iterate_in_threadpool(stream):
                yield chunk
        finally:  # reached on the end, an error, or the cancellation of a client that left
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    return StreamingResponse(body(), media_type=media_type)


def http_protocol() -> type:
    """uvicorn's h11 protocol with a deadline on each request's headers: a client trickling them
    (slowloris) is disconnected, where uvicorn alone would wait on it for ever. Pass it as
    `uvicorn.run(..., http=http_protocol())`."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline: Any = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self) -> None:
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # this request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers have the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadline


class Auth:
    """The API key check, as plain ASGI middleware (one written with `@app.middleware` wraps
    `receive`, and a route then never learns that its client left): a request's key index goes to
    `request.state.key` (`key_of`: None for no valid key); /v1 routes and /metrics (unless
    `open_metrics`) without one get `refuse`'s 401. An exception no route handled gets `crashed`'s
    reply when no reply has started (and is not raised further: the server keeps serving)."""

    def __init__(self, app: Any, *, key_of: Any, refuse: Any, crashed: Any, open_metrics: bool) -> None:
        self.app, self.key_of, self.refuse, self.open_metrics = app, key_of, refuse, open_metrics
        self.crashed = crashed

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        path, key = request.url.path, self.key_of(request)
        scope.setdefault("state", {})["key"] = key
        if key is None and (path.startswith("/v1/") or (path == "/metrics" and not self.open_metrics)):
            reply = self.refuse(401, "missing or wrong API key (send Authorization: Bearer <key>)", path)
            return await reply(scope, receive, send)
        started = False

        async def sending(message: Any) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:
                raise
            await self.crashed(request, exc)(scope, receive, send)


def create_app(target: Any, config: ServerConfig = ServerConfig()) -> FastAPI:
    """The ASGI app serving `target` (a LocalTarget)."""
    service = Service(target, config)
    app = FastAPI(title="omnidraft verification server", version=str(VERSION))
    app.state.service = service

    def fail(status: int, message: str, path: str = "", fields: dict | None = None) -> JSONResponse:
        if status != 404:
            service.metrics.rejected_requests += 1
        if path in OPENAI_PATHS:  # what an OpenAI client parses; an invalid request is its 400
            status = 400 if status == 422 else status
            return JSONResponse(error_body(status, message), status_code=status)
        return JSONResponse({"version": VERSION, "error": message, **(fields or {})}, status_code=status)

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
        data = bytearray()  # appended in place: a body in many small chunks costs linear time
        async for chunk in request.stream():
            data += chunk
            if len(data) > config.max_body_bytes:
                raise HTTPError(413, f"request body over the limit of {config.max_body_bytes} bytes")
        return bytes(data)

    async def body(request: Request, model: type[BaseModel]) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > config.max_body_bytes):
            raise HTTPError(413, f"request body over the limit of {config.max_body_bytes} bytes")
        try:
            data = await asyncio.wait_for(read(request), timeout=config.body_timeout_s)
        except asyncio.TimeoutError:
            raise HTTPError(408, f"request body not received within {config.body_timeout_s:g} s") from None
        except ClientDisconnect:
            raise HTTPError(400, "the client disconnected while sending the body") from None
        try:
            return model.model_validate_json(data)
        except ValidationError as exc:
            reasons = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
            )
            raise HTTPError(422, f"invalid {model.__name__}: {reasons}") from exc

    async def refused(request: Request, exc: Exception) -> JSONResponse:
        """The one place a refusal (`HTTPError`, raised anywhere below a route) becomes its reply."""
        assert isinstance(exc, HTTPError)
        return fail(exc.status, exc.message, request.url.path, exc.fields)

    def crashed(request: Request, exc: Exception) -> JSONResponse:
        """A bug, never expected: logged, and the client is told to reconnect."""
        log.error("unhandled error serving %s %s", request.method, request.url.path, exc_info=exc)
        reply = fail(500, "internal server error (logged on the server)")
        reply.headers["connection"] = "close"
        return reply

    app.add_exception_handler(HTTPError, refused)
    app.add_middleware(Auth, key_of=key_of, refuse=fail, crashed=crashed, open_metrics=config.open_metrics)

    @app.get("/health")
    async def health(request: Request) -> dict:
        """Liveness for anyone; the session count only for a caller with a key (or on a keyless server)."""
        if request.state.key is None:
            return {"status": "ok"}
        return {"status": "ok", "sessions": len(service.sessions)}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            service.metrics.text(len(service.sessions)), media_type="text/plain; version=0.0.4"
        )

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
        parsed = await body(request, VerifyRequest)
        reply = await until_disconnect(request, service.verify, sid, parsed, request.state.key)
        return reply.model_dump(exclude_none=True)

    @app.post("/v1/sessions/{sid}/generate")
    async def generate(sid: str, request: Request) -> Any:
        stream = await run_in_threadpool(
            service.generate, sid, await body(request, GenerateRequest), request.state.key
        )
        return streamed(stream, "application/x-ndjson")

    @app.post("/v1/sessions/{sid}/speculate")
    async def speculate(sid: str, request: Request) -> Any:
        stream = await run_in_threadpool(
            service.speculate, sid, await body(request, SpeculateRequest), request.state.key
        )
        return streamed(stream, "application/x-ndjson")

    @app.post("/v1/sessions/{sid}/proposal")
    async def proposal(sid: str, request: Request) -> Any:
        parsed = await body(request, ProposalRequest)
        return service.propose(sid, parsed, request.state.key).model_dump()

    @app.post("/v1/generate")
    async def generate_alone(request: Request) -> Any:
        stream = await run_in_threadpool(
            service.generate_alone, await body(request, PromptGenerateRequest), request.state.key
        )
        return streamed(stream, "application/x-ndjson")

    @app.get("/v1/models")
    async def models() -> dict:
        return models_reply(service.target.name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        parsed = await body(request, ChatRequest)
        try:
            ids = chat_prompt(service.target.tokenizer, parsed, service.target.name)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None
        return await openai_reply(request, parsed, ids, parsed.limit)

    async def until_disconnect(request: Request, work: Any, *args: Any) -> Any:
        """`work(*args, cancel)` in the thread pool; `cancel` is set if the client goes away first."""
        from .openai import Cancelled

        cancel = threading.Event()
        running = asyncio.ensure_future(run_in_threadpool(partial(work, *args, cancel)))
        while not (await asyncio.wait({running}, timeout=0.25))[0]:
            if await request.is_disconnected():
                cancel.set()  # the work stops at its next token; its reply goes nowhere
        try:
            return running.result()
        except Cancelled:
            raise HTTPError(499, "the client closed the connection") from None

    async def openai_reply(request: Request, parsed: Any, ids: list[int], limit: int) -> Any:
        """Decode alone for a plain OpenAI client: a JSON reply, or SSE when it streams."""
        rule = (
            Rule()
            if parsed.temperature == 0
            else Rule(
                mode="match",
                temperature=max(parsed.temperature, 1e-3),
                top_k=parsed.top_k,
                top_p=parsed.top_p,
            )
        )
        target, key, top = service.target, request.state.key, parsed.top_logprob_count
        logprobs: list | None = None if top is None else []
        if parsed.stream:  # a stream decodes as it is read: a client gone stops the reading
            tokens = await run_in_threadpool(
                service.sample, ids, rule, limit, parsed.seed, key, None, logprobs, top or 0
            )
            chunks = respond(tokens, parsed, target, len(ids), logprobs)
            return streamed(chunks, "text/event-stream")

        def whole(cancel: threading.Event) -> Any:
            tokens = service.sample(ids, rule, limit, parsed.seed, key, cancel, logprobs, top or 0)
            return respond(tokens, parsed, target, len(ids), logprobs)

        return await until_disconnect(request, whole)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        from .openai import CompletionRequest

        parsed = await body(request, CompletionRequest)
        greedy_scores = parsed.logprobs is not None and parsed.temperature == 0 and not parsed.stream
        if parsed.echo or greedy_scores:  # the scoring path (what OpenAICompletionsTarget reads)
            return await until_disconnect(request, service.complete, parsed, request.state.key)
        ids = (
            list(parsed.prompt)
            if isinstance(parsed.prompt, list)
            else service.target.tokenizer(parsed.prompt)["input_ids"]
        )
        return await openai_reply(request, parsed, ids, parsed.max_tokens)

    @app.delete("/v1/sessions/{sid}")
    async def close(sid: str, request: Request) -> Any:
        service.close(sid, request.state.key)
        return {"version": VERSION, "closed": sid}

    return app
