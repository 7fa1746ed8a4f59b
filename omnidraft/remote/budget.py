"""How many draft tokens a verification server takes from each session next round, from its load.

On a server whose engine batches sessions, one step verifies every waiting session's tokens; on a
compute-bound engine each extra token lengthens that step for everyone. The budget is the draft
length that maximises committed tokens per second over all sessions (goodput, in the spirit of
SmartSpec, Liu et al. 2024): a step's cost is read off the engine's measured step costs by the
tokens it holds (one sequence's verifies of a few tokens, which a memory-bound step makes nearly
free, and steps over many rows, where a compute-bound engine pays for every token). N active
sessions each verifying k drafted tokens plus the pending one (plus the context tail a
block-granular prefix cache recomputes) commit N E(k) tokens, E(k) = (1 - a^(k+1)) / (1 - a) at
acceptance a, against N tokens a step decoding alone. Pure arithmetic: no server, no model.
"""

from __future__ import annotations

__all__ = ["draft_budget", "step_seconds"]


def step_seconds(costs: dict[int, float], tokens: float) -> float:
    """Seconds of an engine step over `tokens` tokens, read off the measured step costs (`costs`:
    tokens -> seconds; one sequence's verifies, and steps over many rows where measured) along
    straight lines between them, and past the last one along the steeper of the last line and the
    line from the first."""
    if not costs or min(costs) != 1 or costs[1] <= 0:
        raise ValueError(f"step costs need a positive cost for one token, got {costs}")
    points = sorted(costs.items())
    (first, c_first), (last, c_last) = points[0], points[-1]
    if tokens >= last:  # past the measurements: the steeper of the last line and the overall one
        lines = [(c_last - c_first) / (last - first)] if last > first else [0.0]
        if len(points) > 1:
            (t0, c0) = points[-2]
            lines.append((c_last - c0) / (last - t0))
        return c_last + max(0.0, *lines) * (tokens - last)
    for (t0, c0), (t1, c1) in zip(points, points[1:]):
        if tokens <= t1:
            return c0 + max(0.0, c1 - c0) * (tokens - t0) / (t1 - t0)
    return c_first


def draft_budget(costs: dict[int, float], acceptance: float, sessions: int, most: int, tail: int = 0) -> int:
    """The draft length in [1, `most`] of highest goodput for `sessions` sessions verifying at once,
    each accepting a drafted token with probability `acceptance`, where each verify also recomputes
    `tail` tokens of context (a block-granular prefix cache); 0 when no length beats the sessions
    decoding alone in the engine's own loop (one token each a step, no tail): hand them over."""
    if most < 0 or sessions < 1 or tail < 0:
        raise ValueError(f"need most >= 0, sessions >= 1 and tail >= 0, got {most}, {sessions} and {tail}")
    a = min(max(acceptance, 0.0), 0.999)
    alone = sessions / step_seconds(costs, sessions)

    def goodput(k: int) -> float:
        committed = (1 - a ** (k + 1)) / (1 - a)
        return sessions * committed / step_seconds(costs, sessions * (k + 1 + tail))

    best = max(range(1, most + 1), key=lambda k: (goodput(k), -k), default=0)
    return best if best and goodput(best) > alone else 0
