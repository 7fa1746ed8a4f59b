"""Time the real drafter and target on this machine and write a device_sim device profile.

Measures what the simulator charges: the drafter's cost per token at two context lengths, the
target's cost of one forward over m = 1..M new tokens (the verification shape: all m logits kept),
the prefill cost per prompt token, and the bookkeeping per round of a real generation. Medians of
repeated runs, after a warm-up.
"""

from __future__ import annotations

import platform
import time
from statistics import median
from typing import Any, Callable

from omnidraft.runtime.causal_runner import CausalRunner

__all__ = ["calibrate"]


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * median(times)


def _step_ms(model: Any, context: int, m: int, reps: int) -> float:
    """One forward over m new tokens after `context` cached ones, keeping m logits."""
    runner = CausalRunner(model, [100 + i % 500 for i in range(context)])
    runner.forward(keep=1)

    def step() -> None:
        runner.extend([200 + j for j in range(m)])
        runner.forward(keep=m)
        runner.crop(context)

    return _median_ms(step, reps)


def calibrate(pair: Any, *, max_tokens: int = 12, context: int = 256, reps: int = 5) -> dict[str, Any]:
    """A device profile (device_sim JSON schema) for `pair`'s drafter and target on this machine."""
    drafter, target = getattr(pair.drafter, "pytorch", pair.drafter).model, pair.target.model
    near, far = _step_ms(drafter, 128, 1, reps * 2), _step_ms(drafter, 1024, 1, reps * 2)
    slope = (far - near) / (1024 - 128) * 1000
    target_ms = [round(_step_ms(target, context, m, reps), 2) for m in range(1, max_tokens + 1)]
    prefill = _median_ms(
        lambda: CausalRunner(target, [100 + i % 500 for i in range(context)]).forward(keep=1), reps
    )
    out = pair.generate(
        "Question: Tom has 3 apples and buys 5 more. How many now?\nAnswer:", max_new_tokens=48
    )
    bookkeeping = 1000 * sum(r.t_translate + r.t_resync for r in out.rounds) / len(out.rounds)
    drafter_mb = (
        sum(t.numel() * t.element_size() for t in drafter.state_dict().values() if hasattr(t, "numel"))
        / 2**20
    )
    return {
        "name": f"this-machine:{pair.drafter.name}:{pair.target.name}",
        "source": (
            f"python -m benchmarks calibrate on {platform.node() or 'this host'} "
            f"({platform.processor() or platform.machine()}), "
            f"medians of {reps} runs at context {context}; drafter {pair.drafter.name}, target "
            f"{pair.target.name}"
        ),
        "drafter_ms": round(near - slope * 128 / 1000, 3),
        "drafter_ms_per_1k_context": round(slope, 3),
        "target_ms": target_ms,
        "prefill_ms_per_token": round(prefill / context, 3),
        "bookkeeping_ms_per_round": round(bookkeeping, 3),
        "drafter_memory_mb": round(drafter_mb, 1),
    }
