"""Replay recorded rounds under a scenario: exact arithmetic on the profile's costs, no wall clock.

Traces are omnidraft's per-round JSONL (`omnidraft.stats`, which imports nothing heavy). Each round costs: drafting (device), one target forward over the pending token plus the proposal
(the first round also prefills the prompt), the bookkeeping, and in a remote placement one network
exchange. The target-alone baseline is charged the same prefill and one forward (and one exchange)
per token. Jitter is mean-zero and so does not move an expected latency; loss adds expected resends.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnidraft.stats import RoundRecord as TraceRound
from omnidraft.stats import read_trace

from .profiles import LOCAL, DeviceProfile, NetworkProfile

__all__ = ["Scenario", "SimResult", "TraceRound", "acceptance_per_position", "read_trace", "simulate", "sweep_k"]


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """`device` drafts; the target runs on `server` (None: on the device itself) across `network`."""

    device: DeviceProfile
    server: DeviceProfile | None = None
    network: NetworkProfile = LOCAL
    id_bytes: int = 4
    reply_bytes: int = 16

    @property
    def target_host(self) -> DeviceProfile:
        return self.server or self.device

    @property
    def remote(self) -> bool:
        return self.server is not None


@dataclass(frozen=True)
class SimResult:
    tokens: int
    seconds: float
    ttft_s: float
    baseline_seconds: float
    bytes_sent: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def speedup(self) -> float:
        return self.baseline_seconds / self.seconds

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_sent / self.tokens


def _round_ms(r: TraceRound, sc: Scenario, first: bool) -> tuple[float, int]:
    host = sc.target_host
    verify = host.target_cost(r.proposed + 1)
    if first:
        verify += host.prefill_ms_per_token * max(0, r.context - 1)
    up = sc.id_bytes * (r.proposed + (r.context if first else 0))
    network = sc.network.exchange_ms(up, sc.reply_bytes) if sc.remote else 0.0
    ms = sc.device.draft_cost(r.drafted, r.context) + verify + sc.device.bookkeeping_ms_per_round + network
    return ms, up if sc.remote else 0


def _baseline_ms(run: list[TraceRound], sc: Scenario) -> float:
    host, tokens, prompt = sc.target_host, sum(r.emitted for r in run), run[0].context
    per_token = host.target_cost(1) + (sc.network.exchange_ms(sc.id_bytes, sc.reply_bytes) if sc.remote else 0.0)
    first = host.prefill_ms_per_token * max(0, prompt - 1) + host.target_cost(1)
    if sc.remote:
        first += sc.network.exchange_ms(sc.id_bytes * prompt, sc.reply_bytes)
    return first + per_token * (tokens - 1)


def simulate(runs: list[list[TraceRound]], sc: Scenario) -> SimResult:
    """Expected totals over every generation in `runs` under scenario `sc`."""
    tokens = seconds = baseline = ttft = 0.0
    sent = 0
    for run in runs:
        costs = [_round_ms(r, sc, i == 0) for i, r in enumerate(run)]
        seconds += sum(c for c, _ in costs) / 1000
        sent += sum(b for _, b in costs)
        ttft += costs[0][0] / 1000
        baseline += _baseline_ms(run, sc) / 1000
        tokens += sum(r.emitted for r in run)
    return SimResult(int(tokens), seconds, ttft / len(runs), baseline, sent)


def acceptance_per_position(runs: list[list[TraceRound]]) -> float:
    """MLE of a constant per-token acceptance probability (geometric model, truncated at `proposed`)."""
    accepted = sum(r.accepted for run in runs for r in run)
    rejections = sum(1 for run in runs for r in run if r.accepted < r.proposed)
    return accepted / (accepted + rejections) if accepted + rejections else 0.0


def sweep_k(runs: list[list[TraceRound]], sc: Scenario, ks: range = range(1, 13)) -> list[tuple[int, float, float]]:
    """(k, expected tau, expected tokens/s) per draft length under the geometric model fitted to `runs`."""
    alpha = acceptance_per_position(runs)
    ratio = sum(r.proposed for run in runs for r in run) / max(1, sum(r.drafted for run in runs for r in run))
    context = sum(r.context for run in runs for r in run) / sum(len(run) for run in runs)
    rows = []
    for k in ks:
        m = max(1, round(k * ratio))
        tau = (1 - alpha ** (m + 1)) / (1 - alpha) if alpha < 1 else m + 1
        ms = (sc.device.draft_cost(k, int(context)) + sc.target_host.target_cost(m + 1) + sc.device.bookkeeping_ms_per_round
              + (sc.network.exchange_ms(sc.id_bytes * m, sc.reply_bytes) if sc.remote else 0.0))
        rows.append((k, tau, 1000 * tau / ms))
    return rows
