"""The streaming design simulated: devices drafting ahead for one server's batched engine across a
network, event by event (targets/remote_stream.py and server/device_proposals.py are what it models).

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
token (its prefill, measured), is added to every request in both modes; or, with `prompt`, each
request's prompt is read in the server's steps, `chunk` tokens a step (0: all at once), its row
adding those tokens to the step's cost and its first token coming with the last piece.

`requests` replays a run request by request instead: each (tokens, seconds the server takes to
read its prompt) in order, device d sending requests d, d + devices, ... one after another (as the
bench's devices do). A request reaches the server half a round trip after it is sent; between two
steps the server reads it, every other row waiting (a compute-bound server: the read's work delays
the others' steps as much), which gives its first token; the device sends its next request when it
hears its last. Each request's time is its device's, from sending to hearing the last token.
Pure Python, no torch, seeded.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from ..server.budget import draft_budget
from .hardware import DeviceProfile

__all__ = ["StreamResult", "Streaming", "simulate_streaming"]


@dataclass
class _Stream:
    right: list[bool]  # per generated position: whether the device's guess there is right
    tokens: int  # tokens the request asks for
    prefill: float = 0.0  # seconds the server takes to read its prompt (`requests`)
    active: bool = True  # its row is in the server's steps (or was, once `committed` reaches `tokens`)
    sent: float = 0.0  # when its device sent it
    committed: int = 0  # tokens the server has committed
    unread: int = 0  # prompt tokens the server has yet to read
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
    device_ms_per_token: tuple[float, ...] = ()  # each device's, its request's time over its tokens

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


FIRST_BUDGET = 4  # a device's budget before the server says one (targets/remote_stream.py's)


@dataclass(frozen=True)
class Streaming:
    """One streaming scenario (see the module doc): `devices` streams of `tokens` tokens each, all
    starting at once, `rtt_ms` apart from the server; each device's guess right with probability
    `acceptance`; the server takes up to `budget` proposed tokens a row and step; a device drafts
    `first` tokens at a time; `shared_cpu`: every device on one CPU; `ttft_s`: each request's time
    to its first token; `seed`: the guesses' random seed; `server_costs`: the server's own step costs
    ((tokens, seconds) pairs, as server/budget.py reads them): where given, each step takes from a
    row at most the draft budget the server computes from them for that step's rows (`draft_budget`
    at `acceptance`, `budget` its ceiling), as a server does under load."""

    rtt_ms: float
    devices: int = 1
    acceptance: float = 0.7
    budget: int = 6
    tokens: int = 128
    first: int = 3
    shared_cpu: bool = False
    seed: int = 0
    ttft_s: float = 0.0
    prompt: int = 0
    chunk: int = 0
    requests: tuple[tuple[int, float], ...] = ()
    server_costs: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if (
            self.devices < 1
            or self.tokens < 1
            or self.budget < 0
            or self.first < 1
            or not 0 <= self.acceptance <= 1
            or self.rtt_ms < 0
            or self.ttft_s < 0
            or self.prompt < 0
            or self.chunk < 0
        ):
            raise ValueError(
                "need devices, tokens, first >= 1, budget >= 0, 0 <= acceptance <= 1, rtt_ms, ttft_s >= 0; "
                f"got {self.devices}, {self.tokens}, {self.first}, {self.budget}, {self.acceptance}, "
                f"{self.rtt_ms}, {self.ttft_s}"
            )
        if any(n < 1 or t < 0 for n, t in self.requests):
            raise ValueError(f"every request needs tokens >= 1 and a prompt's read >= 0 s: {self.requests}")


def simulate_streaming(
    server: DeviceProfile,
    device: DeviceProfile,
    step_ms: Callable[[int, int], float] | None = None,
    **scenario: Any,
) -> StreamResult:
    """The scenario (`Streaming`'s fields as keywords: rtt_ms, devices, acceptance, budget, tokens,
    first, shared_cpu, seed, ttft_s) simulated event by event (see the module doc). `step_ms(rows,
    tokens)`: a server step's cost by its rows and all their tokens (a batched step profile,
    capacity.py); by default `server.target_cost(tokens)`, a step as costly as one sequence that long."""
    return _Simulation(server, device, Streaming(**scenario), step_ms).run()


class _Simulation:
    """The event queue of one scenario: proposals arriving at the server, devices hearing tokens."""

    def __init__(
        self,
        server: DeviceProfile,
        device: DeviceProfile,
        sc: Streaming,
        step_ms: Callable[[int, int], float] | None = None,
    ) -> None:
        self.server, self.device, self.sc = server, device, sc
        self.step_ms = step_ms or (lambda rows, tokens: server.target_cost(tokens))
        rng = random.Random(sc.seed)
        asked = sc.requests or tuple((sc.tokens, 0.0) for _ in range(sc.devices))  # (ttft_s: added after)
        self.streams = [
            _Stream([rng.random() < sc.acceptance for _ in range(n + 64)], n, t, active=not sc.requests)
            for n, t in asked
        ]
        self.queue = [list(range(d, len(asked), sc.devices)) for d in range(sc.devices)]
        self.reading: list[int] = []  # requests at the server whose prompts it has yet to read
        self.half, self.order = sc.rtt_ms / 2000, 0
        self.events: list[tuple[float, int, str, int, tuple[int, int]]] = []
        self.cpu_free = [0.0] * (1 if sc.shared_cpu else sc.devices)  # when each device CPU is next free
        # the budget the server last said (a device drafts ahead by it; before a step says one, its first)
        self.advertised = min(FIRST_BUDGET, sc.budget) if sc.server_costs else sc.budget
        self.server_costs = dict(sc.server_costs)  # (as draft_budget reads them, at every step)

    def push(self, when: float, kind: str, i: int, data: tuple[int, int] = (0, 0)) -> None:
        heapq.heappush(self.events, (when, self.order, kind, i, data))
        self.order += 1

    def draft(self, i: int, now: float) -> None:
        """Device i drafts on (or starts over) after what it heard; each piece is sent when drafted."""
        s, sc = self.streams[i], self.sc
        ahead = min(3 * self.advertised + 2, s.tokens - s.heard)
        fresh = s.heard > s.at + s.length or (s.heard > s.at and not all(s.right[s.at : s.heard]))
        if fresh or s.length == 0:
            s.at, s.length = s.heard, 0
        cpu = 0 if sc.shared_cpu else i % sc.devices
        start = max(now, self.cpu_free[cpu])
        while s.at + s.length - s.heard < ahead:
            n = min(sc.first, ahead - (s.at + s.length - s.heard))
            start += self.device.draft_cost(n, s.heard) / 1000
            s.length += n
            self.push(start + self.half, "arrive", i, (s.at, s.length))
        self.cpu_free[cpu] = start

    def deliver(self, now: float) -> None:
        """Proposals that arrived before a step starting at `now`; devices that heard their tokens
        draft on."""
        while self.events and self.events[0][0] <= now:
            when, _, kind, i, data = heapq.heappop(self.events)
            s = self.streams[i]
            if kind == "arrive":
                s.arrived.append(data)
            elif kind == "send":
                s.sent = when
                self.push(when + self.half, "join", i)
            elif kind == "join":  # at the server: read between two steps
                self.reading.append(i)
            else:
                s.heard = data[0]
                if s.committed >= s.tokens and s.heard >= s.tokens:
                    self.next_request(i, when)
                else:
                    self.draft(i, when)

    def next_request(self, i: int, now: float) -> None:
        """Request i's device heard its last token: it sends its next request (`requests`)."""
        queue = self.queue[i % self.sc.devices]
        if self.sc.requests and queue and queue[0] == i:
            queue.pop(0)
            if queue:
                self.push(now, "send", queue[0])

    def plan(self) -> list[tuple[int, int]]:
        """(stream, proposed tokens it verifies) of each running stream's row in the next step."""
        plan, sc = [], self.sc
        running = [i for i, s in enumerate(self.streams) if s.active and s.committed < s.tokens]
        cap = sc.budget
        if self.server_costs and cap:
            cap = draft_budget(self.server_costs, sc.acceptance, max(1, len(running)), cap)
            self.advertised = cap
        for i in running:
            s = self.streams[i]
            given = 0
            for at, length in reversed(s.arrived):
                given = _continues(s, at, length)
                if given:
                    break
            plan.append((i, min(given, cap, s.tokens - s.committed - 1)))
        return plan

    def run(self) -> StreamResult:
        sc, streams = self.sc, self.streams
        if sc.requests:
            for queue in self.queue:
                if queue:
                    self.push(0.0, "send", queue[0])
        else:
            for i in range(sc.devices):
                self.draft(i, 0.0)
            for s in streams:
                s.unread = sc.prompt
        now, steps, committed = 0.0, 0, 0
        while any(s.committed < s.tokens for s in streams):
            self.deliver(now)
            if self.reading:  # a prompt read: every row waits; it gives the request's first token
                i = self.reading.pop(0)
                s = streams[i]
                now += s.prefill
                s.active, s.committed = True, 1
                s.done_s = now if s.tokens == 1 else 0.0
                self.push(now + self.half, "hear", i, (1, 0))
                continue
            plan = self.plan()
            if not plan:  # every running request is waiting for its first token: idle until the next event
                now = self.events[0][0]
                continue
            reading = {i: min(streams[i].unread, sc.chunk or streams[i].unread) for i, _ in plan}
            fed = sum(reading[i] if streams[i].unread else 1 + given for i, given in plan)
            now += self.step_ms(len(plan), fed) / 1000
            steps += 1
            for i, given in plan:
                s = streams[i]
                if s.unread:  # a piece of the prompt; its last piece gives the first token
                    s.unread -= reading[i]
                    if s.unread:
                        continue
                    given = 0
                ok = next((j for j in range(given) if not s.right[s.committed + j]), given)
                new = min(ok + 1, s.tokens - s.committed)
                s.committed += new
                committed += new
                s.steps += 1
                if s.committed >= s.tokens:
                    s.done_s = now
                self.push(now + self.half, "hear", i, (s.committed, 0))
        return self.result(now, steps, committed)

    def result(self, now: float, steps: int, committed: int) -> StreamResult:
        sc, streams = self.sc, self.streams
        if sc.requests:  # each request from its sending to its device hearing the last token
            seconds = [s.done_s + self.half - s.sent for s in streams]
            wall = max(s.done_s for s in streams) + self.half
            committed = sum(s.tokens for s in streams)  # each first token too (the prompt's read gave it)
            mean = committed / len(streams)
            read = sum(t for _, t in sc.requests) / len(streams)
            alone_s = 2 * self.half + read + mean * self.step_ms(sc.devices, sc.devices) / 1000
            return StreamResult(
                device_tok_s=sum(s.tokens / t for s, t in zip(streams, seconds)) / len(streams),
                server_tok_s=committed / wall,
                steps_per_token=sum(s.steps for s in streams) / committed,
                alone_tok_s=sc.devices * mean / alone_s,
                device_ms_per_token=tuple(1000 * t / s.tokens for s, t in zip(streams, seconds)),
            )
        alone_s = sc.ttft_s + sc.tokens * self.step_ms(sc.devices, sc.devices) / 1000
        return StreamResult(
            device_tok_s=sum(sc.tokens / (sc.ttft_s + s.done_s) for s in streams) / sc.devices,
            server_tok_s=committed / (sc.ttft_s + now),
            steps_per_token=steps * sc.devices / committed,
            alone_tok_s=sc.devices * sc.tokens / alone_s,
            device_ms_per_token=tuple(1000 * (sc.ttft_s + s.done_s) / sc.tokens for s in streams),
        )
