"""The verification server's counters, as Prometheus text (served at /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Metrics"]

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Metrics:
    """Sessions opened, rounds, accepted tokens, refused requests and a histogram of model time per call."""

    opened: int = 0
    rounds: int = 0
    accepted: int = 0
    proposed: int = 0
    rejected_requests: int = 0
    latency: list[int] = field(default_factory=lambda: [0] * (len(_BUCKETS) + 1))
    latency_sum: float = 0.0
    # (engine steps, busy seconds) so far, from a target whose engine loop counts them (vLLM); an
    # in-process engine's are its model calls as timed here (`observe`)
    counters: Callable[[], tuple[int, float] | None] = lambda: None
    # (prompt tokens, those read from the prefix cache) so far, from an engine with a shared cache (vLLM)
    cache: Callable[[], tuple[int, int] | None] = lambda: None

    def observe(self, seconds: float) -> None:
        self.latency[next((i for i, b in enumerate(_BUCKETS) if seconds <= b), len(_BUCKETS))] += 1
        self.latency_sum += seconds

    def engine(self) -> tuple[int, float]:
        """(engine steps, busy seconds) so far: the engine's own count, or else the model calls
        timed here."""
        return self.counters() or (sum(self.latency), self.latency_sum)

    def text(self, sessions: int) -> str:
        lines = [
            "# TYPE omnidraft_sessions gauge",
            f"omnidraft_sessions {sessions}",
            "# TYPE omnidraft_sessions_opened_total counter",
            f"omnidraft_sessions_opened_total {self.opened}",
            "# TYPE omnidraft_rounds_total counter",
            f"omnidraft_rounds_total {self.rounds}",
            "# TYPE omnidraft_accepted_tokens_total counter",
            f"omnidraft_accepted_tokens_total {self.accepted}",
            "# TYPE omnidraft_rejected_requests_total counter",
            f"omnidraft_rejected_requests_total {self.rejected_requests}",
            "# TYPE omnidraft_verify_seconds histogram",
        ]
        running = 0
        for bound, count in zip((*map(str, _BUCKETS), "+Inf"), self.latency):
            running += count
            lines.append(f'omnidraft_verify_seconds_bucket{{le="{bound}"}} {running}')
        lines += [
            f"omnidraft_verify_seconds_sum {self.latency_sum:.6f}",
            f"omnidraft_verify_seconds_count {running}",
        ]
        counted = self.engine()  # what a benchmark reads: work per token
        lines += [
            "# TYPE omnidraft_engine_steps_total counter",
            f"omnidraft_engine_steps_total {counted[0]}",
            "# TYPE omnidraft_engine_seconds_total counter",
            f"omnidraft_engine_seconds_total {counted[1]:.6f}",
        ]
        if (tokens := self.cache()) is not None:  # the engine's own count, across every key
            lines += [
                "# TYPE omnidraft_prompt_tokens_total counter",
                f"omnidraft_prompt_tokens_total {tokens[0]}",
                "# TYPE omnidraft_prefix_cache_hit_tokens_total counter",
                f"omnidraft_prefix_cache_hit_tokens_total {tokens[1]}",
            ]
        return "\n".join(lines) + "\n"
