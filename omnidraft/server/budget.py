"""How many draft tokens a verification server takes from each session next round, from its load.

On a server whose engine batches sessions, one step verifies every waiting session's tokens; on a
compute-bound engine each extra token lengthens that step for everyone. The budget is the draft
length that maximises committed tokens per second over all sessions (goodput, in the spirit of
SmartSpec, Liu et al. 2024): a step's cost is read off the engine's measured step costs by the
tokens it holds (one sequence's verifies of a few tokens, which a memory-bound step makes nearly
free, and steps over many rows, where a compute-bound engine pays for every token). N active
sessions each verifying k drafted tokens plus the pending one (plus the context tail a
block-granular prefix cache recomputes) commit N E(k) tokens, E(k) = (1 - a^(k+1)) / (1 - a) at
acceptance a, against N tokens a step decoding alone. Pure arithmetic: no server, no model.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["BUDGET_S", "DraftBudget", "DraftGate", "RecentAcceptance", "draft_budget", "step_seconds"]

BUDGET_S = 0.05  # how long a computed draft budget stands


def step_seconds(costs: dict[int, float], tokens: float) -> float:
    """Seconds of an engine step over `tokens` tokens, read off the measured step costs (`costs`:
    tokens -> seconds; one sequence's verifies, and steps over many rows where measured) along
    straight lines between them, and past the last one along the steeper of the last line and the
    line from the first."""
    if not costs or min(costs) != 1 or costs[1] <= 0:
        raise ValueError(f"step costs need a positive cost for one token, got {costs}")
    points = sorted(costs.items())
    (first, c_first), (last, c_last) = points[0], points[-1]
    if tokens >= last:  # past the measurements: the steeper of the last line and the overall one
        lines = [(c_last - c_first) / (last - first)] if last > first else [0.0]
        if len(points) > 1:
            (t0, c0) = points[-2]
            lines.append((c_last - c0) / (last - t0))
        return c_last + max(0.0, *lines) * (tokens - last)
    for (t0, c0), (t1, c1) in zip(points, points[1:]):
        if tokens <= t1:
            return c0 + max(0.0, c1 - c0) * (tokens - t0) / (t1 - t0)
    return c_first


def draft_budget(
    costs: dict[int, float], acceptance: float, sessions: int, max_draft: int, tail: int = 0
) -> int:
    """The draft length in [1, `max_draft`] of highest goodput for `sessions` sessions verifying at once,
    each accepting a drafted token with probability `acceptance`, where each verify also recomputes
    `tail` tokens of context (a block-granular prefix cache); 0 when no length beats the sessions
    decoding alone in the engine's own loop (one token each a step, no tail): hand them over."""
    if max_draft < 0 or sessions < 1 or tail < 0:
        raise ValueError(
            f"need max_draft >= 0, sessions >= 1 and tail >= 0, got {max_draft}, {sessions} and {tail}"
        )
    a = min(max(acceptance, 0.0), 0.999)
    alone = sessions / step_seconds(costs, sessions)

    def goodput(k: int) -> float:
        committed = (1 - a ** (k + 1)) / (1 - a)
        return sessions * committed / step_seconds(costs, sessions * (k + 1 + tail))

    best = max(range(1, max_draft + 1), key=lambda k: (goodput(k), -k), default=0)
    return best if best and goodput(best) > alone else 0


class DraftGate:
    """Whether the drafts the budget takes pay on this server as it runs, measured.

    The budget reads measured step costs; what it cannot see (the proposals' own HTTP traffic under
    the GIL beside the engine, proposals that miss their step) can make drafting cost a loaded
    server throughput. The gate times committed tokens per second over windows of `window_s` at one
    load (the active sessions): in windows "on" the budget stands, "off" it is 0. It learns both
    (on first, then off), then keeps the faster, trying the other every `explore`-th window (four
    times as rarely when they differ by more than a quarter, and each try that confirms the faster
    one spaces the next twice as far, up to eight times); at a load it has not compared yet it
    follows the nearest load it has within a quarter of it (sessions ending one by one do not
    relearn at each load). A window whose load changed, or where the budget wanted no draft,
    teaches nothing. Below `min_load` sessions the budget stands: their proposals are a few
    requests a step. Not thread-safe by itself: the caller serialises `allow` and `count`."""

    def __init__(
        self,
        window_s: float = 1.5,
        explore: int = 5,
        min_load: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or explore < 2 or min_load < 1:
            raise ValueError(
                f"need window_s > 0, explore >= 2 and min_load >= 1, got {window_s}, {explore}, {min_load}"
            )
        self.window_s, self.explore, self.min_load, self.clock = window_s, explore, min_load, clock
        self.rates: dict[tuple[int, bool], tuple[float, float]] = {}  # (load, on) -> (tokens, seconds)
        self._load: int | None = None
        self._on, self._began, self._tokens, self._wanted = True, 0.0, 0, False
        self._best: bool | None = None  # the faster mode as last compared
        self._since = 0  # windows since the other mode was last tried
        self._spacing = 1  # times `explore` between tries: doubles while tries confirm the faster

    def allow(self, load: int, wanted: bool) -> bool:
        """Whether drafts are taken now at `load` active sessions; `wanted`: the budget is above 0."""
        if load < self.min_load:
            self._load = None  # a window open at a higher load ends here, unmeasured
            return True
        now = self.clock()
        if load != self._load or now - self._began >= self.window_s:
            if load == self._load and self._wanted and self._tokens:
                tokens, seconds = self.rates.get((load, self._on), (0.0, 0.0))
                decay = 0.7  # older windows count less: the load's text and contexts move on
                tokens, seconds = decay * tokens + self._tokens, decay * seconds + now - self._began
                self.rates[(load, self._on)] = (tokens, seconds)
            self._on = self._choose(load)
            self._load, self._began, self._tokens, self._wanted = load, now, 0, False
        self._wanted = self._wanted or wanted
        return self._on

    def count(self, tokens: int) -> None:
        """`tokens` more committed (streamed to a device) now."""
        self._tokens += tokens

    def rate(self, load: int, on: bool) -> float | None:
        """Committed tokens per second measured at `load` with drafts taken (`on`) or not."""
        tokens, seconds = self.rates.get((load, on), (0.0, 0.0))
        return tokens / seconds if seconds > 0 else None

    def _choose(self, load: int) -> bool:
        """This window's mode at `load`: the faster where both modes were measured at the nearest
        load within a quarter of this one (this one first: a load that moves as sessions end need
        not learn again), the other every so often; where none was, learn on, then off."""
        near_by = max(1, load // 4)  # a quarter of the load away, at most
        compared = [n for n in {n for n, _ in self.rates} if abs(n - load) <= near_by and self._both(n)]
        if not compared:
            return self.rate(load, True) is None  # learn "on" first, then "off"
        near = min(compared, key=lambda n: (abs(n - load), -n))
        on, off = self.rate(near, True), self.rate(near, False)
        assert on is not None and off is not None
        best = on >= off
        if best != self._best:  # first compared, or the other mode turned out faster: try again soon
            self._best, self._spacing, self._since = best, 1, 0
        elif self._since == 0:  # the last try confirmed the faster one: the next one twice as far
            self._spacing = min(2 * self._spacing, 8)
        self._since += 1
        every = self.explore * self._spacing * (4 if max(on, off) > 1.25 * min(on, off) else 1)
        if self._since < every:
            return best
        self._since = 0
        return not best

    def _both(self, load: int) -> bool:
        return self.rate(load, True) is not None and self.rate(load, False) is not None


class RecentAcceptance:
    """The share of proposed draft tokens the engine accepted over recent rounds (sums in which a
    round weighs `decay` times less per round after it), `prior` until `warm` tokens were seen; and
    the re-measuring of a budget it drove to 0. A budget of 0 takes no drafts, so no round would
    ever measure acceptance again: after `hold_s` seconds at 0, drafts are taken for `probe_s`
    seconds at the budget `prior` gives, and what they measure decides after. Pure bookkeeping:
    the caller serialises it."""

    def __init__(
        self,
        decay: float = 0.98,
        prior: float = 0.8,
        warm: int = 16,
        hold_s: float = 3.0,
        probe_s: float = 1.0,
    ) -> None:
        if not (0 < decay < 1 and 0 < prior < 1) or warm < 0 or hold_s <= 0 or probe_s <= 0:
            raise ValueError(
                f"need 0 < decay, prior < 1, warm >= 0, hold_s, probe_s > 0; got {decay}, {prior}, {warm}, "
                f"{hold_s}, {probe_s}"
            )
        self.decay, self.prior, self.warm, self.hold_s, self.probe_s = decay, prior, warm, hold_s, probe_s
        self.accepted = self.proposed = 0.0
        self.seen = 0
        self._zero_since: float | None = None
        self._probe_until = 0.0

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.proposed = self.decay * self.proposed + proposed
        self.seen += proposed

    @property
    def value(self) -> float:
        return self.accepted / self.proposed if self.seen >= self.warm and self.proposed > 0 else self.prior

    def budget(self, measured: int, probe: int, now: float) -> int:
        """The budget to grant: `measured` (from `value`), or `probe` (from `prior`) while a zero
        budget is being re-measured."""
        if measured > 0:
            self._zero_since = None
            return measured
        if now < self._probe_until:
            return probe
        if self._zero_since is None:
            self._zero_since = now
        elif now - self._zero_since >= self.hold_s:
            self._zero_since, self._probe_until = None, now + self.probe_s
            return probe
        return 0


class DraftBudget:
    """A server's draft budget as it runs: `draft_budget` at the engine's step `costs`, the load
    (`active()`: sessions verifying lately) and the acceptance measured lately (`acceptance`,
    re-measured where it drove the budget to 0); recomputed at most every BUDGET_S per context
    tail (an engine step asks it for every row). `active_n`: the load the last budget served."""

    def __init__(self, costs: dict[int, float], active: Callable[[], int], max_draft: int) -> None:
        self.costs, self.active, self.max_draft = costs, active, max_draft
        self.acceptance = RecentAcceptance()
        self.active_n = 1
        self._cached: dict[int, tuple[float, int]] = {}  # tail -> (when, budget)

    def __call__(self, tail: int = 0) -> int:
        """The draft tokens a session may propose next when a verify recomputes `tail` tokens."""
        now = time.monotonic()
        cached = self._cached.get(tail)
        if cached is not None and now - cached[0] < BUDGET_S:
            return cached[1]
        self.active_n = self.active()
        sessions, seen = max(1, self.active_n), self.acceptance
        measured = draft_budget(self.costs, seen.value, sessions, self.max_draft, tail=tail)
        probe = (
            draft_budget(self.costs, seen.prior, sessions, self.max_draft, tail=tail) if measured == 0 else 0
        )
        budget = seen.budget(measured, probe, now)
        self._cached[tail] = (now, budget)
        return budget
