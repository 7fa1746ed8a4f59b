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
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .costs import CostModel

__all__ = [
    "CONFIDENCE_FEATURES",
    "EXTRA_FEATURES",
    "AcceptanceHead",
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

    prior_shift: torch.Tensor

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
        c_d = self.cost.draft or 0.0  # (ready: measured)
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
