"""Draft-length policies for a pairing with no trained acceptance head. `CostPolicy` (the default)
chooses k from measured costs and acceptance. `Hysteresis` moves k with the observed acceptance:
grow slowly after a fully accepted draft, shrink at once after a rejection,
so a new pairing is never stuck at a draft length that the target keeps cutting. Pure arithmetic.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from .costs import CostModel

__all__ = [
    "Acceptance",
    "CostPolicy",
    "Hysteresis",
    "ServingChooser",
    "BestSpeedup",
    "PolicyKnobs",
    "committed",
    "best_speedup",
]


@dataclass(frozen=True, kw_only=True)
class Hysteresis:
    """k in [k_min, k_max]; +`grow` after full acceptance; after n of m accepted, at most n + 1."""

    k_min: int = 2
    k_max: int = 16
    grow: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got k_min={self.k_min}, k_max={self.k_max}")
        if self.grow < 1:
            raise ValueError(f"grow must be >= 1, got {self.grow}")

    def next_k(self, k: int, proposed: int, accepted: int) -> int:
        """Draft length for the next round after `accepted` of `proposed` target tokens were accepted."""
        if proposed == 0:
            return k
        if accepted >= proposed:
            return min(self.k_max, k + self.grow)
        return max(self.k_min, min(k, accepted + 1))


@dataclass(frozen=True)
class BestSpeedup:
    """What drafting could gain at best, from a target's measured verify costs, before any request:
    the highest expected speedup over decoding alone of drafts that cost nothing (retrieval) and
    of model drafts (the drafter's cost per token added), at an optimistic per-token acceptance.
    A kind of draft is used only when its gain reaches `need`; where neither does, the pairing
    decodes with the target alone and never probes (`best_speedup` says why)."""

    free: float
    model: float
    verify: dict[int, float]  # seconds to verify n tokens, as measured
    draft: float  # seconds per drafted token
    acceptance: float
    need: float

    @property
    def steps(self) -> dict[int, float]:
        """Verifying n tokens, in units of one decoding step."""
        return {n: v / self.verify[1] for n, v in self.verify.items()}

    @property
    def draft_steps(self) -> float:
        """A drafted token, in units of one decoding step."""
        return self.draft / self.verify[1]

    @property
    def free_pays(self) -> bool:
        return self.free >= self.need

    @property
    def model_pays(self) -> bool:
        return self.model >= self.need

    def reason(self) -> str:
        curve = ", ".join(f"{n}: {s:.2f}" for n, s in sorted(self.steps.items()))
        return (
            f"verifying n tokens costs [{curve}] decoding steps and a drafted token {self.draft_steps:.2f}; "
            f"at {self.acceptance:.0%} acceptance the best draft would give {self.model:.2f}x (model "
            "drafts), "
            f"{self.free:.2f}x (free retrieved drafts); drafting needs {self.need:.2f}x"
        )


def best_speedup(
    verify: dict[int, float], draft: float, *, acceptance: float = 0.9, need: float = 1.2
) -> BestSpeedup:
    """The BestSpeedup of a target whose verify of n tokens costs `verify[n]` seconds (n = 1 included)
    with a drafter whose drafted token costs `draft` seconds. A draft of n - 1 tokens commits
    E(n) = (1 - a^n) / (1 - a) tokens in V(n) + (n - 1) c_d; decoding alone, E(n) V(1)."""
    if 1 not in verify or verify[1] <= 0:
        raise ValueError(f"verify costs must include a positive cost for one token, got {verify}")
    if not 0 < acceptance < 1:
        raise ValueError(f"acceptance must be in (0, 1), got {acceptance}")
    one, a = verify[1], acceptance

    def best(c: float) -> float:
        return max(((1 - a**n) / (1 - a)) * one / (v + (n - 1) * c) for n, v in verify.items() if n > 1)

    return BestSpeedup(
        free=best(0.0), model=best(draft), verify=dict(verify), draft=draft, acceptance=a, need=need
    )


def ema(old: float | None, new: float, decay: float) -> float:
    """Exponential moving average: `new` itself when there is no `old` yet."""
    return new if old is None else decay * old + (1 - decay) * new


def committed(first: float, then: float, m: float) -> float:
    """Committed tokens of a round that proposes m tokens (the target's own included), the first
    accepted with probability `first` and each after it with `then` (< 1) while none is rejected."""
    return 1.0 + first * (1 - then**m) / (1 - then) if m > 0 else 1.0


class Acceptance:
    """How a drafter's proposals fare over drafting rounds: `first`, how often a round's first
    proposed token is accepted, and `then`, the per-token acceptance after it (accepted tokens over
    trials, a rejection ending a trial). A draft that starts right tends to go on right, so its later
    tokens are accepted more often than its first: one per-token rate for both undervalues longer
    drafts and, with a cheap verify, settles on one-token drafts that measure only the hardest
    position. Each is a ratio of sums in which a round weighs `decay` times less per round after
    it (so a slow average is not held near its first round's value)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.rounds = self.hits = self.kept = self.tried = 0.0  # decayed sums

    @property
    def first(self) -> float:
        return self.hits / self.rounds if self.rounds else 0.0

    @property
    def then(self) -> float:
        """Per-token acceptance after the first (the first's until measured), below 1."""
        return min(0.99, self.kept / self.tried if self.tried else self.first)

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed < 1:
            return
        d = self.decay
        self.rounds, self.hits = d * self.rounds + 1, d * self.hits + (accepted > 0)
        self.kept, self.tried = d * self.kept, d * self.tried
        if accepted > 0 and proposed > 1:
            self.kept += accepted - 1
            self.tried += accepted - 1 + (accepted < proposed)

    def expected(self, m: float) -> float:
        """Committed tokens of a round that proposes m target tokens (the target's own included)."""
        return committed(self.first, self.then, m)

    def assume(self, other: Acceptance, rounds: float = 2.0) -> None:
        """Start again from `other`'s averages, weighted as `rounds` rounds of this one's."""
        scale = rounds / other.rounds if other.rounds else 0.0
        self.rounds, self.hits = other.rounds * scale, other.hits * scale
        self.kept, self.tried = other.kept * scale, other.tried * scale


@dataclass(frozen=True)
class PolicyKnobs:
    """The cost policy's knobs (see `CostPolicy`): drafts of up to `k_max` tokens, `start` before
    costs are measured; a probe every `probe_every` idle rounds, waiting up to `max_wait`; EMA
    `decay` per round (`long_decay` for the long run a request starts from); k = 0 only when faster
    by `margin`; each request's first `fresh` rounds draft."""

    k_max: int = 12
    start: int = 6
    probe_every: int = 8
    decay: float = 0.8
    margin: float = 0.2
    max_wait: int = 256
    fresh: int = 2
    long_decay: float = 0.99

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.k_max:
            raise ValueError(f"need 1 <= start <= k_max, got start={self.start}, k_max={self.k_max}")
        decays = 0.0 <= self.decay < 1.0 and 0.0 <= self.long_decay < 1.0
        if self.probe_every < 1 or not decays or self.margin < 0:
            raise ValueError(
                f"need probe_every >= 1, 0 <= decay, long_decay < 1 and margin >= 0, got {self.probe_every}, "
                f"{self.decay}, {self.long_decay} and {self.margin}"
            )


class CostPolicy:
    """The draft length that maximises committed tokens per second, from the pairing's measured
    costs (`CostModel`) and its observed acceptance; 0 means "do not speculate this round".

    With first-token acceptance a1, per-token acceptance after it a (`Acceptance`) and r target
    tokens per drafted token, a draft of k drafter tokens commits E(k) = 1 + a1 sum_{j=0..rk-1} a^j
    tokens in o + k c_d + V(rk + 1) seconds (overhead, marginal drafter step, verifying rk tokens
    plus the pending one); k = 0 commits one token in V(1) + o_0 (the round's cost beyond
    drafting). The policy takes the k in [1, k_max] of highest rate unless k = 0 is faster by more
    than `margin` (a knife-edge call on noisy timings would otherwise flip to not drafting and stay
    there). Acceptance depends on the prompt: each request starts from the pairing's long-run
    acceptance (averages over about a hundred drafting rounds, not where the last request ended:
    one hard stretch would otherwise keep every later request from drafting) and drafts its first
    `fresh` rounds. So a pairing whose drafter cannot pay decodes with the target alone, and tries
    a draft again after `probe_every` rounds (costs and acceptance drift), waiting twice as long
    after each probe that did not pay (up to `max_wait` rounds), so a pairing that never pays loses
    little to probing. Until the costs are measured it drafts `start` tokens, then decodes one
    round alone to measure V(1). Mutable: one per pairing.
    """

    def __init__(self, cost: CostModel, *, may_idle: bool = True, **knobs: Any) -> None:
        """`knobs`: `PolicyKnobs`' fields (k_max, start, probe_every, decay, margin, max_wait,
        fresh, long_decay). `may_idle`: False never chooses k = 0 (a ServingChooser then decides per
        request whether to draft)."""
        k = PolicyKnobs(**knobs)
        self.cost, self.k_max, self.start, self.probe_every, self.decay = (
            cost,
            k.k_max,
            k.start,
            k.probe_every,
            k.decay,
        )
        self.margin, self.max_wait = k.margin, max(k.max_wait, k.probe_every)
        self.wait = k.probe_every  # idle rounds before the next probe
        self.fresh, self.fresh_left = k.fresh, 0  # rounds each request drafts before the policy may idle
        self.may_idle = may_idle  # False: never k = 0 (a ServingChooser decides per request whether to draft)
        # EMAs per drafting round: this request's, and the pairing's long run a new request starts from
        self.seen, self.long_run = Acceptance(k.decay), Acceptance(k.long_decay)
        self.ratio: float | None = None
        self.idle = 0  # rounds since the last draft
        self.last_rates: dict[int, float] = {}

    def _ema(self, old: float | None, new: float) -> float:
        return ema(old, new, self.decay)

    def begin_request(self) -> None:
        """A new request: acceptance depends on the prompt, so it starts from the long-run averages
        and drafts its first `fresh` rounds (measured again) before the policy may decide to decode
        with the target alone."""
        self.idle, self.wait, self.fresh_left = 0, self.probe_every, self.fresh
        self.seen.assume(self.long_run)  # (both see every round: none yet leaves both empty)

    def observe(self, drafted: int, proposed: int, accepted: int) -> None:
        """One finished round: `drafted` drafter tokens became `proposed` target tokens, `accepted` kept."""
        if drafted == 0:
            self.idle += 1
            return
        if self.idle:  # a probe: if drafting still does not pay, wait longer before the next
            self.wait = min(2 * self.wait, self.max_wait)
        self.idle = 0
        self.seen.observe(proposed, accepted)
        self.long_run.observe(proposed, accepted)
        self.ratio = self._ema(self.ratio, proposed / drafted)

    def expected_tokens(self, k: int) -> float:
        """E(k): committed tokens of a round that drafts k drafter tokens."""
        return self.seen.expected(self.ratio * k if self.ratio else 0.0)

    def round_seconds(self, k: int) -> float:
        c = self.cost
        if k == 0:
            return c.verify_cost(1) + c.other
        ratio, draft = self.ratio or 1.0, c.draft or 0.0  # (both measured before rates are asked)
        return c.overhead + k * draft + c.verify_cost(max(1, round(ratio * k)) + 1)

    def rates(self) -> dict[int, float]:
        """Expected committed tokens per second for every k in [0, k_max]."""
        return {k: self.expected_tokens(k) / self.round_seconds(k) for k in range(self.k_max + 1)}

    def next_k(self) -> int:
        if self.ratio is None or not self.cost.ready or self.cost.draft is None:
            return self.start
        if (
            self.may_idle and 1 not in self.cost.verify
        ):  # one round alone measures V(1); extrapolated, it runs high
            return 0
        self.last_rates = self.rates()
        best = max(range(1, self.k_max + 1), key=self.last_rates.__getitem__)
        if self.fresh_left > 0:
            self.fresh_left -= 1
            return best
        if self.speculating:
            self.wait = self.probe_every
            return best
        return best if self.idle >= self.wait else 0  # time to look again, or the target alone

    @property
    def speculating(self) -> bool:
        """Whether the measured costs say drafting pays (True until they are measured): False only
        when the target alone is faster than the best draft length by more than `margin`."""
        if not self.last_rates or not self.may_idle:
            return True
        return self.last_rates[0] <= (1 + self.margin) * max(v for k, v in self.last_rates.items() if k > 0)


class ServingChooser:
    """Per request: speculate, or let the target decode alone (a remote target: the server generates
    the whole completion), whichever has measured more committed tokens per second. Each way is
    tried once first; afterwards the slower one is tried again after `probe_every` requests, and
    after twice as many each time a probe confirms the faster one (up to `max_interval`): prompts,
    load and the network drift, but a settled choice should cost little. A probe of a way that
    measured a share g slower costs about g of one request, so probes also wait g / `probe_cost`
    requests: ways far apart are probed rarely (the faster one is re-measured by every request it
    serves, so its slowing down narrows the gap and brings the probe closer). Mutable: one per pairing."""

    MODES = ("speculate", "alone")

    def __init__(
        self, *, probe_every: int = 8, decay: float = 0.7, max_interval: int = 64, probe_cost: float = 0.02
    ) -> None:
        if probe_every < 2 or not 0.0 <= decay < 1.0 or probe_cost <= 0:
            raise ValueError(
                f"need probe_every >= 2, 0 <= decay < 1 and probe_cost > 0, got {probe_every}, {decay} "
                f"and {probe_cost}"
            )
        self.probe_every, self.decay, self.max_interval = probe_every, decay, max(max_interval, probe_every)
        self.probe_cost = probe_cost  # the share of throughput probing may cost
        self.rates: dict[str, float | None] = {m: None for m in self.MODES}
        self.interval, self.since_probe = probe_every, 0
        self.probing: str | None = None  # the mode a probe request is measuring

    def _measured(self) -> dict[str, float]:
        return {m: r for m, r in self.rates.items() if r is not None}

    def best(self) -> str:
        """The mode measured faster (the first mode while none is measured)."""
        measured = self._measured()
        return max(measured, key=measured.__getitem__) if measured else self.MODES[0]

    def __repr__(self) -> str:
        rates = ", ".join(
            f"{m} {'untried' if r is None else f'{r:.2f} tok/s'}" for m, r in self.rates.items()
        )
        return f"ServingChooser({rates})"

    def choose(self) -> str:
        for mode in self.MODES:
            if self.rates[mode] is None:
                return mode
        self.since_probe += 1
        rates = self._measured().values()
        gap = 1.0 - min(rates) / max(rates)  # how much slower the other mode measured
        if self.since_probe >= max(self.interval, math.ceil(gap / self.probe_cost)):
            self.since_probe = 0
            self.probing = self.MODES[1 - self.MODES.index(self.best())]
            return self.probing
        return self.best()

    def observe(self, mode: str, tokens: int, seconds: float, *, label: str | None = None) -> None:
        """A request served in `mode` committed `tokens` in `seconds`; with `label` (the pairing's
        name), a change of the faster mode is logged."""
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        if tokens < 1 or seconds <= 0:
            return
        was = self.speculating
        before = self.best() if None not in self.rates.values() else None
        rate, old = tokens / seconds, self.rates[mode]
        self.rates[mode] = ema(old, rate, self.decay)
        if self.probing == mode:  # a probe: confirmed, probe half as often; overturned, probe soon again
            self.probing = None
            self.interval = (
                min(2 * self.interval, self.max_interval) if self.best() == before else self.probe_every
            )
        if label is not None and self.speculating != was:
            logging.getLogger("omnidraft.pairing").info(
                "%s: %s (measured %s)",
                label,
                "speculating is faster again"
                if self.speculating
                else "the target alone is faster here; requests decode without drafts (re-measured now and "
                "then)",
                ", ".join(f"{m} {r:.1f} tok/s" for m, r in self.rates.items() if r is not None),
            )

    @property
    def speculating(self) -> bool:
        """Whether speculating is (so far) the faster mode."""
        s, a = self.rates["speculate"], self.rates["alone"]
        return s is None or a is None or s >= a
