"""`omnidraft demo`: a few GSM8K and HumanEval prompts, the default pairing against the fastest way
to run the same target weights on this machine, side by side, per request and in total.

The engine compared with is the one `load_target(spec)` picks (targets/fastest.py): of llama.cpp
(a GGUF file this machine's llama.cpp build runs) and OpenVINO (an exported IR, or a preset where an
exporter is named: `make demo` names its own), the one that served a request alone fastest here,
timed once a machine; elsewhere (a Hugging Face model, neither engine) the PyTorch target on its
fastest kernels (bench/runner.py). Each request runs on that engine alone, the pairing twice, then
the engine alone again (so a drift of the machine's speed weighs on both), greedy; every output is
compared with the engine's own.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, cast

if TYPE_CHECKING:
    from ..llamacpp.llama_target import LlamaCppTarget
    from ..target import Target
    from .baselines import Timed

__all__ = ["demo_engine", "run_demo", "verdict", "workloads"]


ENGINES = {
    "llama.cpp": "llama.cpp",
    "openvino": "OpenVINO",
    "openvino-int4": "OpenVINO (int4)",
}  # in-process engines: their names on screen


def demo_engine(target_spec: str, choice: str = "auto") -> str:
    """ "llama.cpp", "openvino", "openvino-int4" or "torch": `choice`, or for "auto" the engine that serves
    `target_spec` alone fastest here (the one `load_target` picks)."""
    if choice != "auto":
        return choice
    from ..targets.registry import resolved

    name = resolved(target_spec, "auto", {})
    return name if name in ENGINES else "torch"


def run_demo(args: argparse.Namespace, datasets: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """(the engine compared with, one row per request: dataset, index, tokens, the engine's and
    omnidraft's tokens/s, identical, acceptance, tau)."""
    engine = demo_engine(args.target, args.target_backend)
    if engine in ENGINES:
        return ENGINES[engine], _on_engine(args, datasets, engine)
    return "PyTorch (its fastest kernels here)", _on_torch(args, datasets)


def _on_torch(args: argparse.Namespace, datasets: list[str]) -> list[dict[str, Any]]:
    from .commands import run_pair

    on_torch = argparse.Namespace(**{**vars(args), "target_backend": "torch"})
    _, per_prompt = run_pair(f"{args.drafter}:{args.target}", datasets, on_torch, peers=(), trace=None)
    rows = []
    for key, results in per_prompt.items():
        for r in results:
            rows.append(
                {
                    "dataset": key.rsplit("/", 1)[1],  # key: PAIR/DATASET
                    "index": r["index"],
                    "engine_tok_s": r["new_tokens"] / r["target_s"],
                    "omnidraft_tok_s": r["new_tokens"] / r["omnidraft_s"],
                    "tokens": r["new_tokens"],
                    "identical": r["identical"],
                    "acceptance": r["acceptance_rate"],
                    "tau": r["mean_accepted_length"],
                }
            )
    return rows


def _timed_pair(pair: Any, prompt: str, n: int) -> tuple[Any, float]:
    started = time.perf_counter()
    out = pair.generate(prompt, max_new_tokens=n)
    return out, time.perf_counter() - started


def _alone(engine: str, target: Target, n: int) -> Callable[..., Timed]:
    """(prompt, ids) -> the timed output of `target` decoding alone: llama-cpp-python's own
    `generate` for llama.cpp, the target's own one-token loop for OpenVINO."""
    from .baselines import target_alone
    from .llama import llama_alone

    if engine == "llama.cpp":
        return llama_alone(cast("LlamaCppTarget", target), n)
    return lambda prompt, ids, tokens=n: target_alone(target, prompt, tokens)


def _on_engine(args: argparse.Namespace, datasets: list[str], engine: str) -> list[dict[str, Any]]:
    import omnidraft as od

    from .datasets import load_prompts

    target = od.load_target(args.target, engine)
    drafter = od.Drafter.load(args.drafter, backend=args.drafter_backend)
    pair = drafter.pair(target, k=args.k, stop_confidence=args.stop_confidence, strategy=args.strategy)
    alone = _alone(engine, target, args.max_new_tokens)
    warm = load_prompts(datasets[0], 1)[0]
    pair.generate(warm, max_new_tokens=8)
    alone(warm, target.tokenizer(warm)["input_ids"], 8)
    rows = []
    for dataset in datasets:
        for i, prompt in enumerate(load_prompts(dataset, args.n)):
            ids = target.tokenizer(prompt)["input_ids"]
            # engine, pairing, pairing, engine, engine, pairing, ...: the median of the runs a side, so
            # that a drift of the machine's speed, or one slow run, weighs on both sides alike
            refs, outs, engine_s, pair_s = [], [], [], []
            for side in "".join("EP" if j % 2 == 0 else "PE" for j in range(args.repeats)):
                if side == "E":
                    refs.append(alone(prompt, ids))
                    engine_s.append(refs[-1].seconds)
                else:
                    out, seconds = _timed_pair(pair, prompt, args.max_new_tokens)
                    outs.append(out)
                    pair_s.append(seconds)
            ref, out = refs[0], outs[0]
            rows.append(
                {
                    "dataset": dataset,
                    "index": i,
                    "engine_tok_s": len(ref.token_ids) / statistics.median(engine_s),
                    "omnidraft_tok_s": len(out.token_ids) / statistics.median(pair_s),
                    "tokens": len(out.token_ids),
                    "identical": all(o.token_ids == ref.token_ids for o in outs + refs),
                    "acceptance": out.stats.acceptance_rate,
                    "tau": out.stats.mean_accepted_length,
                    "speculating": out.stats.speculating,
                    "retrieved": out.stats.retrieved_share,
                    "why": out.stats.why,
                }
            )
    return rows


WORKLOADS = ("chat", "summarize", "rag", "code-edit", "gsm8k")  # what the demo times, in that order
NAMES = {
    "rag": "answers from documents",
    "code-edit": "code edits",
    "gsm8k": "math",
    "summarize": "summaries",
}
PAID = 1.03  # a workload's total ratio from which drafting is said to have paid


def workloads(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per workload, in the order run: its rows, tokens, omnidraft's and the engine's tokens/s in
    total, and the worst request's ratio."""
    out = {}
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        mine = [r for r in rows if r["dataset"] == dataset]
        tokens = sum(r["tokens"] for r in mine)
        out[dataset] = {
            "rows": mine,
            "tokens": tokens,
            "omni": tokens / sum(r["tokens"] / r["omnidraft_tok_s"] for r in mine),
            "alone": tokens / sum(r["tokens"] / r["engine_tok_s"] for r in mine),
            "worst": min(r["omnidraft_tok_s"] / r["engine_tok_s"] for r in mine),
        }
    return out


def verdict(rows: list[dict[str, Any]], engine: str) -> str:
    """One line: the workloads where drafting paid and from what, and why it stood aside elsewhere."""
    paid: list[tuple[str, float]] = []
    aside: list[tuple[str, float]] = []
    for dataset, w in workloads(rows).items():
        ratio = w["omni"] / w["alone"]
        copied = sum(r.get("retrieved", 0.0) * r["tokens"] for r in w["rows"]) / max(1, w["tokens"])
        name = f"{NAMES.get(dataset, dataset)} ({ratio:.2f}x)"
        drafted = any(r.get("speculating", True) for r in w["rows"])  # else it decoded alone: noise
        (paid if drafted and ratio >= PAID else aside).append((name, copied))
    parts = []
    if paid:
        copied = sum(c for _, c in paid) / len(paid)
        source = "mostly drafts copied from the context" if copied >= 0.3 else "the drafter's drafts"
        parts.append(f"drafting paid on {', '.join(n for n, _ in paid)}: {source}")
    if aside:
        whys = [r.get("why") for r in rows if r.get("why")]
        reason = (
            max(set(whys), key=whys.count)
            if whys
            else (
                f"its drafts did not win back what verifying them costs on {engine}, so each request "
                "drafted little and decoded the rest alone (docs/floor.md)"
            )
        )
        parts.append(f"it stood aside on {', '.join(n for n, _ in aside)}: {reason}")
    return "; ".join(parts) + "."
