"""The floor: a request is never slower than its target decoding alone, beyond a bounded share
spent exploring. Pure arithmetic over measured times; no model, no target.

Every round of a request is booked against what the engine alone would have taken for the tokens
the round committed (`step` seconds a token, the engine's own decoding step as measured). The
request's `Ledger` sums the difference: `saved` grows with rounds that paid and shrinks with rounds
that lost. A round may propose only what the balance covers if all of it is rejected: its worst
case (drafting, then verifying the proposal, to commit a single token) less one step must not exceed
`saved` plus the allowance, a share `explore` of the request's time alone so far (the target's
read of the prompt where its session times it, and a step for each token committed; at least
`horizon` tokens, so the first rounds may probe). So a request's time is at most (1 + `explore`)
times its time alone, whatever its drafts do and wherever its reply ends, and a request whose drafts
lose stops drafting as soon as the balance is spent: the target then decodes alone, and drafting
comes back only as the allowance grows with the tokens decoded (a probe, whose cost is bounded too).

What this is not: the draft-length policy (policy.py) or the cost model (costs.py), which choose
the best round; the floor only caps what a round may risk. `Floor` is the pairing's prior across
requests: the engine's step as last measured, and how much exploring the last requests earned
(a request whose drafts lost halves the next one's allowance; one whose drafts paid restores it,
and one that drafted nothing doubles it back: a pairing that lost a few requests in a row would
otherwise never draft again, whatever its later requests could gain).
It holds under the latency objective; `objective="compute"` always speculates (fewer target
forwards a token, whatever the wall time), so its pairings are not floored.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Floor", "FloorKnobs", "Ledger"]


class Costs(Protocol):
    """What the floor reads of a pairing's cost model (adaptive/costs.py)."""

    @property
    def draft(self) -> float | None: ...

    @property
    def overhead(self) -> float: ...

    def verify_cost(self, m: int) -> float: ...


@dataclass(frozen=True, kw_only=True)
class FloorKnobs:
    """`explore`: the share of a request's time alone that its drafts may lose; `horizon`: the
    tokens that share is counted over before the request has produced as many (so its first rounds
    may probe; a reply that ends sooner may lose that much more, docs/floor.md); `aside`: tokens
    the target decodes alone, in one go, each time the balance cannot cover a draft; `least`: the
    smallest share of `explore` that losing requests bring it to; `recent`: a round is booked
    against the least step of the last `recent` stretches the request decoded alone (a step that
    moves, as a loaded machine's does, books no gain a quieter step would not have given; a
    context that grows moves it on within a few stretches)."""

    explore: float = 0.02
    horizon: int = 16
    aside: int = 16
    least: float = 1 / 16
    recent: int = 3

    def __post_init__(self) -> None:
        if not 0.0 <= self.explore < 1.0:
            raise ValueError(f"explore must be in [0, 1), got {self.explore}")
        if self.horizon < 1 or self.aside < 1 or self.recent < 1:
            raise ValueError(
                f"horizon, aside and recent must be >= 1, got {self.horizon}, {self.aside} and {self.recent}"
            )
        if not 0.0 < self.least <= 1.0:
            raise ValueError(f"least must be in (0, 1], got {self.least}")


class Ledger:
    """One request's account against its target decoding alone (see the module docstring).
    `step`: seconds a token alone, as measured before the request (None: not yet); `on`: False
    books nothing and caps nothing (a pairing whose objective is not latency)."""

    def __init__(self, knobs: FloorKnobs, explore: float, step: float | None, *, on: bool = True) -> None:
        self.knobs, self.explore, self.step, self.on = knobs, explore, step, on
        self.saved = 0.0  # seconds the request's rounds gained over the target alone (< 0: lost)
        self.drafted = 0.0  # the part of `saved` booked by rounds that proposed something
        self.tokens = 0  # tokens the booked rounds committed
        self.aside = False  # the balance could not cover the last round's draft
        self.measured = False  # `step` is this request's decoding alone, not an estimate
        self.read: float | None = None  # seconds the drafter takes to read a token it has not seen
        self.unread = 0  # committed tokens the drafter has not read yet (the prompt, to begin with)
        self.proposed = False  # the last round booked proposed tokens
        self.prefill = 0.0  # seconds the target took to read the prompt, where its session timed it
        self.stretches: deque[float] = deque(maxlen=self.knobs.recent)  # the recent stretches' steps

    def seen(self, step: float) -> None:
        """A newer estimate of the step (the cost model's one-token verify), kept until decoding
        alone is measured in this request."""
        if not self.measured and step > 0:
            self.step = step

    def allowance(self, remaining: int) -> float:
        """Seconds exploring may still lose, with `remaining` tokens to go at most: a share of the
        request's time alone so far, not of what it may still produce (a reply may end at its next
        token), and of `horizon` tokens before it has produced as many."""
        if self.step is None:
            return 0.0
        counted = max(self.tokens, min(self.tokens + remaining, self.knobs.horizon))
        return self.explore * (self.prefill + self.step * counted)

    def balance(self, remaining: int) -> float:
        return self.saved + self.allowance(remaining)

    def book(self, committed: int, seconds: float, proposed: bool, *, drafted: bool = False) -> None:
        """A round (`proposed`: it proposed tokens; `drafted`: the drafter model drafted them, having
        read every committed token) committed `committed` tokens in `seconds` (0: a first round
        whose one token the prompt's read gave, booked for what it spent past that)."""
        self.unread = 0 if drafted else self.unread + committed
        if self.step is None or committed < 0:
            return
        gained = committed * self.step - seconds
        self.saved += gained
        self.tokens += committed
        self.proposed = proposed
        if proposed:
            self.drafted += gained

    def charge(self, seconds: float) -> None:
        """Time drafting took that the target alone never spends (the drafter reading the prompt)."""
        if self.on and self.step is not None:
            self.saved -= seconds
            self.drafted -= seconds

    def alone(self, committed: int, seconds: float | None, first: float | None = None) -> None:
        """The target decoded `committed` tokens alone in `seconds`: the step as measured now (None:
        the stretch also read the prompt, so it measures no step). `first`: its first token's
        seconds, apart: after a round that proposed, the engine's first one-token step costs more
        (it had verified a longer shape, or trimmed its state), and that excess over the step is the
        drafts' cost, booked to them; the step is measured from the other tokens."""
        if committed < 1 or (seconds is not None and seconds <= 0):
            return
        if seconds is not None and first is not None and committed > 1 and 0 < first < seconds:
            step = self._measured((seconds - first) / (committed - 1))
            if self.proposed and self.on:
                excess = max(0.0, first - step)
                self.saved -= excess
                self.drafted -= excess
        elif seconds is not None:
            self._measured(seconds / committed)
        self.proposed = False
        self.unread += committed
        self.tokens += committed  # booked at exactly its own step: no gain, no loss

    def _measured(self, step: float) -> float:
        """A stretch decoded alone took `step` a token: the step is now the least of the recent ones
        (returned)."""
        self.stretches.append(step)
        self.step, self.measured = min(self.stretches), True
        return self.step

    def cap(self, costs: Costs, k: int, limit: int, remaining: int) -> tuple[int, int]:
        """(k, limit): the model draft length and proposal limit whose worst case the balance
        covers, from the costs measured so far. (0, 0): no draft this round."""
        if limit <= 0 or self.step is None or not self.on:
            self.aside = False
            return k, limit
        covered = self.balance(remaining)
        model = self._longest(costs, k, limit, covered) if k else 0
        if model:
            self.aside = False
            return min(k, model), model
        free = self._longest(costs, 0, limit, covered)  # retrieved tokens alone: no drafter forward
        self.aside = free == 0
        return 0, free

    def _longest(self, costs: Costs, k: int, limit: int, covered: float) -> int:
        m = limit
        while m > 0 and self.worst(costs, m, min(k, m)) > covered:
            m -= 1
        return m

    def worst(self, costs: Costs, m: int, k: int) -> float:
        """What a round drafting `k` tokens into a proposal of `m` loses if none is accepted: it
        commits one token, which alone would have cost one step. A model draft first reads what
        the drafter has not seen."""
        reading = self.unread * (self.read or 0.0)
        drafting = reading + costs.overhead + k * (costs.draft or 0.0) if k else 0.0
        try:
            verify = costs.verify_cost(m + 1)
        except ValueError:  # nothing measured yet: a verify costing a step a token, the worst kind
            verify = (m + 1) * (self.step or 0.0)
        return drafting + verify - (self.step or 0.0)


class Floor:
    """A pairing's floor across its requests: one `Ledger` per request, begun from the engine's step
    as last measured and the allowance the last requests earned. Mutable: one per pairing."""

    def __init__(self, knobs: FloorKnobs | None = None, *, on: bool = True) -> None:
        self.knobs, self.on = knobs or FloorKnobs(), on
        self.step: float | None = None  # seconds a token alone, as last measured
        self.scale = 1.0  # the share of `explore` the next request may lose
        self.read: float | None = None  # seconds the drafter reads a token in, as last measured

    def begin(self, step: float | None, unread: int = 0) -> Ledger:
        """A new request's ledger; `step`: the cost model's one-token verify, used where no decoding
        alone has been measured yet; `unread`: the drafter's prompt tokens."""
        ledger = Ledger(self.knobs, self.knobs.explore * self.scale, self.step or step, on=self.on)
        ledger.measured, ledger.read, ledger.unread = self.step is not None, self.read, unread
        return ledger

    def read_prompt(self, ledger: Ledger, tokens: int, seconds: float) -> None:
        """The drafter read a prompt of `tokens` in `seconds` (a request's first draft): charged to
        the request, and the per-token estimate later model drafts are capped by."""
        ledger.charge(seconds)
        if tokens > 0 and seconds > 0:
            self.read = ledger.read = seconds / tokens

    def end(self, ledger: Ledger) -> None:
        """A finished request: its measured step is kept, and its drafts' result sets the next
        request's allowance (halved after a loss, restored after a gain)."""
        if ledger.measured:
            self.step = ledger.step
        if ledger.drafted < 0:
            self.scale = max(self.knobs.least, self.scale / 2)
        elif ledger.drafted > 0:
            self.scale = 1.0
        else:  # it drafted nothing: the next may probe more (else a few losses would end drafting)
            self.scale = min(1.0, self.scale * 2)
