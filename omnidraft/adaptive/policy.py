"""Draft-length policies for a pairing with no trained acceptance head. `CostPolicy` (the default)
chooses k from measured costs and acceptance. `Hysteresis` moves k with the observed acceptance:
grow slowly after a fully accepted draft, shrink at once after a rejection,
so a new pairing is never stuck at a draft length that the target keeps cutting. Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CostPolicy", "Hysteresis"]


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


class CostPolicy:
    """The draft length that maximises committed tokens per second, from the pairing's measured
    costs (`CostModel`) and its observed acceptance; 0 means "do not speculate this round".

    With per-token acceptance a (accepted / trials, a rejection ending a trial) and r target tokens
    per drafted token, a draft of k drafter tokens commits E(k) = 1 + sum_{j=1..rk} a^j tokens in
    o + k c_d + V(rk + 1) seconds (overhead, marginal drafter step, verifying rk tokens plus the
    pending one); k = 0 commits one token in V(1) + o_0 (the round's cost beyond drafting). The
    policy takes the k in [0, k_max] of highest rate, so a pairing whose drafter cannot pay decodes
    with the target alone, and tries a draft again every `probe_every` rounds (costs and acceptance
    drift). Until the costs are measured it drafts `start` tokens. Mutable: one per pairing.
    """

    def __init__(self, cost: object, *, k_max: int = 12, start: int = 6, probe_every: int = 16,
                 decay: float = 0.9) -> None:
        if not 1 <= start <= k_max:
            raise ValueError(f"need 1 <= start <= k_max, got start={start}, k_max={k_max}")
        if probe_every < 1 or not 0.0 <= decay < 1.0:
            raise ValueError(f"need probe_every >= 1 and 0 <= decay < 1, got {probe_every} and {decay}")
        self.cost, self.k_max, self.start, self.probe_every, self.decay = cost, k_max, start, probe_every, decay
        self.accepted = self.trials = self.ratio = None  # EMAs per drafting round
        self.idle = 0  # rounds since the last draft
        self.last_rates: dict[int, float] = {}

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def observe(self, drafted: int, proposed: int, accepted: int) -> None:
        """One finished round: `drafted` drafter tokens became `proposed` target tokens, `accepted` kept."""
        if drafted == 0:
            self.idle += 1
            return
        self.idle = 0
        self.accepted = self._ema(self.accepted, accepted)
        self.trials = self._ema(self.trials, accepted + (accepted < proposed))
        self.ratio = self._ema(self.ratio, proposed / drafted)

    @property
    def acceptance(self) -> float:
        """Per-token acceptance a, below 1 so the geometric sums stay finite."""
        return min(0.99, self.accepted / self.trials) if self.trials else 0.0

    def expected_tokens(self, k: int) -> float:
        """E(k): committed tokens of a round that drafts k drafter tokens."""
        a, m = self.acceptance, self.ratio * k if self.ratio else 0.0
        return 1.0 + (a * (1 - a**m) / (1 - a) if a > 0 else 0.0)

    def round_seconds(self, k: int) -> float:
        c = self.cost
        if k == 0:
            return c.verify_cost(1) + c.other
        return c.overhead + k * c.draft + c.verify_cost(max(1, round(self.ratio * k)) + 1)

    def rates(self) -> dict[int, float]:
        """Expected committed tokens per second for every k in [0, k_max]."""
        return {k: self.expected_tokens(k) / self.round_seconds(k) for k in range(self.k_max + 1)}

    def next_k(self) -> int:
        if self.trials is None or not self.cost.ready or self.cost.draft is None:
            return self.start
        self.last_rates = self.rates()
        best = max(self.last_rates, key=self.last_rates.__getitem__)
        if best == 0 and self.idle >= self.probe_every:  # look again at the best draft
            return max(range(1, self.k_max + 1), key=self.last_rates.__getitem__)
        return best

    @property
    def speculating(self) -> bool:
        """Whether the measured costs say drafting pays (True until they are measured)."""
        if not self.last_rates:
            return True
        return max(self.last_rates, key=self.last_rates.__getitem__) > 0
