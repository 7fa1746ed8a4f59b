"""A target on vLLM in this process: vLLM alone against the default pairing, and a verify's cost by
context length with the session's prefix cache (docs/vllm.md).

    python -m benchmarks.vllm_local --n 5 --out bench_out/vllm-local.json

Every pairing output is checked against vLLM's own greedy output of the same prompt.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def verify_by_context(target, contexts: list[int], reps: int = 5) -> dict[int, float]:
    """Median seconds of a 6-token verify after each context length (random ids), on `target`'s
    session after its first pass over the context (a prefill, not a verify). Also used by
    benchmarks/vllm_stock.py."""
    from omnidraft.target import Rule

    out = {}
    for n in contexts:
        ids = [int(i) for i in torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(n))]
        session = target.begin(ids)
        session.verify(torch.tensor([5]), Rule())
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            session.verify(torch.tensor([11, 12, 13, 14, 15, 16]), Rule())
            times.append(time.perf_counter() - started)
        if (close := getattr(session, "close", None)) is not None:
            close()
        out[n] = sorted(times)[reps // 2]
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_local")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--drafter", default="smollm2-135m")
    p.add_argument("--dataset", action="append", default=None, help="repeatable; default gsm8k and humaneval")
    p.add_argument("--n", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="bench_out/vllm-local.json")
    args = p.parse_args()

    import omnidraft as od
    from omnidraft.bench.datasets import load_prompts

    target = od.VLLMTarget.load(args.target, dtype=args.dtype)
    pair = od.Drafter.load(args.drafter).pair(target)
    report: dict = {
        "target": args.target,
        "dtype": args.dtype,
        "speculating": pair.speculating,
        "verify_costs_ms": {n: round(1e3 * s, 1) for n, s in target.verify_costs().items()},
    }
    for dataset in args.dataset or ["gsm8k", "humaneval"]:
        rows = []
        for prompt in load_prompts(dataset, args.n):
            ids = target.tokenizer(prompt)["input_ids"]
            started = time.perf_counter()
            alone = target.generate(ids, args.tokens)
            t_alone = time.perf_counter() - started
            started = time.perf_counter()
            out = pair.generate(prompt, max_new_tokens=args.tokens)
            t_pair = time.perf_counter() - started
            rows.append(
                {
                    "identical": out.token_ids == alone[: len(out.token_ids)],
                    "alone_s": t_alone,
                    "pair_s": t_pair,
                    "tokens": len(out.token_ids),
                    "alone_tokens": len(alone),
                    "tau": out.stats.mean_accepted_length,
                }
            )
            print(dataset, rows[-1], flush=True)
        ratio = sum(r["alone_s"] / r["alone_tokens"] * r["tokens"] for r in rows) / sum(
            r["pair_s"] for r in rows
        )
        report[dataset] = {
            "rows": rows,
            "speedup_vs_vllm_alone": round(ratio, 3),
            "vllm_alone_tok_s": round(
                sum(r["alone_tokens"] for r in rows) / sum(r["alone_s"] for r in rows), 2
            ),
            "identical": sum(r["identical"] for r in rows),
        }
        print(dataset, {k: v for k, v in report[dataset].items() if k != "rows"}, flush=True)
    report["verify_ms_by_context"] = {
        n: round(1e3 * s, 1) for n, s in verify_by_context(target, [200, 1000, 2000, 3000]).items()
    }
    print(report["verify_ms_by_context"], flush=True)
    target.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
