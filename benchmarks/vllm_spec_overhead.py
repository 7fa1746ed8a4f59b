"""What vLLM's speculative path costs a batch that drafts nothing: 16 concurrent greedy requests
(GSM8K prompts, 128 tokens each) on a plain engine and on one built with omnidraft's proposer
(which proposes nothing for requests nobody announced), each engine in a process of its own, no
server (docs/vllm.md, "The server under load").

    python -m benchmarks.vllm_spec_overhead --width 0 --width 2 --width 4 --width 8
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any


def decode_batch(draft_tokens: int, rows: int = 16, tokens: int = 128, reps: int = 2) -> list[dict[str, Any]]:
    """In a process of its own: per repetition, tok/s over all rows and the mean engine step."""
    import omnidraft as od
    from omnidraft.bench.datasets import load_prompts

    target = od.VLLMTarget.load("qwen2.5-coder-0.5b", dtype="float32", draft_tokens=draft_tokens)
    ids = [target.tokenizer(p)["input_ids"] for p in load_prompts("gsm8k", rows)]
    out = []
    try:
        for _ in range(reps):
            steps, busy, started = target.loop.steps, target.loop.busy, time.perf_counter()
            with ThreadPoolExecutor(rows) as pool:
                made = sum(map(len, pool.map(lambda i: target.generate(i, tokens), ids)))
            wall = time.perf_counter() - started
            step = (target.loop.busy - busy) / (target.loop.steps - steps)
            out.append({"tok_s": round(made / wall, 2), "step_ms": round(1e3 * step, 1)})
    finally:
        target.close()
    return out


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_spec_overhead")
    p.add_argument("--width", type=int, action="append", default=None, help="widths (default 0, 8)")
    widths = p.parse_args().width or [0, 8]
    for width in widths:  # 0: the plain engine
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            print(f"speculative width {width}", pool.submit(decode_batch, width).result(), flush=True)


if __name__ == "__main__":
    main()
