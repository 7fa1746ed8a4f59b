"""`omnidraft bench --remote`: hybrid edge-cloud decoding with an injected network round trip.

The target is served by our own verification server on loopback (uvicorn in a thread); the
client adds `rtt` seconds to every HTTP exchange and counts the bytes it sends. Both contenders go
through the same server and the same network:
- remote target alone: one verify with an empty proposal per token (one round trip per token);
- omnidraft: the local drafter proposes, one round trip verifies several tokens.
On one machine the server's compute competes with the drafter for the same cores; a real
deployment runs them on different hardware (device_sim models that).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import torch

from ..remote.client import RemoteTarget
from ..remote.server import ServerConfig, create_app
from ..target import Rule

__all__ = ["LatencyClient", "run_remote", "serve_in_thread"]


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

    def close(self) -> None:
        self.inner.close()


def serve_in_thread(app: Any) -> tuple[str, Any]:
    """Serve an ASGI `app` on a free loopback port in a thread; returns (url, stop function)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
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


def _alone(remote: RemoteTarget, prompt: str, max_new_tokens: int) -> list[int]:
    session = remote.begin(remote.tokenizer(prompt)["input_ids"])
    start, empty = len(session.ids), torch.zeros(0, dtype=torch.long)
    while len(session.ids) - start < max_new_tokens and session.ids[-1] not in remote.eos_ids:
        session.verify(empty, Rule())
    session.close()
    return session.ids[start:]


def run_remote(drafter: Any, target: Any, prompts: list[str], max_new_tokens: int, rtts: list[float], *, k: int,
               stop_confidence: float, progress: Any = lambda msg: None,
               trace: Any = None) -> list[dict[str, Any]]:
    """One row per round-trip time: tokens/s of omnidraft and of the remote target alone, bytes per token.

    `trace(rtt, index, output)`, if given, is called after each omnidraft generation (per-round traces).
    """
    url, stop = serve_in_thread(create_app(target, ServerConfig(api_key=None)))
    rows = []
    try:
        for rtt in rtts:
            client = LatencyClient(url, rtt)
            remote = RemoteTarget(url, tokenizer=target.tokenizer, client=client)
            pair = drafter.pair(remote, k=k, stop_confidence=stop_confidence)
            row = {"rtt_ms": rtt * 1000, "prompts": len(prompts), "omnidraft_s": 0.0, "alone_s": 0.0, "tokens": 0,
                   "alone_tokens": 0, "omnidraft_bytes": 0, "alone_bytes": 0, "identical": 0, "rounds": 0}
            for i, prompt in enumerate(prompts):
                progress(f"rtt {rtt * 1000:.0f} ms, prompt {i}: target alone")
                before, started = client.sent, time.perf_counter()
                reference = _alone(remote, prompt, max_new_tokens)
                row["alone_s"] += time.perf_counter() - started
                row["alone_bytes"] += client.sent - before
                row["alone_tokens"] += len(reference)
                progress(f"rtt {rtt * 1000:.0f} ms, prompt {i}: omnidraft")
                before, started = client.sent, time.perf_counter()
                out = pair.generate(prompt, max_new_tokens=max_new_tokens)
                row["omnidraft_s"] += time.perf_counter() - started
                row["omnidraft_bytes"] += client.sent - before
                row["tokens"] += len(out.token_ids)
                row["rounds"] += len(out.rounds)
                row["identical"] += out.token_ids == reference
                if trace is not None:
                    trace(rtt, i, out)
            row.update(omnidraft_tok_s=row["tokens"] / row["omnidraft_s"], alone_tok_s=row["alone_tokens"] / row["alone_s"],
                       tau=row["tokens"] / max(1, row["rounds"]),
                       omnidraft_bytes_per_token=row["omnidraft_bytes"] / max(1, row["tokens"]),
                       alone_bytes_per_token=row["alone_bytes"] / max(1, row["alone_tokens"]))
            row["speedup"] = row["omnidraft_tok_s"] / row["alone_tok_s"]
            rows.append(row)
            client.close()
    finally:
        stop()
    return rows
