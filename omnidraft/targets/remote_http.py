"""One JSON request to a verification server, with bounded retries, and the errors its refusals
become (targets/remote.py, targets/openai_client.py)."""

from __future__ import annotations

import time
from typing import Any

from ..errors import RemoteRequestError, TargetUnavailableError

__all__ = ["call_json", "refused"]

_RETRY_STATUS = (502, 503, 504)


def call_json(
    http: Any,
    url: str,
    method: str,
    path: str,
    content: str | None,
    retries: int,
    headers: dict[str, str] | None = None,
) -> Any:
    """One JSON request (with `headers` besides its content type) with bounded retries of transport
    failures and 502/503/504; 4xx raises RemoteRequestError with the server's reason, exhausted
    retries TargetUnavailableError."""
    import httpx

    last: str = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(min(2.0, 0.1 * 2**attempt))
        try:
            response = http.request(
                method,
                path,
                content=content,
                headers={**(headers or {}), **({"content-type": "application/json"} if content else {})},
            )
        except httpx.TransportError as exc:
            last = f"{type(exc).__name__}: {exc}"
            continue
        if response.status_code in _RETRY_STATUS:
            last = f"HTTP {response.status_code}: {_reason(response, _error_body(response))}"
            continue
        if response.status_code >= 400:
            raise refused(url, path, response)
        return response.json()
    raise TargetUnavailableError(f"{url}{path} unreachable after {retries + 1} attempts ({last})")


def refused(url: str, path: str, response: Any) -> RemoteRequestError:
    """The error for a refused request (its body read once): the server's reason, and for a stale
    request's 409 the session's committed length (None elsewhere)."""
    body = _error_body(response)
    committed = body.get("committed") if body is not None else None
    return RemoteRequestError(
        f"{url}{path} refused the request: HTTP {response.status_code}: {_reason(response, body)}",
        response.status_code,
        committed if isinstance(committed, int) else None,
    )


def _error_body(response: Any) -> dict[str, Any] | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _reason(response: Any, body: dict[str, Any] | None) -> str:
    return str(body.get("error", response.text)) if body is not None else response.text[:200]
