"""Replay recorded rounds under a scenario: exact arithmetic on the profile's costs, no wall clock.

Traces are omnidraft's per-round JSONL (`omnidraft.decode.stats`, which imports nothing heavy).
Each round costs:
drafting (device), one target forward over the pending token plus the proposal
(the first round also prefills the prompt), the bookkeeping, and in a remote placement one network
exchange. The target-alone baseline is charged the same prefill and one forward per token; in a
remote placement it is what a deployed server does: one request carrying the prompt, the whole
completion generated on the server and streamed back (one exchange, then one target step per
token), never one round trip per token. Beside latency the result counts target forwards per
committed token, what speculation saves a server (the streaming server spends one per token).
Rounds that proposed retrieved drafts (`retrieved` of their proposals) are charged the drafter
only for the tokens it drafted, so traces that mix sources replay as they ran.
Jitter is mean-zero and so does not move an expected latency; loss adds expected resends.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnidraft.decode.stats import RoundRecord as TraceRound
from omnidraft.decode.stats import read_trace

from .hardware import LOCAL, DeviceProfile, NetworkProfile

__all__ = [
    "Scenario",
    "SimResult",
    "TraceRound",
    "acceptance_per_position",
    "read_trace",
    "simulate",
    "sweep_k",
]


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
    rounds: int = 0
    baseline_bytes_sent: int = 0

    @property
    def forwards_per_token(self) -> float:
        """Target forwards per committed token while speculating (the baseline spends 1)."""
        return self.rounds / self.tokens

    @property
    def speculation_pays(self) -> bool:
        """Whether speculating beats the baseline on latency (a latency-objective pairing lets the
        target generate alone otherwise)."""
        return self.seconds < self.baseline_seconds

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


def _baseline_ms(run: list[TraceRound], sc: Scenario) -> tuple[float, int]:
    """The target alone: prefill, then one step per token; remote, one request whose reply streams
    every token back (one exchange). Returns (ms, bytes sent)."""
    host, tokens, prompt = sc.target_host, sum(r.emitted for r in run), run[0].context
    ms = host.prefill_ms_per_token * max(0, prompt - 1) + host.target_cost(1) * tokens
    if not sc.remote:
        return ms, 0
    up = sc.id_bytes * prompt
    return ms + sc.network.exchange_ms(up, sc.reply_bytes * tokens), up


def simulate(runs: list[list[TraceRound]], sc: Scenario) -> SimResult:
    """Expected totals over every generation in `runs` under scenario `sc`."""
    tokens = seconds = baseline = ttft = 0.0
    sent = baseline_sent = rounds = 0
    for run in runs:
        costs = [_round_ms(r, sc, i == 0) for i, r in enumerate(run)]
        seconds += sum(c for c, _ in costs) / 1000
        sent += sum(b for _, b in costs)
        ttft += costs[0][0] / 1000
        alone_ms, alone_sent = _baseline_ms(run, sc)
        baseline += alone_ms / 1000
        baseline_sent += alone_sent
        tokens += sum(r.emitted for r in run)
        rounds += len(run)
    return SimResult(int(tokens), seconds, ttft / len(runs), baseline, sent, rounds, baseline_sent)


def acceptance_per_position(runs: list[list[TraceRound]]) -> float:
    """MLE of a constant per-token acceptance probability (geometric model, truncated at `proposed`)."""
    accepted = sum(r.accepted for run in runs for r in run)
    rejections = sum(1 for run in runs for r in run if r.accepted < r.proposed)
    return accepted / (accepted + rejections) if accepted + rejections else 0.0


def sweep_k(
    runs: list[list[TraceRound]], sc: Scenario, ks: range = range(1, 13)
) -> list[tuple[int, float, float]]:
    """(k, expected tau, expected tokens/s) per draft length under the geometric model fitted to `runs`."""
    alpha = acceptance_per_position(runs)
    # target tokens per drafted token, over the model's part of each round (retrieved tokens cost no drafting)
    ratio = sum(r.proposed - r.retrieved for run in runs for r in run) / max(
        1, sum(r.drafted for run in runs for r in run)
    )
    context = sum(r.context for run in runs for r in run) / sum(len(run) for run in runs)
    rows = []
    for k in ks:
        m = max(1, round(k * ratio))
        tau = (1 - alpha ** (m + 1)) / (1 - alpha) if alpha < 1 else m + 1
        ms = (
            sc.device.draft_cost(k, int(context))
            + sc.target_host.target_cost(m + 1)
            + sc.device.bookkeeping_ms_per_round
            + (sc.network.exchange_ms(sc.id_bytes * m, sc.reply_bytes) if sc.remote else 0.0)
        )
        rows.append((k, tau, 1000 * tau / ms))
    return rows
