"""`python -m benchmarks server-rounds`: the verification server's time per round against context.

A session is opened on a prompt of N tokens (a news article, cut to N), the first verify (the
prefill) is left out, then `rounds` verifies of a `draft`-token proposal each are timed through
the app in process (no socket): the median is what a round costs the server at that context. A server whose
sessions keep their KV cache should cost the same at 100 and at 2,000 tokens, up to what one decoding
step of the target itself gains over that range: each context also times the target alone
decoding `rounds` tokens after the same prompt (median ms per token), the floor a round's growth is
measured against.
"""

from __future__ import annotations

import time
from statistics import median
from typing import Any

from omnidraft.bench.datasets import load_prompts
from omnidraft.server.app import ServerConfig, create_app

__all__ = ["round_times"]


def round_times(target: Any, contexts: list[int], *, rounds: int = 8, draft: int = 3) -> list[dict[str, Any]]:
    """Per context length: median and spread of the service's time per verify round."""
    text = " ".join(load_prompts("summarize", 8))
    ids = target.tokenizer(text)["input_ids"]
    if len(ids) < max(contexts):
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than the largest context {max(contexts)}")
    from fastapi.testclient import TestClient

    rows = []
    with TestClient(create_app(target, ServerConfig(max_tokens=1 << 20))) as http:
        for n in contexts:
            sid = http.post("/v1/sessions", json={"prompt_ids": ids[:n]}).json()["session"]
            committed, times = n, []
            for r in range(rounds + 1):
                proposal = ids[
                    committed : committed + draft
                ]  # the article's own next tokens: accepts and rejects
                started = time.perf_counter()
                reply = http.post(
                    f"/v1/sessions/{sid}/verify", json={"committed": committed, "proposal": proposal}
                ).json()
                if r:
                    times.append(time.perf_counter() - started)
                committed = reply["committed"]
            http.delete(f"/v1/sessions/{sid}")
            rows.append(
                {
                    "context": n,
                    "median_ms": 1000 * median(times),
                    "min_ms": 1000 * min(times),
                    "max_ms": 1000 * max(times),
                    "step_ms": 1000 * _step_time(target, ids[:n], rounds),
                }
            )
    return rows


def _step_time(target: Any, ids: list[int], rounds: int) -> float:
    """The target alone's median seconds per decoded token after `ids` (the prefill left out)."""
    tokens = target.begin(ids).decode(rounds + 1)
    next(tokens)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        if next(tokens, None) is None:
            break
        times.append(time.perf_counter() - started)
    return median(times)
