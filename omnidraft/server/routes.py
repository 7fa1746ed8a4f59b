"""The verification server's routes (server.py builds the app and its checks around them):
the operator's (health, metrics, info, tokenizer), a device's sessions, and the OpenAI-compatible
ones. `RequestIO` reads a bounded body within its deadline and runs work that stops when its
client leaves; `streamed` closes a streamed reply's work as soon as the reply ends.
"""

from __future__ import annotations

import asyncio
import threading
from functools import partial
from typing import Any, AsyncIterator, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.requests import ClientDisconnect

from ..target import Rule
from ..wire import (
    VERSION,
    GenerateRequest,
    OpenRequest,
    PromptGenerateRequest,
    ProposalRequest,
    SpeculateRequest,
    VerifyRequest,
)
from .config import shown
from .openai_api import ChatRequest, chat_prompt, models_reply, respond
from .service import HTTPError, ServerConfig, Service

__all__ = ["RequestIO", "add_device_routes", "add_openai_routes", "add_ops_routes", "streamed"]


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


class RequestIO:
    """A route's reading of its request and its waiting on work (for `service` under `config`)."""

    def __init__(self, service: Service, config: ServerConfig) -> None:
        self.service, self.config = service, config

    async def read(self, request: Request, limit: int | None = None) -> bytes:
        """The body, at most `limit` bytes (default: the config's `max_body_bytes`), else a 413."""
        most = limit or self.config.max_body_bytes
        data = bytearray()  # appended in place: a body in many small chunks costs linear time
        async for chunk in request.stream():
            data += chunk
            if len(data) > most:
                raise HTTPError(413, f"request body over the limit of {most} bytes")
        return bytes(data)

    async def body(self, request: Request, model: type[BaseModel]) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.config.max_body_bytes):
            raise HTTPError(413, f"request body over the limit of {self.config.max_body_bytes} bytes")
        try:
            data = await asyncio.wait_for(self.read(request), timeout=self.config.body_timeout_s)
        except asyncio.TimeoutError:
            raise HTTPError(
                408, f"request body not received within {self.config.body_timeout_s:g} s"
            ) from None
        except ClientDisconnect:
            raise HTTPError(400, "the client disconnected while sending the body") from None
        try:
            return model.model_validate_json(data)
        except ValidationError as exc:
            reasons = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
            )
            raise HTTPError(422, f"invalid {model.__name__}: {reasons}") from exc

    async def until_disconnect(self, request: Request, work: Any, *args: Any) -> Any:
        """`work(*args, cancel)` in the thread pool; `cancel` is set if the client goes away first."""
        from .completions import Cancelled

        cancel = threading.Event()
        running = asyncio.ensure_future(run_in_threadpool(partial(work, *args, cancel)))
        while not (await asyncio.wait({running}, timeout=0.25))[0]:
            if await request.is_disconnected():
                cancel.set()  # the work stops at its next token; its reply goes nowhere
        try:
            return running.result()
        except Cancelled:
            raise HTTPError(499, "the client closed the connection") from None


def add_ops_routes(app: FastAPI, service: Service) -> None:
    """Liveness, Prometheus metrics, and what a device needs to pair (info, tokenizer files)."""

    @app.get("/health")
    async def health(request: Request) -> dict:
        """Liveness for anyone; the session count for a caller with a key: the whole server's for
        the operator (or the only key), else the caller's own sessions."""
        key, config = request.state.key, service.config
        if key is None:
            return {"status": "ok"}
        if config.sees_all(key):
            return {"status": "ok", "sessions": len(service.sessions)}
        return {"status": "ok", "sessions": sum(1 for s in list(service.sessions.values()) if s.key == key)}

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        if not (service.config.open_metrics or service.config.sees_all(request.state.key)):
            raise HTTPError(
                403,
                "/metrics counts every key's sessions: send the operator key (omnidraft serve "
                "--operator-key-file) or serve it open to a private scraper (open_metrics)",
            )
        return PlainTextResponse(
            service.metrics.text(len(service.sessions)), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/info")
    async def info() -> dict:
        return service.info().model_dump()

    @app.get("/v1/tokenizer")
    async def tokenizer() -> dict:
        return {"version": VERSION, "files": service.tokenizer_files}


def add_device_routes(app: FastAPI, service: Service, io: RequestIO) -> None:
    """A device's sessions: open, verify, generate, speculate and its proposals, close."""

    @app.post("/v1/sessions")
    async def open_session(request: Request) -> Any:
        reply = await run_in_threadpool(service.open, await io.body(request, OpenRequest), request.state.key)
        return reply.model_dump()

    @app.post("/v1/sessions/{sid}/verify")
    async def verify(sid: str, request: Request) -> Any:
        parsed = await io.body(request, VerifyRequest)
        reply = await io.until_disconnect(request, service.verify, sid, parsed, request.state.key)
        return reply.model_dump(exclude_none=True)

    @app.post("/v1/sessions/{sid}/generate")
    async def generate(sid: str, request: Request) -> Any:
        stream = await run_in_threadpool(
            service.generate, sid, await io.body(request, GenerateRequest), request.state.key
        )
        return streamed(stream, "application/x-ndjson")

    @app.post("/v1/sessions/{sid}/speculate")
    async def speculate(sid: str, request: Request) -> Any:
        stream = await run_in_threadpool(
            service.speculate, sid, await io.body(request, SpeculateRequest), request.state.key
        )
        return streamed(stream, "application/x-ndjson")

    @app.post("/v1/sessions/{sid}/proposal")
    async def proposal(sid: str, request: Request) -> Any:
        parsed = await io.body(request, ProposalRequest)
        return service.propose(sid, parsed, request.state.key).model_dump()

    @app.post("/v1/generate")
    async def generate_alone(request: Request) -> Any:
        stream = await run_in_threadpool(
            service.generate_alone, await io.body(request, PromptGenerateRequest), request.state.key
        )
        return streamed(stream, "application/x-ndjson")

    @app.delete("/v1/sessions/{sid}")
    async def close(sid: str, request: Request) -> Any:
        service.close(sid, request.state.key)
        return {"version": VERSION, "closed": sid}


def add_openai_routes(app: FastAPI, service: Service, io: RequestIO) -> None:
    """/v1/models, /v1/chat/completions and /v1/completions for a stock OpenAI client."""

    @app.get("/v1/models")
    async def models() -> dict:
        return models_reply(service.target.name)

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        """One model, as `client.models.retrieve` asks: the served one, else OpenAI's 404."""
        check_model(ChatRequest(model=model, messages=[{"role": "user", "content": "-"}]))
        return models_reply(service.target.name)["data"][0]

    def check_model(parsed: Any) -> None:
        """A request for another model than this server's is refused, as OpenAI refuses one (404)."""
        if parsed.model is not None and parsed.model != service.target.name:
            raise HTTPError(
                404,
                f"the model {shown(parsed.model)} is not served here: this server serves "
                f"{service.target.name!r} (GET /v1/models lists it)",
            )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        parsed = await io.body(request, ChatRequest)
        check_model(parsed)
        try:
            ids = chat_prompt(service.target.tokenizer, parsed, service.target.name)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None
        return await openai_reply(request, parsed, ids, parsed.limit)

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

        return await io.until_disconnect(request, whole)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        from ..wire import CompletionRequest

        parsed = await io.body(request, CompletionRequest)
        check_model(parsed)
        greedy_scores = parsed.logprobs is not None and parsed.temperature == 0 and not parsed.stream
        if parsed.echo or greedy_scores:  # the scoring path (what OpenAICompletionsTarget reads)
            return await io.until_disconnect(request, service.complete, parsed, request.state.key)
        ids = (
            list(parsed.prompt)
            if isinstance(parsed.prompt, list)
            else service.target.tokenizer(parsed.prompt)["input_ids"]
        )
        return await openai_reply(request, parsed, ids, parsed.max_tokens)
