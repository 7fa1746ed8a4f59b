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
    GET    /ready                       readiness for a router: 503 while draining (drain.py)

Every /v1 route and /metrics need `Authorization: Bearer <key>` when the server has a key
(compared in constant time; missing or wrong -> 401; `open_metrics` opens /metrics to scrapers).
/metrics and /health's session count are the whole server's for the operator key (`operator_key`;
with none, the only API key), so with several keys a tenant's key reads its own sessions only (403
on /metrics); the operator key opens no session (403 on /v1).
With several keys, a session belongs to the key that opened it (404 to any other) and each key
holds at most `max_sessions_per_key` sessions, by default an equal share of `max_sessions` (429
naming the share past it), so one key cannot fill the table for the others.
A body is read within `body_timeout_s` (408) and a client gone mid-body is answered 400, not logged
as a crash. Bodies are read with a size cap (413) and validated by
the protocol models (422 with the reason); ids outside the vocabulary are refused (422). Sessions
expire after `ttl_s` idle, and a cap on sessions and on committed tokens across sessions (KV memory)
answers 503 rather than exhausting the host. The rules behind the routes (locks, prefill chunks,
limits, the draft budget) live in service.py; see wire.py for the idempotency rule.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..distill.federated import AdapterExchange
from ..wire import KEY_ENV, VERSION
from .adapter_routes import add_adapter_routes
from .config import OPERATOR, shown
from .drain import Drain, DrainGate, add_ready_route
from .openai_api import OPENAI_PATHS, error_body
from .routes import RequestIO, add_device_routes, add_openai_routes, add_ops_routes
from .service import HTTPError, ServerConfig, Service

if TYPE_CHECKING:
    from ..target import Target

__all__ = ["HEADER_TIMEOUT_S", "Auth", "ServerConfig", "create_app", "http_protocol"]

log = logging.getLogger(__name__)
REQUESTS = logging.getLogger("omnidraft.requests")  # --log-requests: one line a request


HEADER_TIMEOUT_S = 10.0  # a connection's request line and headers must arrive within this


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
    reply when no reply has started (and is not raised further: the server keeps serving). With
    `log_requests`, each request ends with one line on the "omnidraft.requests" logger: method,
    path, status, seconds, which key (never the key itself)."""

    def __init__(
        self, app: Any, *, key_of: Any, refuse: Any, crashed: Any, open_metrics: bool, log_requests: bool
    ) -> None:
        self.app, self.key_of, self.refuse, self.open_metrics = app, key_of, refuse, open_metrics
        self.crashed, self.log_requests = crashed, log_requests

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.log_requests:
            return await self._serve(scope, receive, send)
        status, began = 0, time.perf_counter()

        async def noting(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._serve(scope, receive, noting)
        finally:
            key = scope.get("state", {}).get("key")
            REQUESTS.info(
                "%s %s %s %.3f s key %s",
                scope["method"],
                scope["path"],
                status or "-",
                time.perf_counter() - began,
                "none" if key is None else f"#{key}",
            )

    async def _serve(self, scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope)
        path, key = request.url.path, self.key_of(request)
        scope.setdefault("state", {})["key"] = key
        if key is None and (path.startswith("/v1/") or (path == "/metrics" and not self.open_metrics)):
            reply = self.refuse(
                401,
                (
                    f"missing or wrong API key: pass api_key= to RemoteTarget or set ${KEY_ENV} "
                    "(any other client: send Authorization: Bearer <key>)"
                ),
                path,
            )
            return await reply(scope, receive, send)
        if key == OPERATOR and path.startswith("/v1/"):
            reply = self.refuse(
                403, "the operator key reads /metrics and /health; a client sends an API key", path
            )
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


def create_app(target: Target, config: ServerConfig = ServerConfig()) -> FastAPI:
    """The ASGI app serving `target` (any target: a `Target` whose capabilities say what it serves)."""
    service = Service(target, config)
    app = FastAPI(title="omnidraft verification server", version=str(VERSION))
    app.state.service = service

    def fail(status: int, message: str, path: str = "", fields: dict | None = None) -> JSONResponse:
        if status != 404:
            service.metrics.rejected_requests += 1
        if path in OPENAI_PATHS or path.startswith("/v1/models/"):  # what an OpenAI client parses
            status = 400 if status == 422 else status  # an invalid request is its 400
            return JSONResponse(error_body(status, message), status_code=status)
        return JSONResponse({"version": VERSION, "error": message, **(fields or {})}, status_code=status)

    def key_of(request: Request) -> int | None:
        """Which key the request carries (0 without keys; OPERATOR for the operator key), None for
        none of them; every key is compared, in constant time each, whichever matches."""
        header = request.headers.get("authorization", "")
        given = (header[7:] if header.lower().startswith("bearer ") else "").encode()
        if config.operator_key is not None and hmac.compare_digest(given, config.operator_key.encode()):
            return OPERATOR
        if not config.keys:
            return 0
        matches = [hmac.compare_digest(given, key.encode()) for key in config.keys]
        return matches.index(True) if any(matches) else None

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

    async def unrouted(request: Request, exc: Exception) -> JSONResponse:
        """A path or method no route serves (the router's 404 or 405): in OpenAI's error shape, as
        every client of this server can parse it, the path cut to a bounded length."""
        assert isinstance(exc, StarletteHTTPException)
        what = "no route serves" if exc.status_code == 404 else str(exc.detail).lower()
        message = f"{what} {request.method} {shown(request.url.path)}"
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code)

    app.add_exception_handler(HTTPError, refused)
    app.add_exception_handler(StarletteHTTPException, unrouted)
    app.add_middleware(
        Auth,
        key_of=key_of,
        refuse=fail,
        crashed=crashed,
        open_metrics=config.open_metrics,
        log_requests=config.log_requests,
    )

    app.state.drain = Drain()
    app.add_middleware(DrainGate, drain=app.state.drain)  # outermost: counts what Auth refuses too
    io = RequestIO(service, config)
    add_ops_routes(app, service)
    add_ready_route(app, app.state.drain)
    add_device_routes(app, service, io)
    add_openai_routes(app, service, io)
    exchange = (
        AdapterExchange(config.adapters_dir, min_keys=config.adapter_min_keys)
        if config.adapters_dir
        else None
    )
    add_adapter_routes(app, exchange, io)
    return app
