"""`omnidraft bench --target-backend vllm`: the target on vLLM in this process, every contender in
one run, each greedy and timed per request (prefill included), every output against vLLM alone's:
- vLLM alone: the engine's own greedy decoding of the request (the speed to beat);
- vLLM n-gram: vLLM's own speculative decoding with `speculative_config` method "ngram" (a
  second engine on the same weights, timed after the first is closed: two engines in one process
  slow each other; where vLLM's CPU build refuses it, the row is absent and the refusal is in the
  notes);
- omnidraft: the default pairing with the drafter on `VLLMTarget` (per request it speculates or
  lets vLLM decode alone, whichever it measured faster), and the same under the "compute"
  objective (every request speculates), to show what drafting costs where the default declines it.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable

from .baselines import Timed
from .llama import pairing_row, time_rows

__all__ = ["run_vllm"]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _engine_alone(target: Any, ids: list[int], n: int) -> Timed:
    started = time.perf_counter()
    out = target.generate(ids, n)
    return Timed(out, time.perf_counter() - started)


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
    absent and each pairing's choice. Two engines in all, one after the other: vLLM's CPU build
    slows two live engines in one process and fails to start a third."""
    import omnidraft as od

    notes = notes if notes is not None else {}
    target = od.VLLMTarget.load(target_spec, dtype=dtype)
    drafter = od.Drafter.load(drafter_spec)
    results: dict[str, list[dict[str, Any]]] = {}
    references: dict[str, list[list[int]]] = {}
    try:
        for name, prompts in prompt_sets.items():
            pairs = {  # fresh pairings per set: each set starts from the same state
                "omnidraft (default)": drafter.pair(target),
                "omnidraft (compute objective)": drafter.pair(target, objective="compute"),
            }
            rows: dict[str, Callable[[str, list[int]], Timed]] = {
                "vLLM alone": lambda p, ids: _engine_alone(target, ids, max_new_tokens)
            }
            for row, pair in pairs.items():
                rows[row] = partial(pairing_row, pair, max_new_tokens)
            references[name] = []
            results[name] = time_rows(rows, prompts, target.tokenizer, progress, references[name])
            notes.setdefault(name, []).extend(
                f"{row}: per request, {pair.modes!r}" for row, pair in pairs.items() if pair.modes is not None
            )
    finally:
        target.close()
    if not ngram:
        return results
    try:
        spec = od.VLLMTarget.load(target_spec, dtype=dtype, speculative_config=NGRAM)
    except Exception as exc:  # the CPU build may not offer it: say so instead of a row
        for name in prompt_sets:
            notes.setdefault(name, []).append(
                f"vLLM n-gram speculative decoding did not start: {type(exc).__name__}: {exc}"[:400]
            )
        return results
    try:
        peer = {"vLLM n-gram speculative": lambda p, ids: _engine_alone(spec, ids, max_new_tokens)}
        for name, prompts in prompt_sets.items():
            results[name] += time_rows(peer, prompts, spec.tokenizer, progress, references[name])
    finally:
        spec.close()
    return results
