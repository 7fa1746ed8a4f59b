"""What steps cost on a `VLLMTarget`'s engine, timed on this machine (the target remembers the
figures, measured.py): a verify of n tokens after a context, and steps over many rows."""

from __future__ import annotations

import time
import uuid
from typing import Protocol

import torch

from .vllm_session import SessionEngine, VLLMSession

__all__ = ["BATCH_ROWS", "COST_CONTEXT", "FixedDrafts", "time_batches", "time_verifies"]

COST_CONTEXT = 200  # tokens of context before the tokens whose verify costs are measured
BATCH_ROWS = 16  # sequences in the steps whose costs `time_batches` measures


class TimedEngine(SessionEngine, Protocol):
    """What the timing reads of a `VLLMTarget`: its requests and engine loop, and its sessions."""

    def begin(self, prompt_ids: list[int]) -> VLLMSession: ...


def time_verifies(target: TimedEngine, up_to: int = 8, reps: int = 5) -> dict[str, float]:
    """Seconds to verify n = 1 .. `up_to` tokens after COST_CONTEXT tokens: a request each on a
    plain engine, an engine step each on one with omnidraft's proposer."""
    if target.proposer is not None:
        return time_engine_verifies(target, min(up_to, target.proposer.k + 1), reps)
    ids = [
        int(i)
        for i in torch.randint(
            0, target.vocab, (COST_CONTEXT + up_to,), generator=torch.Generator().manual_seed(0)
        )
    ]
    salt = uuid.uuid4().hex
    target.request(ids[:COST_CONTEXT], salt, max_tokens=1)
    times: dict[int, list[float]] = {n: [] for n in range(1, up_to + 1)}
    for _ in range(reps):
        for n in times:
            started = time.perf_counter()
            target.request(ids[: COST_CONTEXT + n - 1], salt, max_tokens=1, logprobs=1, prompt_logprobs=n > 1)
            times[n].append(time.perf_counter() - started)
    return {str(n): sorted(t)[len(t) // 2] for n, t in times.items()}


def time_engine_verifies(target: TimedEngine, up_to: int, reps: int) -> dict[str, float]:
    """Seconds per engine step that verifies n - 1 drafted tokens and samples one (n = 1: a
    plain decode step), after COST_CONTEXT tokens: the median gap between the step's outputs."""
    gen = torch.Generator().manual_seed(0)
    ids = [int(i) for i in torch.randint(0, target.vocab, (COST_CONTEXT,), generator=gen)]
    costs = {}
    for n in range(1, up_to + 1):
        stamps = [
            time.perf_counter() for _ in target.begin(ids).steps(reps + 2, FixedDrafts(n - 1), eos=False)
        ]
        gaps = sorted(b - a for a, b in zip(stamps[1:], stamps[2:]))  # after the prefill's
        costs[str(n)] = gaps[len(gaps) // 2]
    return costs


def time_batches(target: TimedEngine, rows: int = BATCH_ROWS, steps: int = 10) -> dict[str, float]:
    """Per draft length, the median step of `rows` concurrent requests (their prefill steps are
    the few slow ones the median leaves out)."""
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.vocab, (COST_CONTEXT,), generator=gen).tolist() for _ in range(rows)]
    costs = {}
    widths = sorted({0, min(3, target.proposer.k), min(7, target.proposer.k)}) if target.proposer else [0]
    for d in widths:  # drafts per row, within what the engine verifies a step
        before = target.loop.steps

        def run(ids: list[int], d: int = d) -> list:
            return list(target.begin(ids).steps(steps, FixedDrafts(d) if d else None, eos=False))

        with ThreadPoolExecutor(rows) as pool:
            list(pool.map(run, prompts))
        taken = sorted(list(target.loop.durations)[-(target.loop.steps - before) :])
        costs[str(rows * (d + 1))] = taken[len(taken) // 2]
    return costs


class FixedDrafts:
    """Rounds that propose `n` copies of the last id every step (what timing a verify needs)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def open(self, ids: list[int], drafter_ids: list[int] | None = None) -> None:
        pass

    def prepare(self, ids: list[int]) -> None:
        pass

    def next(self, ids: list[int], limit: int, remaining: int) -> list[int]:
        return [ids[-1]] * min(self.n, limit)
