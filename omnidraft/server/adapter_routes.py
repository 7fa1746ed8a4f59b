"""The adapter exchange's routes (distill/federated.py; `omnidraft serve --share-adapters DIR`):
a device uploads its LoRA adapter for the served target and pulls the shared one. The API key names
the uploader (one upload per key a round); without `--share-adapters` both answer 404."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ..distill.federated import MAX_BYTES, AdapterExchange, Rejected
from .routes import RequestIO
from .service import HTTPError

__all__ = ["VERSION_HEADER", "add_adapter_routes"]

VERSION_HEADER = "x-omnidraft-adapter-version"


def add_adapter_routes(app: FastAPI, exchange: AdapterExchange | None, io: RequestIO) -> None:
    def exchanging() -> AdapterExchange:
        if exchange is None:
            raise HTTPError(404, "this server does not share adapters: start it with --share-adapters DIR")
        return exchange

    @app.get("/v1/adapters/shared")
    async def shared() -> Response:
        version, data = await run_in_threadpool(exchanging().shared)
        if data is None:
            raise HTTPError(404, "no shared adapter yet: one is written once enough devices upload theirs")
        return Response(data, media_type="application/octet-stream", headers={VERSION_HEADER: str(version)})

    @app.put("/v1/adapters/upload")
    async def upload(request: Request, requests: int) -> dict:
        data = await io.read(request, limit=MAX_BYTES)  # an adapter is larger than a request body
        key = request.scope["state"]["key"]
        try:
            now = await run_in_threadpool(exchanging().upload, int(key or 0), data, requests)
        except Rejected as exc:
            raise HTTPError(422, str(exc)) from None
        return {"version": now.version, "uploaded": len(now.uploaded)}
