"""`omnidraft bench --remote`: hybrid edge-cloud decoding with an injected network round trip.

The target is served by our own verification server on loopback (uvicorn in a thread); the
client adds `rtt` seconds to every HTTP exchange and counts the bytes it sends. Every contender
goes through the same server and the same network:
- the server alone, as deployed servers run: one completion request, the whole completion
  generated on the server (one round trip, then one target step per token);
- omnidraft with the default "latency" objective: per request it speculates or hands the request
  to the server, whichever it has measured faster (two untimed warm-up requests measure both);
- omnidraft with the "compute" objective: always speculates (fewest target forwards per token).
On one machine the server's compute competes with the drafter for the same cores; a real
deployment runs them on different hardware (device_sim models that).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from ..server.app import ServerConfig, create_app, http_protocol
from ..targets.remote import RemoteTarget

if TYPE_CHECKING:
    from ..draft.base import Drafter
    from ..target import Target

__all__ = ["ROWS", "LatencyClient", "run_remote", "serve_in_thread"]


class LatencyClient:
    """An httpx.Client stand-in that waits `rtt` seconds per exchange and counts bytes both ways."""

    def __init__(self, url: str, rtt: float, timeout: float = 120.0) -> None:
        import httpx

        self.inner = httpx.Client(base_url=url, timeout=timeout)
        self.headers, self.rtt = self.inner.headers, rtt
        self.sent = self.received = 0

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        time.sleep(self.rtt)
        response = self.inner.request(method, path, **kwargs)
        self.sent += len(path) + len(kwargs.get("content") or b"") + 64  # request line + headers, roughly
        self.received += len(response.content)
        return response

    def stream(self, method: str, path: str, **kwargs: Any) -> Any:
        """A streamed exchange: one round trip before the reply starts (bytes received not counted)."""
        time.sleep(self.rtt)
        self.sent += len(path) + len(kwargs.get("content") or b"") + 64
        return self.inner.stream(method, path, **kwargs)

    def close(self) -> None:
        self.inner.close()


def serve_in_thread(app: Any) -> tuple[str, Any]:
    """Serve an ASGI `app` on a free loopback port in a thread; returns (url, stop function)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", http=http_protocol())
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("the verification server did not start within 60 s")
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://127.0.0.1:{port}", stop


def _server_alone(client: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """One greedy /v1/completions request for the whole completion; the generated ids."""
    body = {
        "prompt": prompt_ids,
        "max_tokens": max_new_tokens,
        "temperature": 0.0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    reply = client.request(
        "POST", "/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"}
    )
    reply.raise_for_status()
    return [int(t.removeprefix("token_id:")) for t in reply.json()["choices"][0]["logprobs"]["tokens"]]


ROWS = ("server alone", "omnidraft (latency)", "omnidraft (compute)")


def run_remote(
    drafter: Drafter,
    target: Target,
    prompts: list[str],
    max_new_tokens: int,
    rtts: list[float],
    *,
    k: int | None = None,
    progress: Callable[[str], object] = lambda msg: None,
    trace: Callable[[float, int, Any], None] | None = None,
) -> list[dict[str, Any]]:
    """Per round-trip time and row of ROWS: seconds per request, tok/s, speedup over the server
    alone, target forwards and bytes sent per committed token, outputs identical to the server's.

    `trace(rtt, index, output)`, if given, is called after each speculating generation.
    """
    url, stop = serve_in_thread(create_app(target, ServerConfig(api_key=None)))
    rows = []
    try:
        for rtt in rtts:
            client = LatencyClient(url, rtt)
            remote = RemoteTarget(url, tokenizer=target.tokenizer, client=client)
            pairs = {
                ROWS[1]: drafter.pair(remote, k=k),
                ROWS[2]: drafter.pair(remote, k=k, objective="compute"),
            }
            for pair in pairs.values():  # untimed: the latency pairing measures both of its modes here
                for _ in range(2):
                    pair.generate(prompts[0], max_new_tokens=max_new_tokens)
            stats = {
                name: {"seconds": 0.0, "tokens": 0, "forwards": 0, "sent": 0, "identical": 0, "speculated": 0}
                for name in ROWS
            }
            for i, prompt in enumerate(prompts):
                progress(f"rtt {rtt * 1000:.0f} ms, prompt {i}: server alone")
                ids = target.tokenizer(prompt)["input_ids"]
                reference, seconds, sent = _timed(client, lambda: _server_alone(client, ids, max_new_tokens))
                _add(stats[ROWS[0]], seconds, len(reference), len(reference), sent, True, False)
                for name, pair in pairs.items():
                    progress(f"rtt {rtt * 1000:.0f} ms, prompt {i}: {name}")
                    out, seconds, sent = _timed(client, partial(pair.generate, prompt, max_new_tokens))
                    speculated = any(r.proposed for r in out.rounds)  # model or retrieved drafts
                    identical = out.token_ids == reference
                    _add(
                        stats[name], seconds, len(out.token_ids), len(out.rounds), sent, identical, speculated
                    )
                    if trace is not None and speculated:
                        trace(rtt, i, out)
            rows += [
                _row(rtt, name, st, len(prompts), stats[ROWS[0]]["seconds"]) for name, st in stats.items()
            ]
            client.close()
    finally:
        stop()
    return rows


def _timed(client: LatencyClient, call: Callable[[], Any]) -> tuple[Any, float, int]:
    """(what `call` returns, its seconds, the bytes it sent through `client`)."""
    before, started = client.sent, time.perf_counter()
    result = call()
    return result, time.perf_counter() - started, client.sent - before


def _row(rtt: float, name: str, st: dict[str, Any], prompts: int, alone_s: float) -> dict[str, Any]:
    return {
        "rtt_ms": rtt * 1000,
        "row": name,
        "prompts": prompts,
        "seconds_per_request": st["seconds"] / prompts,
        "tok_s": st["tokens"] / st["seconds"],
        "speedup": alone_s / st["seconds"],
        "forwards_per_token": st["forwards"] / max(1, st["tokens"]),
        "bytes_sent_per_token": st["sent"] / max(1, st["tokens"]),
        "identical": st["identical"],
        "speculated": st["speculated"],
    }


def _add(
    row: dict[str, Any],
    seconds: float,
    tokens: int,
    forwards: int,
    sent: int,
    identical: bool,
    speculated: bool,
) -> None:
    row["seconds"] += seconds
    row["tokens"] += tokens
    row["forwards"] += forwards
    row["sent"] += sent
    row["identical"] += identical
    row["speculated"] += speculated
