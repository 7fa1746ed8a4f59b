"""`CostModel`: what drafting and verifying cost on this machine, learnt from the rounds a pairing
runs (drafting a token; verifying m tokens), the figures every draft-length decision reads."""

from __future__ import annotations

__all__ = ["CostModel"]


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
        if edge is None:
            raise ValueError("no verify cost measured yet")
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
    values = [mean for mean, _, count in blocks for _ in range(int(count))]
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
