"""Which drafter backend is fastest here, by timing them on the machine that runs.

`fastest_drafter(spec)` loads each installed backend that can run `spec` (PyTorch int8 always;
llama.cpp for a preset or .gguf file when llama-cpp-python is installed), drafts the same tokens
with each, and returns the one with the lowest time per drafted token. The timings are remembered
per machine and model (measured.py), so a later load times nothing and loads one backend.
A PyTorch drafter is the only one that learns: pair with `Drafter.load(spec, backend="torch")`
to learn adapters.

`drafting_copy` is what `pair()` uses: a PyTorch drafter loaded from a preset or .gguf file drafts
through its llama.cpp copy (only where this machine's llama.cpp build has run that file in a
child process: llamacpp/smoke.py) (the same GGUF file under llama.cpp) wherever that drafts faster here
and the pairing needs nothing only the PyTorch drafter has (learning, adapters, a user profile,
an acceptance head, a shortlisted head); `backend="torch"` at load keeps it on PyTorch.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from statistics import median
from typing import TYPE_CHECKING, Any, Callable

from . import measured

if TYPE_CHECKING:
    from ..target import Target

__all__ = [
    "draft_ms",
    "drafting_copy",
    "drafting_cost",
    "fastest_drafter",
    "pairing_best_speedup",
    "reading_cost",
]

log = logging.getLogger(__name__)

PROBE = "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"


def draft_ms(drafter: Any, prompt_ids: list[int] | None = None, *, tokens: int = 32, reps: int = 3) -> float:
    """Median ms per token of `reps` greedy drafts of `tokens` tokens (no early stop) after
    `prompt_ids` (default: a short mixed text), after a warm-up draft."""
    session = drafter.begin(prompt_ids or drafter.tokenizer(PROBE)["input_ids"])
    session.propose(4, stop_confidence=0)
    session.commit(0, [])
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        draft = session.propose(tokens, stop_confidence=0)
        times.append((time.perf_counter() - started) * 1e3 / max(1, len(draft.ids)))
        session.commit(0, [])
    return median(times)


def drafting_cost(drafter: Any) -> float:
    """Seconds per drafted token of `drafter` (its class and model), measured once per machine
    with `draft_ms` and remembered."""
    key = drafter.cost_key  # its model, backend, weights and head
    return float(measured.remembered("drafting-cost", key, lambda: draft_ms(drafter))) / 1e3


def read_ms(drafter: Any, tokens: int = 200, reps: int = 3) -> float:
    """Median ms per token of `drafter` reading a fresh prompt of `tokens` tokens and drafting one
    token after it (what a request's first model draft costs beyond its drafted tokens)."""
    ids = list(drafter.tokenizer(PROBE * (1 + tokens // 8))["input_ids"])[:tokens]
    times = []
    for rep in range(reps + 1):  # (the first, a warm-up)
        prompt = ids[rep:]  # (another first token each time: no cached prefix reused)
        session = drafter.begin(prompt)
        started = time.perf_counter()
        session.propose(1, stop_confidence=0)
        times.append((time.perf_counter() - started) * 1e3 / len(prompt))
    return median(times[1:])


def reading_cost(drafter: Any) -> float:
    """Seconds `drafter` takes to read a prompt token (its class and model), measured once per
    machine with `read_ms` and remembered: what the floor charges a first model draft before the
    request has measured it (adaptive/floor.py)."""
    return float(measured.remembered("drafter-read-cost", drafter.cost_key, lambda: read_ms(drafter))) / 1e3


def drafting_copy(drafter: Any, config: Any, *, learn: bool, adapter: Any, user: str | None) -> Any:
    """The drafter a new pairing drafts with: `drafter`, or its llama.cpp copy where that drafts a
    token faster on this machine (costs measured once and remembered) and the pairing needs nothing
    only the PyTorch drafter has (see the module doc)."""
    spec = getattr(drafter, "gguf_spec", None)
    if (
        spec is None
        or learn
        or adapter is not None
        or user is not None
        or config.head
        or drafter.head is not None
        or drafter.active is not None
        or "llama.cpp" not in _candidates(spec)
    ):
        return drafter
    llama = drafter.llama_copy()
    if llama is None:
        return drafter
    fast, slow = drafting_cost(llama), drafting_cost(drafter)
    if fast >= slow:
        return drafter
    log.debug(
        "%s: drafting on llama.cpp (%.1f ms a token against %.1f on PyTorch here)",
        drafter.name,
        1e3 * fast,
        1e3 * slow,
    )
    return llama


def pairing_best_speedup(drafter: Any, target: Target, config: Any) -> Any:
    """What drafting could gain at best for this pair on this machine (adaptive/policy.py
    `BestSpeedup`), for a target that reports measured verify costs (`verify_costs()`) and a config
    that chooses draft lengths for speed; None otherwise (the pairing then measures as it goes)."""
    from ..adaptive.policy import best_speedup

    if config.k is not None or config.objective != "latency":
        return None
    costs = target.verify_costs()
    if costs is None:
        return None
    return best_speedup(costs, drafting_cost(drafter) if config.drafts != "retrieval" else 0.0)


def _candidates(spec: str) -> list[str]:
    from ..store.presets import PRESETS

    names = ["torch"]
    if spec in PRESETS or spec.endswith(".gguf"):
        if importlib.util.find_spec("llama_cpp") is None:
            log.info("llama-cpp-python is not installed: the drafter runs on PyTorch")
        else:
            from ..llamacpp.loading import gguf_file
            from ..llamacpp.smoke import runs

            if runs(gguf_file(spec)[0]) == "ok":  # a build that crashes here is never picked (smoke.py)
                names.append("llama.cpp")
    return names


def fastest_drafter(spec: str, load: Callable[[str], Any]) -> Any:
    """The drafter for `spec` on whichever installed backend drafts fastest here; `load(backend)`
    loads it on one backend."""
    names = _candidates(spec)
    timed = dict(measured.read("drafter-backends").get(spec, {}))
    if len(names) == 1:
        return load(names[0])
    if all(n in timed for n in names):
        best = min(names, key=timed.__getitem__)
        return load(best)
    loaded = {}
    for name in names:
        loaded[name] = load(name)
        timed[name] = round(draft_ms(loaded[name]), 3)
    best = min(names, key=timed.__getitem__)
    path = measured.update("drafter-backends", {spec: timed})
    log.info(
        "drafter %s: %s ms per drafted token; drafting on %s (kept in %s)",
        spec,
        ", ".join(f"{n} {timed[n]:.1f}" for n in names),
        best,
        path,
    )
    return loaded[best]
