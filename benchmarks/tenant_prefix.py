"""Ten sessions sharing a long system prompt: time to first token on `omnidraft serve --engine vllm`
(one API key's sessions share prefix-cache pages; another key's do not) beside stock vLLM's OpenAI
server on the same weights, each server alone on the machine, one after the other (docs/deploy.md).

    python -m benchmarks.tenant_prefix --out bench_out/tenant-prefix.json

Each request: the shared system prompt (about `--prefix` tokens), then a question of its own,
greedy, 1 new token, sent one after the other. omnidraft's rows: a device session's first token
(`POST /v1/sessions`, then a verify of nothing: the server reads the prompt and commits one
token), key A for ten sessions, then key B for three; stock vLLM: a streamed `/v1/completions`
of the same ids, first chunk; each client keeps its connection open, as a device does.

Then the two-tenant check, `--trials` times each way on a `--trial-prefix`-token system prompt: a
fresh key's first token on the prompt key A's pages hold, and a fresh key's on a prompt nobody
sent; the engine's own count of prompt tokens read from its prefix cache (`/metrics`) for each
arm, and whether their times can be told apart (a permutation test on the medians).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _prompts(tokenizer: Any, prefix_tokens: int, n: int, skip: int = 0) -> list[list[int]]:
    """`n` prompts: one system prompt of `prefix_tokens` tokens (from the documents past the first
    `skip`), then a question of each prompt's own."""
    from omnidraft.bench.datasets import load_prompts

    text = ""
    for doc in load_prompts("summarize", skip + 8)[skip:]:
        text += doc + "\n"
        if len(tokenizer(text)["input_ids"]) >= prefix_tokens:
            break
    system = tokenizer(text)["input_ids"][:prefix_tokens]
    return [
        system + tokenizer(f"\nQuestion {i}: what is the {i}th word above?")["input_ids"] for i in range(n)
    ]


def _omnidraft_ttft(http: Any, key: str, ids: list[int]) -> float:
    """Seconds from opening a session to its first token (`http`: a client kept open, as on a device)."""
    auth = {"authorization": f"Bearer {key}"}
    began = time.perf_counter()
    sid = http.post("/v1/sessions", json={"prompt_ids": ids}, headers=auth).json()["session"]
    r = http.post(f"/v1/sessions/{sid}/verify", json={"committed": len(ids), "proposal": []}, headers=auth)
    r.raise_for_status()
    seconds = time.perf_counter() - began
    http.delete(f"/v1/sessions/{sid}", headers=auth)
    return seconds


def _stock_ttft(http: Any, ids: list[int]) -> float:
    body = {"model": "target", "prompt": ids, "max_tokens": 1, "temperature": 0.0, "stream": True}
    began = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=body) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                return time.perf_counter() - began
    raise RuntimeError("no chunk")


def _cache_hits(http: Any, operator: str) -> int:
    """The engine's count of prompt tokens read from its prefix cache so far (every key's)."""
    text = http.get("/metrics", headers={"authorization": f"Bearer {operator}"}).text
    line = next(x for x in text.splitlines() if x.startswith("omnidraft_prefix_cache_hit_tokens_total "))
    return int(line.split()[1])


def _apart(x: list[float], y: list[float], rounds: int = 10000) -> float:
    """Two-sided permutation p-value of the difference of medians: how often relabelling the
    pooled times at random gives a difference at least as large (small: the arms differ)."""
    seen, pooled, rng = abs(statistics.median(x) - statistics.median(y)), x + y, random.Random(0)
    hits = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        hits += abs(statistics.median(pooled[: len(x)]) - statistics.median(pooled[len(x) :])) >= seen
    return hits / rounds


def _isolation(http: Any, operator: str, shared: list[list[int]], fresh: list[list[int]]) -> dict:
    """Fresh keys alternately on a prompt key A's pages hold (`shared`) and on one nobody sent
    (`fresh`): each arm's times and the engine's prefix-cache hit tokens."""
    times: dict[str, list[float]] = {"shared": [], "fresh": []}
    hits = {"shared": 0, "fresh": 0}
    for i, (s, f) in enumerate(zip(shared, fresh)):
        for arm, ids, key in (("shared", s, f"probe-{2 * i}"), ("fresh", f, f"probe-{2 * i + 1}")):
            before = _cache_hits(http, operator)
            times[arm].append(_omnidraft_ttft(http, key, ids))
            hits[arm] += _cache_hits(http, operator) - before
    return {
        "trials": len(shared),
        "median_s": {arm: round(statistics.median(t), 3) for arm, t in times.items()},
        "times_s": {arm: [round(x, 3) for x in t] for arm, t in times.items()},
        "prefix_cache_hit_tokens": hits,
        "p_value": round(_apart(times["shared"], times["fresh"]), 3),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tenant_prefix")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--prefix", type=int, default=1000)
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--trials", type=int, default=20, help="two-tenant trials each way (0: none)")
    p.add_argument("--trial-prefix", type=int, default=256, help="system prompt tokens of a trial")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import httpx

    from omnidraft.bench.network import free_port, server_process
    from omnidraft.store.models import hf_directory, load_tokenizer

    from .vllm_stock import stock_server_argv

    tokenizer = load_tokenizer(args.target)
    prompts = _prompts(tokenizer, args.prefix, args.sessions + 3)
    keys = Path(tempfile.mkdtemp()) / "keys"
    keys.write_text(
        "".join(f"{k}\n" for k in ["key-a", "key-b", *(f"probe-{i}" for i in range(2 * args.trials))])
    )
    operator = keys.with_name("operator")
    operator.write_text("operator\n")
    report: dict = {"prefix_tokens": args.prefix, "sessions": args.sessions}
    log = str(Path(tempfile.mkdtemp()) / "servers.log")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "omnidraft.cli", "serve", "--target", args.target, "--engine", "vllm"]
    serve += ["--dtype", "float32", "--api-key-file", str(keys), "--operator-key-file", str(operator)]
    serve += ["--port", str(port)]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with server_process(serve, 0, url, "/ready", log), httpx.Client(base_url=url, timeout=600) as http:
        _omnidraft_ttft(http, "key-a", prompts[-1][-40:])  # warm: the engine compiled
        a = [_omnidraft_ttft(http, "key-a", ids) for ids in prompts[: args.sessions]]
        b = [_omnidraft_ttft(http, "key-b", ids) for ids in prompts[args.sessions :]]
        if args.trials:
            shared = _prompts(tokenizer, args.trial_prefix, args.trials, skip=8)
            fresh = _prompts(tokenizer, args.trial_prefix, args.trials, skip=16)
            _omnidraft_ttft(http, "key-a", shared[0])  # key A's pages hold the shared arm's system prompt
            report["two_keys"] = _isolation(http, "operator", shared, fresh)
    report["omnidraft_key_a_s"] = [round(t, 3) for t in a]
    report["omnidraft_key_b_s"] = [round(t, 3) for t in b]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stock = stock_server_argv(hf_directory(args.target), port)
    with server_process(stock, 0, url, "/health", log), httpx.Client(base_url=url, timeout=600) as http:
        _stock_ttft(http, prompts[-1][-40:])
        s = [_stock_ttft(http, ids) for ids in prompts[: args.sessions]]
    report["stock_vllm_s"] = [round(t, 3) for t in s]
    later_a, later_s = statistics.median(a[1:]), statistics.median(s[1:])
    report["median_from_second"] = {"omnidraft": round(later_a, 3), "stock": round(later_s, 3)}
    report["ratio_from_second"] = round(later_a / later_s, 2)
    report["key_b_first_vs_key_a_first"] = round(b[0] / a[0], 2)
    print(json.dumps(report, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
