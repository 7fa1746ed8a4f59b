"""The measuring half of `python -m benchmarks adapt` (benchmarks/adapt.py): the target's traces
(recorded once, cached), the prompts they continue, and a drafter evaluated against them, with its
agreement with the target split by how sure the target was. `replay` and `draft-lengths` use the
same traces."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from omnidraft.bench.datasets import load_prompts
from omnidraft.decode.stats import GenerationStats
from omnidraft.distill.buffer import VerifiedRequest, build_example
from omnidraft.distill.trace_store import TargetTrace, load_traces, record_many, save_traces
from omnidraft.distill.trainer import TrainConfig
from omnidraft.pairing import DecodeConfig, Pairing
from omnidraft.runtime.int8 import fake_int8
from omnidraft.translate.ngram_cache import NgramCache, NgramCacheConfig

__all__ = ["MARGINS", "agreement", "evaluate", "prompts_for", "request_of", "traces_for"]

log = logging.getLogger("omnidraft")


def traces_for(
    target: Any, dataset: str, n: int, max_new_tokens: int, cache: Path, batch_size: int = 8
) -> list[TargetTrace]:
    """The target's traces for the first `n` prompts of `dataset`, recorded once and cached. A
    longer recording of the same prompts serves its first `n`; a shorter one is extended (only the
    prompts it lacks are recorded: the 1.5B target records ~7 s a prompt here)."""
    stem = f"traces-{target.name}-{dataset.replace(':', '-')}"
    path = cache / f"{stem}-{n}-{max_new_tokens}.safetensors"
    if path.exists():
        return load_traces(path, target.token_bytes.fingerprint)
    recorded: dict[int, Path] = {}
    for other in cache.glob(f"{stem}-*-{max_new_tokens}.safetensors"):
        count = other.name[len(stem) + 1 :].split("-")[0]
        if count.isdigit():
            recorded[int(count)] = other
    longer = [count for count in recorded if count >= n]
    if longer:
        return load_traces(recorded[min(longer)], target.token_bytes.fingerprint)[:n]
    have = load_traces(recorded[max(recorded)], target.token_bytes.fingerprint) if recorded else []
    prompts = load_prompts(dataset, n)[len(have) :]
    started = time.perf_counter()
    traces = have + record_many(
        target,
        prompts,
        max_new_tokens,
        batch_size=batch_size,
        progress=lambda i: log.info(
            "recorded %d/%d %s prompts on %s (%.0f s)",
            i,
            len(prompts),
            dataset,
            target.name,
            time.perf_counter() - started,
        ),
    )
    save_traces(path, traces, target.token_bytes.fingerprint)
    return traces


def prompts_for(target: Any, dataset: str, traces: list[TargetTrace]) -> list[str]:
    """The prompt texts `traces` were recorded from (the first len(traces) of `dataset`), each
    checked to tokenize to its recorded ids. (Decoding the ids instead is no round trip: a
    tokenizer that adds BOS, like Gemma's, decodes it as text and would add a second one.)"""
    prompts = load_prompts(dataset, len(traces))
    for i, (prompt, trace) in enumerate(zip(prompts, traces)):
        if target.tokenizer(prompt)["input_ids"] != trace.prompt_ids:
            raise ValueError(
                f"recorded trace {i} of {dataset} is not of prompt {i} as {target.name} tokenizes it now; "
                "delete the cached traces to record them again"
            )
    return prompts


def evaluate(
    drafter: Any,
    target: Any,
    traces: list[TargetTrace],
    prompts: list[str],
    *,
    k: int,
    stop_confidence: float,
    strategy: str = "text",
    ngram: NgramCacheConfig | None = None,
    adapter: str | None = None,
    cache: NgramCache | None = None,
    tts: TrainConfig | None = None,
) -> dict[str, float]:
    """Greedy acceptance, τ and n-gram hits/round of `drafter` (with `adapter`) on `prompts`, each
    generating as many tokens as its trace holds. `target`: a `ReplayTarget` of `traces` (drafter
    forwards only), or the live target they were recorded from (the check that replay tells the
    truth: "same_as_recorded" counts the prompts whose output is the recording's).
    `drafter`: a Drafter, or any object of its protocol (benchmarks/ngram_cache.py's reference drafter).
    `cache`: the n-gram cache to run with (default: a new one of config `ngram`).
    `tts`: score with Test-Time Speculation (its `tts_every` > 0): `adapter` takes fast steps inside
    each request and is put back at its end, so it is the same before and after; Algorithm 2's
    updates stay off (nothing is learned across held-out prompts)."""
    pair = Pairing(
        drafter,
        target,
        DecodeConfig(
            k=k, stop_confidence=stop_confidence, strategy=strategy, ngram=ngram or NgramCacheConfig()
        ),
    )
    pair.adapter = adapter  # (its drafts are made with it too)
    if cache is not None:
        pair.speculator.translator.cache = cache
    if tts is not None:
        pair.learner = _tts_learner(
            drafter, adapter, pair.speculator.translator.map.t2d, target.token_bytes, tts
        )
    rounds, tokens, same = [], 0, 0
    for trace, prompt in zip(traces, prompts):
        out = pair.generate(prompt, max_new_tokens=max(1, len(trace.continuation) - 1))
        rounds += out.rounds
        tokens += len(out.token_ids)
        same += out.token_ids == trace.continuation[: len(out.token_ids)]
    s = GenerationStats.from_rounds(rounds, tokens, 0.0)  # (no wall time: replayed rows must be reproducible)
    fast = (
        {"tts_steps": pair.learner.fast_steps, "tts_seconds": pair.learner.fast_seconds}
        if tts is not None
        else {}
    )
    return {
        "acceptance_rate": s.acceptance_rate,
        "tau": s.mean_accepted_length,
        "ngram_hits_per_round": s.ngram_hits_per_round,
        "rounds": len(rounds),
        "ngram_entries": len(pair.speculator.translator.cache),
        "ngram_bytes": pair.speculator.translator.cache.nbytes,
        "same_as_recorded": same,
        **fast,
    }


def _tts_learner(
    drafter: Any, adapter: str | None, t2d: torch.Tensor, target_bytes: Any, tts: TrainConfig
) -> Any:
    from omnidraft.distill.learner import Learner

    if not tts.tts_every:
        raise ValueError("scoring with Test-Time Speculation needs TrainConfig.tts_every > 0")
    if adapter is None or not hasattr(drafter, "add_adapter"):
        raise ValueError(
            "Test-Time Speculation trains an adapter: score a Drafter with one (a fresh one for the "
            "unadapted drafter)"
        )
    return Learner(drafter, adapter, t2d, target_bytes, replace(tts, interval=NEVER))


NEVER = 2**31 - 1  # an Algorithm 2 interval no scoring run reaches


MARGINS = (0.5, 1.5, 3.0)  # nats between the target's two most likely tokens: where agreement is split


def agreement(
    drafter: Any,
    adapter: str | None,
    target_bytes: Any,
    t2d: torch.Tensor,
    traces: list[TargetTrace],
    prompts: list[str],
) -> list[dict[str, Any]] | None:
    """Where the drafter (with `adapter`) still disagrees with the target: teacher-forced top-1
    agreement at every direct position of `traces` (one drafter token spells the committed target
    token), split by how sure the target was, its top-1 minus top-2 log-probability (`MARGINS`).
    Greedy verification accepts a drafted token exactly when it is the target's argmax, so this is
    acceptance per position, free of draft-length effects; where the target's top two nearly tie,
    its choice turns on detail a small drafter cannot see. One forward of the drafting model per
    trace; an int8 drafter's runs as int8.fake_int8 emulates it, activations quantized per token as
    in drafting (the kernel would give the whole sequence one scale). None for a drafter without a
    PyTorch model (benchmarks/ngram_cache.py's reference drafter).
    Rows: {"margin": label, "positions", "agreement"}, the last for all positions."""
    model = getattr(drafter, "model", None)
    if model is None or not hasattr(drafter, "activate"):
        return None
    edges = torch.tensor(MARGINS)
    n, right = torch.zeros(len(MARGINS) + 1), torch.zeros(len(MARGINS) + 1)
    with drafter.lock:
        previous = drafter.active
        drafter.activate(adapter)
        try:
            if getattr(drafter, "int8", False):
                model = fake_int8(model)
            for trace, prompt in zip(traces, prompts):
                example = build_example(request_of(trace, prompt, 2), drafter, target_bytes, t2d)
                if not example.kl_rows.numel():
                    continue
                with torch.no_grad():
                    logits = model(example.ids[None]).logits[0, example.kl_rows]
                hit = (logits.argmax(-1) == example.ids[example.kl_rows + 1]).float()
                logp = example.kl_logp
                margin = logp[:, 0] - logp[:, 1] if logp.shape[1] > 1 else torch.full((len(logp),), torch.inf)
                bucket = torch.bucketize(margin, edges, right=True)
                n += torch.bincount(bucket, minlength=len(n)).float()
                right += torch.bincount(bucket, weights=hit, minlength=len(n))
        finally:
            drafter.activate(previous)
    labels = [
        f"< {MARGINS[0]:g}",
        *(f"{a:g} to {b:g}" for a, b in zip(MARGINS, MARGINS[1:])),
        f">= {MARGINS[-1]:g}",
        "all",
    ]
    n, right = torch.cat([n, n.sum()[None]]), torch.cat([right, right.sum()[None]])
    return [
        {"margin": label, "positions": int(c), "agreement": float(r / c) if c else None}
        for label, c, r in zip(labels, n.tolist(), right.tolist())
    ]


def request_of(trace: TargetTrace, prompt: str, topk: int) -> VerifiedRequest:
    """A trace as the verified request a live greedy request would have given (top-`topk` rows)."""
    n = len(trace.continuation)
    return VerifiedRequest(
        prompt, trace.continuation, trace.topk_ids[:, :topk], trace.topk_logp[:, :topk], [1] * n
    )
