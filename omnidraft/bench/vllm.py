"""`omnidraft bench --target-backend vllm`: the target on vLLM, every contender in one run, each
greedy and timed per request (prefill included), every output against vLLM alone's:
- vLLM alone: the engine's own greedy decoding of the request on a plain engine (the speed to beat);
- omnidraft: the default pairing of the drafter with `VLLMTarget`, whose engine verifies the
  drafts in its own speculative step (targets/vllm_proposer.py);
- vLLM n-gram: vLLM's own speculative decoding with `speculative_config` method "ngram" (where
  vLLM's CPU build refuses it, the row is absent and the refusal is in the notes).
Each engine runs in a process of its own, one after the other (vLLM's CPU build slows two live
engines in one process and fails to start a third), so the machine runs one contender at a time.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from typing import Any, Callable

from .baselines import Timed
from .llama import pairing_row

__all__ = ["run_vllm"]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
ENGINES = ("vLLM alone", "omnidraft (default)", "vLLM n-gram speculative")


def _engine_alone(target: Any, prompt: str, ids: list[int], n: int) -> Timed:
    started = time.perf_counter()
    out = target.generate(ids, n)
    return Timed(out, time.perf_counter() - started)


def _outputs(
    row: str, drafter_spec: str, target_spec: str, sets: dict[str, list[str]], n: int, dtype: str
) -> tuple[dict[str, list[tuple[list[int], float]]], list[str]]:
    """In a process of its own: one contender's (ids, seconds) per prompt of every set, and notes."""
    import omnidraft as od

    notes: list[str] = []
    if row == "omnidraft (default)":
        target = od.VLLMTarget.load(target_spec, dtype=dtype)
        pair = od.Drafter.load(drafter_spec).pair(target)
        notes.append(f"{row}: drafts verified in vLLM's step: {target.capabilities.drafts_in_engine}")
        run: Callable[[str, list[int]], Timed] = partial(pairing_row, pair, n)
    else:
        extra = {"speculative_config": NGRAM} if row == "vLLM n-gram speculative" else {}
        target = od.VLLMTarget.load(target_spec, dtype=dtype, draft_tokens=0, **extra)
        run = partial(_engine_alone, target, n=n)
    try:
        out: dict[str, list[tuple[list[int], float]]] = {}
        for name, prompts in sets.items():
            out[name] = []
            for i, prompt in enumerate(prompts):
                print(f"{row} {name} {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
                timed = run(prompt, target.tokenizer(prompt)["input_ids"])
                out[name].append((timed.token_ids, timed.seconds))
    finally:
        target.close()
    return out, notes


def run_vllm(
    drafter_spec: str,
    target_spec: str,
    prompt_sets: dict[str, list[str]],
    max_new_tokens: int,
    *,
    dtype: str = "float32",
    ngram: bool = True,
    notes: dict[str, list[str]] | None = None,
    progress: Callable[[str], object] = lambda _: None,
) -> dict[str, list[dict[str, Any]]]:
    """Per prompt set (dataset), per prompt, per row: {"row", "prompt", "tokens", "seconds",
    "identical"} (identical: the same ids as vLLM alone). `notes` receives, per set, why a row is
    absent and how the pairing ran."""
    notes = notes if notes is not None else {}
    outputs: dict[str, dict[str, list[tuple[list[int], float]]]] = {}
    for row in ENGINES if ngram else ENGINES[:2]:
        progress(row)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            try:
                outputs[row], said = pool.submit(
                    _outputs, row, drafter_spec, target_spec, prompt_sets, max_new_tokens, dtype
                ).result()
            except Exception as exc:  # e.g. the CPU build refuses n-gram: say so instead of a row
                if row == ENGINES[0]:
                    raise
                said = [f"{row} did not run: {type(exc).__name__}: {exc}"[:400]]
        for name in prompt_sets:
            notes.setdefault(name, []).extend(said)
    results: dict[str, list[dict[str, Any]]] = {}
    for name, prompts in prompt_sets.items():
        results[name] = []
        for i in range(len(prompts)):
            reference = outputs[ENGINES[0]][name][i][0]
            for row, out in outputs.items():
                ids, seconds = out[name][i]
                results[name].append(
                    {
                        "row": row,
                        "prompt": i,
                        "tokens": len(ids),
                        "seconds": seconds,
                        "identical": ids == reference[: len(ids)],
                    }
                )
    return results
