"""How many draft tokens a verification server takes from each session next round, from its load.

On a server whose engine batches sessions, one step verifies every waiting session's tokens; on a
compute-bound engine each extra token lengthens that step for everyone. The budget is the draft
length that maximises committed tokens per second over all sessions (goodput, in the spirit of
SmartSpec, Liu et al. 2024): a step over N rows and T tokens costs about b + r (N - 1) + s T
seconds (b + s T fitted to the target's measured verify costs of one row, r what each further row
adds besides its tokens, measured on a batch), N active sessions each verifying k drafted tokens
plus the pending one (plus the context tail a block-granular prefix cache recomputes) commit
N E(k) tokens, E(k) = (1 - a^(k+1)) / (1 - a) at acceptance a, against N tokens a step decoding
alone. Pure arithmetic: no server, no model.
"""

from __future__ import annotations

__all__ = ["draft_budget", "row_cost", "step_cost"]


def step_cost(costs: dict[int, float]) -> tuple[float, float]:
    """(b, s): a step over T tokens costs b + s T seconds, the line through the measured verify
    costs of one token and of the most tokens measured (`costs`: tokens -> seconds)."""
    if not costs or min(costs) != 1 or costs[1] <= 0:
        raise ValueError(f"verify costs need a positive cost for one token, got {costs}")
    most = max(costs)
    s = max(0.0, (costs[most] - costs[1]) / (most - 1)) if most > 1 else 0.0
    return costs[1] - s, s


def draft_budget(
    costs: dict[int, float], acceptance: float, sessions: int, most: int, tail: int = 0, row: float = 0.0
) -> int:
    """The draft length in [1, `most`] of highest goodput for `sessions` sessions verifying at once,
    each accepting a drafted token with probability `acceptance`, where each verify also recomputes
    `tail` tokens of context (a block-granular prefix cache) and each row past the first adds `row`
    seconds to a step; 0 when no length beats the sessions decoding alone in the engine's own loop
    (one token each a step, no tail): hand them over."""
    if most < 0 or sessions < 1 or tail < 0 or row < 0:
        raise ValueError(
            f"need most >= 0, sessions >= 1, tail >= 0 and row >= 0, got {most}, {sessions}, {tail}, {row}"
        )
    a = min(max(acceptance, 0.0), 0.999)
    b, s = step_cost(costs)
    b += row * (sessions - 1)
    alone = sessions / (b + s * sessions)

    def goodput(k: int) -> float:
        committed = (1 - a ** (k + 1)) / (1 - a)
        return sessions * committed / (b + s * sessions * (k + 1 + tail))

    best = max(range(1, most + 1), key=lambda k: (goodput(k), -k), default=0)
    return best if best and goodput(best) > alone else 0


def row_cost(costs: dict[int, float], rows: int, seconds: float) -> float:
    """What each row past the first adds to a step besides its tokens, from a measured step of
    `rows` rows of one token each taking `seconds` (0 when the measurement says nothing more)."""
    if rows < 2:
        raise ValueError(f"a batch measurement needs at least 2 rows, got {rows}")
    b, s = step_cost(costs)
    return max(0.0, (seconds - b - s * rows) / (rows - 1))
