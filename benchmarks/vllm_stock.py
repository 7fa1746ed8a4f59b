"""The stock-vLLM path: `OpenAICompletionsTarget` against a stock `vllm serve` (OpenAI API), its
time per verify round by context length, beside the same verify on `VLLMTarget` (the session's
prefix cache; docs/vllm.md). A verify over the OpenAI API is a completion of the context plus the
proposal with echo and prompt log-probabilities, which vLLM computes without its prefix cache.

    python -m benchmarks.vllm_stock --out bench_out/vllm-stock.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from .vllm_local import verify_by_context


def stock_server_argv(model_dir: object, port: int) -> list[str]:
    """Stock vLLM's OpenAI server on `model_dir`: fp32, blocks of 32 (as the CPU backend needs), 4,096
    tokens a sequence, the model served as "target"."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--max-model-len",
        "4096",
        "--served-model-name",
        "target",
    ]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_stock")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--contexts", default="200,1000,2000,3000")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="bench_out/vllm-stock.json")
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]

    import httpx

    import omnidraft as od
    from omnidraft.store.models import hf_directory, load_tokenizer

    path, tokenizer = hf_directory(args.target), load_tokenizer(args.target)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        stock_server_argv(path, port),
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CPU_KVCACHE_SPACE": "2"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit("vllm serve did not start")
            time.sleep(2)
        stock = od.OpenAICompletionsTarget(url, model="target", tokenizer=tokenizer)
        report = {"target": args.target, "stock_vllm_serve_s": verify_by_context(stock, contexts, args.reps)}
    finally:
        server.terminate()
        server.wait(timeout=60)
    engine = od.VLLMTarget.load(args.target, dtype="float32")
    try:
        report["vllm_target_s"] = verify_by_context(engine, contexts, args.reps)
    finally:
        engine.close()
    print(json.dumps(report, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
