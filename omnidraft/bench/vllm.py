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
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from .baselines import Timed
from .llama import pairing_row

if TYPE_CHECKING:
    from ..targets.vllm_target import VLLMTarget

__all__ = ["per_request", "run_vllm"]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
ENGINES = ("vLLM alone", "omnidraft (default)", "vLLM n-gram speculative")
DTYPE = "float32"  # every row's weights, as in docs/vllm.md


def _engine_alone(target: VLLMTarget, prompt: str, ids: list[int], n: int) -> Timed:
    started = time.perf_counter()
    out = target.generate(ids, n)
    return Timed(out, time.perf_counter() - started)


def _outputs(
    row: str, drafter_spec: str, target_spec: str, sets: dict[str, list[str]], n: int
) -> tuple[dict[str, list[tuple[list[int], float]]], list[str]]:
    """In a process of its own: one contender's (ids, seconds) per prompt of every set, and notes."""
    import omnidraft as od

    notes: list[str] = []
    if row == "omnidraft (default)":
        target = od.VLLMTarget.load(target_spec, dtype=DTYPE)
        pair = od.Drafter.load(drafter_spec).pair(target)
        notes.append(f"{row}: drafts verified in vLLM's step: {target.capabilities.drafts_in_engine}")
        run: Callable[[str, list[int]], Timed] = partial(pairing_row, pair, n)
    else:
        extra = {"speculative_config": NGRAM} if row == "vLLM n-gram speculative" else {}
        target = od.VLLMTarget.load(target_spec, dtype=DTYPE, draft_tokens=0, **extra)
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
    ngram: bool = True,
    repeats: int = 1,
    notes: dict[str, list[str]] | None = None,
    progress: Callable[[str], object] = lambda _: None,
) -> dict[str, list[dict[str, Any]]]:
    """Per prompt set (dataset), per prompt, per row: {"row", "prompt", "tokens", "seconds", "runs",
    "identical"} (identical: the same ids as vLLM alone in every run). With `repeats`, the rows
    run in turn that many times over (alone, omnidraft, n-gram, alone, ...), each on a fresh
    engine, and a request's seconds are the median of its runs. `notes` receives, per set, why a
    row is absent and how the pairing ran."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    notes = notes if notes is not None else {}
    outputs: dict[str, list[dict[str, list[tuple[list[int], float]]]]] = {}
    for r in range(repeats):
        for row in ENGINES if ngram else ENGINES[:2]:
            if r and row not in outputs:
                continue  # it did not run the first time: the notes say why
            progress(f"{row}, run {r + 1}/{repeats}")
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                try:
                    out, said = pool.submit(
                        _outputs, row, drafter_spec, target_spec, prompt_sets, max_new_tokens
                    ).result()
                except Exception as exc:  # e.g. the CPU build refuses n-gram: say so instead of a row
                    if row == ENGINES[0] or r:
                        raise
                    said = [f"{row} did not run: {type(exc).__name__}: {exc}"[:400]]
                else:
                    outputs.setdefault(row, []).append(out)
            if r == 0:  # a row's notes once, not once a run
                for name in prompt_sets:
                    notes.setdefault(name, []).extend(said)
    return per_request(outputs, {name: len(prompts) for name, prompts in prompt_sets.items()})


def per_request(
    outputs: dict[str, list[dict[str, list[tuple[list[int], float]]]]], counts: dict[str, int]
) -> dict[str, list[dict[str, Any]]]:
    """Each row's runs (per run, per set, per prompt: ids and seconds) as one result a request:
    the median of its runs' seconds, identical when every run gave vLLM alone's first ids (a
    shorter output compares as far as it goes)."""
    results: dict[str, list[dict[str, Any]]] = {}
    for name, count in counts.items():
        results[name] = []
        for i in range(count):
            reference = outputs[ENGINES[0]][0][name][i][0]
            for row, runs in outputs.items():
                mine = [run[name][i] for run in runs]
                results[name].append(
                    {
                        "row": row,
                        "prompt": i,
                        "tokens": len(mine[0][0]),
                        "seconds": float(statistics.median(seconds for _, seconds in mine)),
                        "runs": [seconds for _, seconds in mine],
                        "identical": all(ids == reference[: len(ids)] for ids, _ in mine),
                    }
                )
    return results
