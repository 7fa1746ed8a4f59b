"""Acceptance head (OmniDraft §3.3, SpecDec++): when to stop drafting.

A small MLP per target reads, for each drafted token, the drafter's last hidden state at the
position that produced it plus four cheap features (draft position, drafter entropy, the token's
drafter probability, whether the token maps directly into the target's vocabulary) and predicts
p_j = P(token j accepted | tokens before it accepted). Its layers are distinct modules (SpecDec++'s
public code applies one block n times; this one does not).

The stopping rule is SpecDec++'s eq. (6)-(7): after drafting token n, stop when the probability that
at least one of the n tokens is rejected, 1 - prod_{j<=n} p_j, exceeds gamma; the draft length stays
within [k_min, k_max]. With a `CostModel` gamma is not a constant but comes from the measured costs
of a drafter step and of verifying m tokens (see `Stopper.threshold`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "CONFIDENCE_FEATURES",
    "EXTRA_FEATURES",
    "AcceptanceHead",
    "CostModel",
    "HeadConfig",
    "Stopper",
    "confidence_features",
    "token_features",
]

EXTRA_FEATURES = (
    4  # position / k_max, entropy (nats) / 10, drafter probability of the token, direct-mapped flag
)
CONFIDENCE_FEATURES = 5  # what the calibration path reads (see `confidence_features`)


@dataclass(frozen=True, kw_only=True)
class HeadConfig:
    """Shape, stopping rule and training of a pairing's acceptance head.

    `gamma`: stop once P(some drafted token is rejected) exceeds it; "cost" derives it per step from
    the pairing's live cost model. `k_min`/`k_max` bound the draft. `width`/`depth`: the MLP.
    `train`: "interleaved" (own replay buffer, OmniDraft Algorithm 4), "joint" (updated in step with
    the adapter on the newest rounds only, Algorithm 3) or None (frozen). `warmup`: labelled tokens
    seen before the head decides; until then the hysteresis fallback does. `steps` minibatches of
    `batch_size` rows per update: larger updates overfit the interleaved head (the measurements:
    docs/acceptance-heads.md).
    """

    gamma: float | str = "cost"
    k_min: int = 1
    k_max: int = 12
    width: int = 128
    depth: int = 2
    train: str | None = "interleaved"
    interval: int = 4
    lr: float = 1e-3
    batch_size: int = 64
    steps: int = 10
    capacity: int = 20000
    warmup: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.gamma == "cost" or (isinstance(self.gamma, float | int) and 0 < self.gamma < 1)):
            raise ValueError(f"gamma must be in (0, 1) or 'cost', got {self.gamma!r}")
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got k_min={self.k_min}, k_max={self.k_max}")
        if self.train not in (None, "interleaved", "joint"):
            raise ValueError(f"head train must be None, 'interleaved' or 'joint', got {self.train!r}")
        if self.width < 1 or self.depth < 1 or self.interval < 1 or self.steps < 0 or self.batch_size < 1:
            raise ValueError("head width, depth, interval, batch_size must be >= 1 and steps >= 0")


class AcceptanceHead(nn.Module):
    """Logit of acceptance = a logistic calibration of the drafter's own confidence (log q, log(1-q),
    entropy, position, direct flag) + an MLP over [hidden (d) ; extra (EXTRA_FEATURES)] with `depth`
    distinct hidden layers. The calibration starts as logit(q) and the MLP's output layer at zero, so
    an untrained head predicts the drafter's probability of its token; training corrects the
    calibration (six weights, learnt from a few hundred rows) and the MLP adds what the hidden
    state knows. The drafter's confidence is most of what predicts acceptance (measured in
    docs/acceptance-heads.md).

    `forward` gives the logit the class-weighted loss trains; `prob` gives the calibrated
    probability the stopping rule needs. Weighting positives by w+ and negatives by w- moves the
    loss's optimum from logit(p) to logit(p) + log(w+/w-), so the trainer stores that shift in the
    `prior_shift` buffer and `prob` takes it off (logit adjustment, Menon et al. 2021).
    """

    def __init__(self, hidden_size: int, width: int = 128, depth: int = 2, seed: int | None = None) -> None:
        """`seed` makes the initial weights reproducible (drawn from their own generator, so the
        caller's global random stream is not touched); None draws them as `nn.Linear` does."""
        super().__init__()
        self.hidden_size, self.width, self.depth = hidden_size, width, depth
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.norm = nn.LayerNorm(hidden_size)
        sizes = [hidden_size + EXTRA_FEATURES] + [width] * depth
        self.layers = nn.ModuleList(_linear(a, b, generator) for a, b in zip(sizes, sizes[1:]))
        self.out = _linear(width, 1, generator)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)
        self.calibration = nn.utils.skip_init(nn.Linear, CONFIDENCE_FEATURES, 1)  # set below, no random draw
        with torch.no_grad():
            self.calibration.weight.copy_(torch.tensor([[1.0, -1.0, 0.0, 0.0, 0.0]]))  # logit(q)
            self.calibration.bias.zero_()
        self.register_buffer("prior_shift", torch.zeros(()))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # heads saved before the shift existed were trained and used without it: load them as shift 0;
        # heads saved before the calibration path existed were the MLP alone: load it as zero
        state_dict.setdefault(prefix + "prior_shift", torch.zeros(()))
        state_dict.setdefault(prefix + "calibration.weight", torch.zeros(1, CONFIDENCE_FEATURES))
        state_dict.setdefault(prefix + "calibration.bias", torch.zeros(1))
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Logits (N,) from features (N, hidden_size + EXTRA_FEATURES)."""
        extra = features[:, self.hidden_size :]
        h = torch.cat([self.norm(features[:, : self.hidden_size]), extra], dim=-1)
        for layer in self.layers:
            h = nn.functional.silu(layer(h))
        return self.out(h).squeeze(-1) + self.calibration(confidence_features(extra)).squeeze(-1)

    def shift_prior(self, shift: float) -> None:
        """Set the class-weighting shift `prob` takes off, moving the logit by as much, so that the
        head's calibrated probabilities stay what they were: a new shift is a change of the loss's
        bookkeeping (the class weights), not of what the head knows."""
        with torch.no_grad():
            self.calibration.bias += shift - self.prior_shift
            self.prior_shift.fill_(shift)

    @torch.no_grad()
    def prob(self, features: torch.Tensor) -> torch.Tensor:
        """Calibrated P(accept) (N,): the trained logit minus the class-weighting shift."""
        return torch.sigmoid(self.forward(features) - self.prior_shift)


def confidence_features(extra: torch.Tensor) -> torch.Tensor:
    """(N, EXTRA_FEATURES) -> (N, CONFIDENCE_FEATURES): log q, log(1 - q), entropy, position, direct."""
    position, entropy, q, direct = extra.unbind(-1)
    q = q.clamp(1e-6, 1 - 1e-6)
    return torch.stack([q.log(), torch.log1p(-q), entropy, position, direct], dim=-1)


def _linear(fan_in: int, fan_out: int, generator: torch.Generator | None) -> nn.Linear:
    """nn.Linear with its usual initialisation, drawn from `generator` when one is given."""
    if generator is None:
        return nn.Linear(fan_in, fan_out)
    linear = nn.utils.skip_init(nn.Linear, fan_in, fan_out)
    nn.init.kaiming_uniform_(linear.weight, a=math.sqrt(5), generator=generator)
    bound = 1 / math.sqrt(fan_in)
    nn.init.uniform_(linear.bias, -bound, bound, generator=generator)
    return linear


def token_features(
    hidden: torch.Tensor, logits: torch.Tensor, token: int, position: int, k_max: int, direct: bool
) -> torch.Tensor:
    """Feature row of drafted token `token` (the `position`-th of its draft, from 0) produced from
    `hidden` (d,) and `logits` (Vd,)."""
    logp = torch.log_softmax(logits.float(), -1)
    entropy = float(-torch.special.xlogy(logp.exp(), logp.exp()).sum())  # 0 log 0 = 0 for masked-out tokens
    extra = torch.tensor([position / k_max, entropy / 10, math.exp(float(logp[token])), float(direct)])
    return torch.cat([hidden.float().reshape(-1), extra])


class CostModel:
    """Live costs of this pairing, in seconds: exponential moving averages per draft length and per
    verified length, with a straight line fitted through each.

    A round's drafting time is `draft_fixed + drafted * draft`: the fixed part is the drafter's
    catch-up forward over the tokens just committed, which a longer draft does not repeat, so the
    marginal cost of one more drafted token is the line's slope `draft`, not the round's time per
    drafted token. `overhead` is that fixed part plus `t_other`, the rest of the round's wall time
    (translation, resync, the caller's handling of the tokens: the session passes all of it, since
    a round it leaves out makes short drafts look cheaper than they are). Verifying m tokens
    costs `verify_cost(m)`: interpolated between measured m on the weighted non-decreasing fit of
    the measured curve (verifying more tokens never costs less; a length met rarely, on a lucky
    round, would otherwise make every draft that ends there look cheap). One more token costs
    `verify_slope`, the fitted line's slope, so a lumpy m -> m+1 step of the measured curve does
    not decide a draft's length. With one length seen, a line through the origin stands in.

    Each line is weighted by how often, and how lately, its lengths were seen: every observation
    adds 1 to its length's weight and multiplies all weights by `fade`. A length met twice at the
    start (the machine still warm from something else) would otherwise pull the slope as hard as
    the lengths the policy drafts every round.

    `verify`: a target's measured verify costs to start from (`seed`).
    """

    def __init__(
        self, decay: float = 0.9, fade: float = 0.95, *, verify: dict[int, float] | None = None
    ) -> None:
        if not (0.0 <= decay < 1.0 and 0.0 < fade <= 1.0):
            raise ValueError(
                f"CostModel needs 0 <= decay < 1 and 0 < fade <= 1, got decay={decay}, fade={fade}"
            )
        self.decay, self.fade = decay, fade
        self.drafting: dict[int, float] = {}
        self.verify: dict[int, float] = {}
        self.drafting_weight: dict[int, float] = {}
        self.verify_weight: dict[int, float] = {}
        self._other: float | None = None
        # (intercept, slope) of each line, refitted once a round: the stopping rule reads them per token
        self._draft_line: tuple[float, float] | None = None
        self._verify_line = (0.0, 0.0)
        self._verify_fit: dict[int, float] = {}  # the non-decreasing fit of `verify`
        if verify:
            self.seed(verify)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def observe(
        self, drafted: int, t_draft: float, verified: int, t_verify: float, t_other: float = 0.0
    ) -> None:
        if drafted > 0:
            self.drafting[drafted] = self._ema(self.drafting.get(drafted), t_draft)
            self._count(self.drafting_weight, drafted)
        self.verify[verified] = self._ema(self.verify.get(verified), t_verify)
        self._count(self.verify_weight, verified)
        self._other = self._ema(self._other, t_other)
        if self.drafting:
            self._draft_line = _line(self.drafting, self.drafting_weight)
        self._refit_verify()

    def seed(self, verify: dict[int, float]) -> None:
        """Start from a target's measured verify costs (`verify_costs()`: seconds per verified
        length) instead of nothing; rounds then refine them as usual."""
        for length, seconds in verify.items():
            self.verify[int(length)] = float(seconds)
            self.verify_weight[int(length)] = 1.0
        if self.verify:
            self._refit_verify()

    def _refit_verify(self) -> None:
        self._verify_line = _line(self.verify, self.verify_weight)
        self._verify_fit = _monotone(self.verify, self.verify_weight)

    def _count(self, weights: dict[int, float], length: int) -> None:
        for x in weights:
            weights[x] *= self.fade
        weights[length] = weights.get(length, 0.0) + 1.0

    @property
    def ready(self) -> bool:
        return bool(self.drafting) and len(self.verify) >= 2

    @property
    def draft(self) -> float | None:
        """Marginal cost of one more drafted token."""
        return self._draft_line[1] if self._draft_line else None

    @property
    def overhead(self) -> float:
        """Per-round cost that does not grow with the draft: catch-up forward and the rest of the round."""
        return (self._draft_line[0] if self._draft_line else 0.0) + (self._other or 0.0)

    @property
    def other(self) -> float:
        """The round's wall time beyond drafting and verifying (translation, resync, the caller)."""
        return self._other or 0.0

    @property
    def verify_slope(self) -> float:
        return self._verify_line[1]

    def verify_cost(self, m: int) -> float:
        fit = self._verify_fit
        if m in fit:
            return fit[m]
        lo = max((x for x in fit if x < m), default=None)
        hi = min((x for x in fit if x > m), default=None)
        if lo is not None and hi is not None:
            return fit[lo] + (fit[hi] - fit[lo]) * (m - lo) / (hi - lo)
        edge = lo if lo is not None else hi
        return max(1e-6, fit[edge] + self.verify_slope * (m - edge))


def _monotone(points: dict[int, float], weights: dict[int, float]) -> dict[int, float]:
    """The weighted least-squares non-decreasing fit of {x: y} (pool adjacent violators): a run of
    lengths whose costs fall as x grows is replaced by its weighted mean."""
    blocks: list[list[float]] = []  # [weighted mean, weight, count of lengths]
    for x in sorted(points):
        blocks.append([points[x], weights.get(x, 1.0) or 1e-9, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2, n2), (m1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    values = [mean for mean, _, count in blocks for _ in range(count)]
    return dict(zip(sorted(points), values))


def _line(points: dict[int, float], weights: dict[int, float]) -> tuple[float, float]:
    """Weighted least-squares (intercept, slope) through {x: y}, both >= 0: a negative slope is taken
    as flat, a negative intercept as a line through the origin (and so is a single length)."""
    w = {x: weights.get(x, 1.0) for x in points}
    total = sum(w.values())
    mx = sum(w[x] * x for x in points) / total
    my = sum(w[x] * y for x, y in points.items()) / total
    sxx = sum(w[x] * (x - mx) ** 2 for x in points)
    if len(points) < 2 or sxx == 0:
        return 0.0, my / mx
    slope = max(0.0, sum(w[x] * (x - mx) * (y - my) for x, y in points.items()) / sxx)
    if my - slope * mx < 0:
        return 0.0, sum(w[x] * x * y for x, y in points.items()) / sum(w[x] * x * x for x in points)
    return my - slope * mx, slope


class Stopper:
    """Eq. (6)-(7) over one draft: feed each drafted token's features, ask whether to stop.

    `threshold(n)`: gamma, or with a cost model the cost-aware gamma_n. Drafting token n+1 costs
    one drafter step plus one more verified token, c = c_d + c_v (marginal costs), and adds
    P_{n+1} ~ P_n * p_n expected accepted tokens; it pays when that gain per cost beats the round's
    current rate R(n) = (1 + sum_{j<=n} P_j) / (o + n c_d + V(n+1)), o the round's fixed overhead.
    So stop when P_n < R(n) * c / p_n, i.e. gamma_n = 1 - R(n) * c / p_n.
    """

    def __init__(
        self, head: AcceptanceHead, config: HeadConfig, direct: torch.Tensor, cost: CostModel | None = None
    ) -> None:
        self.head, self.config, self.direct, self.cost = head, config, direct, cost
        self.reset()

    decide = True  # False: record features only, never stop (the fallback policy decides)

    def reset(self) -> None:
        self.survive = 1.0  # P_n = prod_{j<=n} p_j
        self.expected = 1.0  # 1 + sum_{j<=n} P_j: expected target tokens of a round stopped now
        self.rows: list[torch.Tensor] = []
        self.probs: list[float] = []

    def threshold(self, n: int, p_last: float) -> float:
        gamma = self.config.gamma
        if gamma != "cost":
            return float(gamma)
        if self.cost is None or not self.cost.ready:
            return 0.5
        c_d = self.cost.draft
        rate = self.expected / (self.cost.overhead + n * c_d + self.cost.verify_cost(n + 1))
        more = c_d + self.cost.verify_slope
        return min(1.0, max(0.0, 1 - rate * more / max(p_last, 1e-6)))

    def stop_after(self, position: int, token: int, logits: torch.Tensor, hidden: torch.Tensor) -> bool:
        """Record drafted token `position` (from 0); True if the draft should end with it."""
        row = token_features(hidden, logits, token, position, self.config.k_max, bool(self.direct[token]))
        self.rows.append(row)
        p = float(self.head.prob(row[None])[0])
        self.probs.append(p)
        self.survive *= p
        self.expected += self.survive
        n = position + 1
        if not self.decide or n < self.config.k_min:
            return False
        return n >= self.config.k_max or 1 - self.survive > self.threshold(n, p)

    def features(self) -> torch.Tensor:
        return torch.stack(self.rows) if self.rows else torch.zeros(0, self.head.hidden_size + EXTRA_FEATURES)


def head_state(head: AcceptanceHead) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in head.state_dict().items()}
