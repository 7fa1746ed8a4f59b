"""The streaming design simulated: devices drafting ahead for one server's batched engine across a
network, event by event (remote/streaming.py and remote/device_rounds.py are what it models).

The server steps back to back while any stream runs. At the start of a step each stream's row
takes its newest proposal that has arrived and still continues the committed text, up to the
budget; the step costs one forward over all rows' tokens (`server.target_cost`) and commits, per
row, the accepted prefix and one more token. Each device hears its tokens half a round trip after
the step ends. A device whose proposal the server's tokens left (or used up) starts a new round:
it drafts `first` tokens after what it heard and sends them; while the tokens keep following its
proposal it drafts on, `first` tokens at a time, up to `3 budget + 2` past what it heard, sending
each longer proposal (it arrives half a round trip later). Drafting costs `device.draft_cost` per
token on the device's own CPU; `shared_cpu` puts every device on one CPU (as the bench on this
machine does), where their drafting queues.

Acceptance: at each position of a stream's text the device's greedy guess, given the right text
before it, is right with probability `acceptance` (independently; a fitted per-token rate), so a
proposal drafted after committed position m is right up to the first wrong guess from m on. The
server decoding alone commits one token per row a step. `ttft_s`, the time to a request's first
token (its prefill, measured), is added to every request in both modes. Pure Python, no torch,
seeded.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from .hardware import DeviceProfile

__all__ = ["StreamResult", "simulate_streaming"]


@dataclass
class _Stream:
    right: list[bool]  # per generated position: whether the device's guess there is right
    committed: int = 0  # tokens the server has committed
    heard: int = 0  # tokens the device has heard of
    # the device's proposal: drafted after `at` committed tokens, `length` tokens long (positions at..)
    at: int = 0
    length: int = 0
    arrived: list[tuple[int, int]] = field(default_factory=list)  # (at, length) at the server, newest last
    steps: int = 0
    done_s: float = 0.0


@dataclass(frozen=True)
class StreamResult:
    """Per device: tokens/s (`device_tok_s`, mean over devices), and the server's committed tokens/s
    and forward steps per committed token; the same for the server decoding alone."""

    device_tok_s: float
    server_tok_s: float
    steps_per_token: float
    alone_tok_s: float

    @property
    def speedup(self) -> float:
        return self.server_tok_s / self.alone_tok_s


def _continues(stream: _Stream, at: int, length: int) -> int:
    """Tokens of the proposal (at, length) usable at the server's committed position: those past it
    while every committed token since `at` was the device's right guess; 0 where it left the text."""
    c = stream.committed
    if c < at or c >= at + length or not all(stream.right[at:c]):
        return 0
    return at + length - c


def simulate_streaming(
    server: DeviceProfile,
    device: DeviceProfile,
    *,
    rtt_ms: float,
    devices: int = 1,
    acceptance: float = 0.7,
    budget: int = 6,
    tokens: int = 128,
    first: int = 3,
    shared_cpu: bool = False,
    seed: int = 0,
    ttft_s: float = 0.0,
) -> StreamResult:
    """N = `devices` streams of `tokens` tokens each, all starting at once (see the module doc)."""
    if (
        devices < 1
        or tokens < 1
        or budget < 0
        or first < 1
        or not 0 <= acceptance <= 1
        or rtt_ms < 0
        or ttft_s < 0
    ):
        raise ValueError(
            f"need devices, tokens, first >= 1, budget >= 0, 0 <= acceptance <= 1, rtt_ms, ttft_s >= 0; "
            f"got {devices}, {tokens}, {first}, {budget}, {acceptance}, {rtt_ms}, {ttft_s}"
        )
    rng = random.Random(seed)
    streams = [_Stream([rng.random() < acceptance for _ in range(tokens + 64)]) for _ in range(devices)]
    half, order = rtt_ms / 2000, 0
    events: list[tuple[float, int, str, int, tuple[int, int]]] = []
    cpu_free = [0.0] * (1 if shared_cpu else devices)  # when each device CPU is next free

    def push(when: float, kind: str, i: int, data: tuple[int, int] = (0, 0)) -> None:
        nonlocal order
        heapq.heappush(events, (when, order, kind, i, data))
        order += 1

    def draft(i: int, now: float) -> None:
        """Device i drafts on (or starts over) after what it heard; each piece is sent when drafted."""
        s = streams[i]
        ahead = min(3 * budget + 2, tokens - s.heard)
        fresh = s.heard > s.at + s.length or (s.heard > s.at and not all(s.right[s.at : s.heard]))
        if fresh or s.length == 0:
            s.at, s.length = s.heard, 0
        cpu = 0 if shared_cpu else i
        start = max(now, cpu_free[cpu])
        while s.at + s.length - s.heard < ahead:
            n = min(first, ahead - (s.at + s.length - s.heard))
            start += device.draft_cost(n, s.heard) / 1000
            s.length += n
            push(start + half, "arrive", i, (s.at, s.length))
        cpu_free[cpu] = start

    for i in range(devices):
        draft(i, 0.0)
    now, steps, committed = 0.0, 0, 0
    while any(s.committed < tokens for s in streams):
        while events and events[0][0] <= now:  # proposals that arrived before this step starts
            when, _, kind, i, data = heapq.heappop(events)
            if kind == "arrive":
                streams[i].arrived.append(data)
            else:  # the device hears its tokens and drafts on
                streams[i].heard = data[0]
                draft(i, when)
        rows = 0
        plan = []
        for i, s in enumerate(streams):
            if s.committed >= tokens:
                continue
            given = 0
            for at, length in reversed(s.arrived):
                given = _continues(s, at, length)
                if given:
                    break
            given = min(given, budget, tokens - s.committed - 1)
            plan.append((i, given))
            rows += 1 + given
        now += server.target_cost(rows) / 1000
        steps += 1
        for i, given in plan:
            s = streams[i]
            ok = next((j for j in range(given) if not s.right[s.committed + j]), given)
            new = min(ok + 1, tokens - s.committed)
            s.committed += new
            committed += new
            s.steps += 1
            if s.committed >= tokens:
                s.done_s = now
            push(now + half, "hear", i, (s.committed, 0))
    alone_s = ttft_s + tokens * server.target_cost(devices) / 1000
    return StreamResult(
        device_tok_s=sum(tokens / (ttft_s + s.done_s) for s in streams) / devices,
        server_tok_s=committed / (ttft_s + now),
        steps_per_token=steps * devices / committed,
        alone_tok_s=devices * tokens / alone_s,
    )
