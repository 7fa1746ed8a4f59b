"""Ten sessions sharing a long system prompt: time to first token on `omnidraft serve --engine vllm`
(one API key's sessions share prefix-cache pages; another key's do not) beside stock vLLM's OpenAI
server on the same weights, each server alone on the machine, one after the other (docs/deploy.md).

    python -m benchmarks.tenant_prefix --out bench_out/tenant-prefix.json

Each request: the shared system prompt (about `--prefix` tokens), then a question of its own,
greedy, 1 new token, sent one after the other. omnidraft's rows: a device session's first token
(`POST /v1/sessions`, then a verify of nothing: the server reads the prompt and commits one
token), key A for ten sessions, then key B for three; stock vLLM: a streamed `/v1/completions`
of the same ids, first chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _prompts(tokenizer: Any, prefix_tokens: int, n: int) -> list[list[int]]:
    from omnidraft.bench.datasets import load_prompts

    text = ""
    for doc in load_prompts("summarize", 8):
        text += doc + "\n"
        if len(tokenizer(text)["input_ids"]) >= prefix_tokens:
            break
    system = tokenizer(text)["input_ids"][:prefix_tokens]
    return [
        system + tokenizer(f"\nQuestion {i}: what is the {i}th word above?")["input_ids"] for i in range(n)
    ]


def _omnidraft_ttft(url: str, key: str, ids: list[int]) -> float:
    import httpx

    auth = {"authorization": f"Bearer {key}"}
    began = time.perf_counter()
    sid = httpx.post(f"{url}/v1/sessions", json={"prompt_ids": ids}, headers=auth, timeout=600).json()[
        "session"
    ]
    body = {"committed": len(ids), "proposal": []}
    r = httpx.post(f"{url}/v1/sessions/{sid}/verify", json=body, headers=auth, timeout=600)
    r.raise_for_status()
    seconds = time.perf_counter() - began
    httpx.delete(f"{url}/v1/sessions/{sid}", headers=auth, timeout=60)
    return seconds


def _stock_ttft(url: str, ids: list[int]) -> float:
    import httpx

    body = {"model": "target", "prompt": ids, "max_tokens": 1, "temperature": 0.0, "stream": True}
    began = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                return time.perf_counter() - began
    raise RuntimeError("no chunk")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tenant_prefix")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--prefix", type=int, default=1000)
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from omnidraft.bench.network import free_port, server_process
    from omnidraft.store.models import hf_directory, load_tokenizer

    from .vllm_stock import stock_server_argv

    tokenizer = load_tokenizer(args.target)
    prompts = _prompts(tokenizer, args.prefix, args.sessions + 3)
    keys = Path(tempfile.mkdtemp()) / "keys"
    keys.write_text("key-a\nkey-b\n")
    report: dict = {"prefix_tokens": args.prefix, "sessions": args.sessions}
    log = str(Path(tempfile.mkdtemp()) / "servers.log")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "omnidraft.cli", "serve", "--target", args.target, "--engine", "vllm"]
    serve += ["--dtype", "float32", "--api-key-file", str(keys), "--port", str(port)]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with server_process(serve, 0, url, "/ready", log):
        _omnidraft_ttft(url, "key-a", prompts[-1][-40:])  # warm: the engine compiled
        a = [_omnidraft_ttft(url, "key-a", ids) for ids in prompts[: args.sessions]]
        b = [_omnidraft_ttft(url, "key-b", ids) for ids in prompts[args.sessions :]]
    report["omnidraft_key_a_s"] = [round(t, 3) for t in a]
    report["omnidraft_key_b_s"] = [round(t, 3) for t in b]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stock = stock_server_argv(hf_directory(args.target), port)
    with server_process(stock, 0, url, "/health", log):
        _stock_ttft(url, prompts[-1][-40:])
        s = [_stock_ttft(url, ids) for ids in prompts[: args.sessions]]
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
