"""Draining a replica: on SIGTERM a server stops taking new work, lets what runs finish, then exits 0.

    GET /ready   200 {"status": "ready"}, or 503 {"status": "draining"} once draining

A router's health check reads /ready (docs/deploy.md): a draining replica gets no new requests from
it, while the requests already running on it (a stream, a verify) finish. While draining, a request
that would start new work here (a session's open, a sessionless generate, an OpenAI completion) is
answered 503 before any byte of it is sent, so a client retries it elsewhere; a device whose
session lived here re-opens it on another replica from its committed ids at its next request
(targets/remote.py). The server exits once nothing but health checks has run for `quiet_s`, or at
`deadline_s`, whichever comes first; uvicorn's graceful shutdown then closes what is left.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ..wire import VERSION
from .openai_api import OPENAI_PATHS, error_body

__all__ = ["Drain", "DrainGate", "DrainingServer", "add_ready_route"]

OPS_PATHS = frozenset({"/health", "/ready", "/metrics"})  # not work: never counted, never refused
NEW_WORK = frozenset({"/v1/sessions", "/v1/generate", *OPENAI_PATHS})  # what a POST starts afresh


class Drain:
    """A replica's drain state: whether it drains, and the requests in flight (a stream until its
    last byte) that `DrainGate` counts."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self.last_busy = time.monotonic()

    def begin(self) -> None:
        self.draining = True

    def quiet_for(self) -> float:
        """Seconds since a request other than a health check last ran here (0 while one runs)."""
        return 0.0 if self.in_flight else time.monotonic() - self.last_busy


class DrainGate:
    """Plain ASGI middleware: counts into `drain` the requests in flight and, while it drains,
    refuses new work with 503."""

    def __init__(self, app: Any, *, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        drain = self.drain
        if scope["type"] != "http" or scope["path"] in OPS_PATHS:
            return await self.app(scope, receive, send)
        if drain.draining and scope["method"] == "POST" and scope["path"] in NEW_WORK:
            return await _draining_reply(scope["path"])(scope, receive, send)
        drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            drain.in_flight -= 1
            drain.last_busy = time.monotonic()


def _draining_reply(path: str) -> JSONResponse:
    message = "this replica is draining: send the request again (a router sends it to another replica)"
    body = error_body(503, message) if path in OPENAI_PATHS else {"version": VERSION, "error": message}
    return JSONResponse(body, status_code=503, headers={"retry-after": "1"})


def add_ready_route(app: FastAPI, drain: Drain) -> None:
    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness for a router's health check: 503 while draining."""
        if drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ready"})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM drains (`Drain`) instead of stopping at once: it stops
    once the replica has been quiet for `quiet_s` or `deadline_s` after the signal, and exits 0 (a
    second SIGTERM, or SIGINT, stops it the way uvicorn does)."""

    def __init__(self, config: Any, drain: Drain, *, deadline_s: float, quiet_s: float) -> None:
        super().__init__(config)
        self.drain, self.deadline_s, self.quiet_s = drain, deadline_s, quiet_s
        self.drain_began: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGTERM and self.drain_began is None:
            self.drain_began = time.monotonic()
            self.drain.begin()  # (not kept as a captured signal: the process exits 0, not by it)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_began is not None and not self.should_exit:
            waited = time.monotonic() - self.drain_began
            if self.drain.quiet_for() >= self.quiet_s or waited >= self.deadline_s:
                self.should_exit = True
        return bool(await super().on_tick(counter))
