"""`python -m benchmarks engines`: one target's weights on every engine here, alone and with the
default pairing drafting for it, side by side (docs/openvino.md).

Rows, each greedy, timed per request (prefill included), taking turns prompt by prompt (each prompt
starts one row later) and repeated, the median of the repeats kept: llama.cpp alone (llama-cpp-
python's own `generate`), OpenVINO alone (one token at a time), and the default pairing (SmolLM2)
on each engine. Every ratio is against the fastest engine alone in total, and every pairing's
output is compared with its own engine decoding alone.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["run"]


def _timed(fn: Callable[[], list[int]]) -> tuple[list[int], float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def rows_for(
    target_spec: str, drafter_spec: str, n: int, *, beside: bool = False, weights: str = "int8"
) -> dict[str, Callable[[str], list[int]]]:
    """{row name: prompt -> output ids}; with `beside`, OpenVINO on one thread fewer than the
    machine has too: alone, paired drafting in turn, and paired drafting beside its verifies."""
    import omnidraft as od
    from omnidraft.bench.baselines import target_alone
    from omnidraft.bench.llama import llama_alone
    from omnidraft.llamacpp.loading import cpu_threads

    llama, vino = od.LlamaCppTarget(target_spec), od.OpenVINOTarget.load(target_spec, weights=weights)
    plain = llama_alone(llama, n)
    drafter = od.Drafter.load(drafter_spec)
    on_llama, on_vino = drafter.pair(llama), drafter.pair(vino)
    rows = {
        "llama.cpp alone": lambda p: plain(p, llama.tokenizer(p)["input_ids"]).token_ids,
        "OpenVINO alone": lambda p: target_alone(vino, p, n).token_ids,
        "default pairing, llama.cpp": lambda p: on_llama.generate(p, max_new_tokens=n).token_ids,
        "default pairing, OpenVINO": lambda p: on_vino.generate(p, max_new_tokens=n).token_ids,
    }
    if beside:
        fewer = od.OpenVINOTarget.load(target_spec, weights=weights, threads=max(1, cpu_threads() - 1))
        in_turn, overlapped = drafter.pair(fewer), drafter.pair(fewer, overlap=True)
        rows[FEWER] = lambda p: target_alone(fewer, p, n).token_ids
        rows[f"{FEWER}, paired"] = lambda p: in_turn.generate(p, max_new_tokens=n).token_ids
        rows[f"{FEWER}, paired beside"] = lambda p: overlapped.generate(p, max_new_tokens=n).token_ids
    return rows


FEWER = "OpenVINO, a core left"
REFERENCE = {
    "default pairing, llama.cpp": "llama.cpp alone",
    "default pairing, OpenVINO": "OpenVINO alone",
    f"{FEWER}, paired": FEWER,
    f"{FEWER}, paired beside": FEWER,
}


def run(args: Any) -> None:
    from omnidraft.bench.datasets import load_prompts

    drafter, target = args.pair.split(":")
    rows = rows_for(target, drafter, args.max_new_tokens, beside=args.beside, weights=args.weights)
    prompts = load_prompts(args.dataset, args.n)
    for fn in rows.values():  # warm every row once
        fn(prompts[0][:200])
    names, results = list(rows), []
    for i, prompt in enumerate(prompts):
        order = names[i % len(names) :] + names[: i % len(names)]
        times: dict[str, list[float]] = {name: [] for name in names}
        outs: dict[str, list[int]] = {}
        for _ in range(args.repeats):
            for name in order:
                outs[name], seconds = _timed(lambda: rows[name](prompt))
                times[name].append(seconds)
        results.append(
            {
                "index": i,
                "tokens": {k: len(v) for k, v in outs.items()},
                "seconds": {k: statistics.median(v) for k, v in times.items()},
                "identical": {k: outs[k] == outs[ref] for k, ref in REFERENCE.items() if k in outs},
            }
        )
        print(_line(results[-1]), flush=True)
    print(report(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


def _line(r: dict[str, Any]) -> str:
    rates = {k: r["tokens"][k] / s for k, s in r["seconds"].items()}
    return f"#{r['index']:<3}" + "  ".join(f"{k} {v:.1f}" for k, v in rates.items())


def report(results: list[dict[str, Any]]) -> str:
    """The table: each row's tokens/s in total, against the fastest engine alone, its worst request
    against that engine, and how many outputs equal the row's engine alone."""
    names = list(results[0]["seconds"])
    total = {k: sum(r["tokens"][k] for r in results) / sum(r["seconds"][k] for r in results) for k in names}
    fastest = max(("llama.cpp alone", "OpenVINO alone"), key=total.__getitem__)
    lines = [
        f"| row | tok/s | against {fastest} | worst request | identical to its engine alone |",
        "|---|---|---|---|---|",
    ]
    for k in names:
        worst = min(
            (r["tokens"][k] / r["seconds"][k]) / (r["tokens"][fastest] / r["seconds"][fastest])
            for r in results
        )
        same = sum(r["identical"][k] for r in results) if k in _compared(results) else None
        lines.append(
            f"| {k} | {total[k]:.2f} | {total[k] / total[fastest]:.2f}x | {worst:.2f}x | "
            f"{'-' if same is None else f'{same}/{len(results)}'} |"
        )
    return "\n".join(lines)


def _compared(results: list[dict[str, Any]]) -> set[str]:
    """The rows compared with their engine alone."""
    return set(results[0]["identical"])
