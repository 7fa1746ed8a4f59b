"""How many devices one server holds at a per-user latency target, with the devices' drafts and
without, and against the server's own speculation (docs/gpu.md, "Capacity").

A server with continuous batching steps back to back while any request runs; a step over `rows`
rows carrying `tokens` new tokens in all costs `StepProfile.cost(rows, tokens)` (a batched step
profile measured by benchmarks/step_profile.py, or one derived from a single sequence's costs
where a step is compute-bound: `StepProfile.compute_bound`). N devices each ask for `tokens` new
tokens at once. Four designs:

- `alone`: the server streams each request; a step commits one token a row.
- `streaming`: the devices draft ahead and the server verifies what has arrived in its own step
  (streaming.py's event simulation: the design `omnidraft serve --engine vllm` runs).
- `round-trip`: a device drafts `k` tokens, sends them, the server verifies them in its next step
  and answers; the device waits for the answer before it drafts again (a remote pairing's rounds).
- `server-ngram`: the server proposes `k` tokens a row each step from the request's own text
  (prompt lookup), found at a step with probability `ngram_found` and then right at each position
  with probability `ngram_acceptance`; no device and no network in the loop.

The device's drafts are right at each position with probability `acceptance` (the geometric model
simulate.py fits to recorded traces). Out, per design and N: each user's time per token (its
request's time over its tokens, the first token's prefill left out) at p50 and p95, and the
server's tokens/s; `capacity` is the largest N whose p95 stays within a target. Pure Python, seeded.
"""

from __future__ import annotations

import heapq
import json
import random
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any, Callable

from .hardware import DeviceProfile
from .streaming import simulate_streaming

__all__ = [
    "DESIGNS",
    "Load",
    "StepProfile",
    "Workload",
    "against_bench",
    "capacity",
    "capacity_table",
    "fit_acceptance",
    "load",
    "read_step_profile",
]

FORMAT, VERSION = "omnidraft-step-profile", 1
DESIGNS = ("alone", "streaming", "round-trip", "server-ngram")


def _between(xs: tuple[int, ...], ys: list[float], x: float) -> float:
    """Linear in x through the points (xs, ys); past either end, the nearest two points' slope."""
    if len(xs) == 1:
        return ys[0] * max(x, 0.0) / xs[0] if x > xs[0] else ys[0]
    i = 1
    while i < len(xs) - 1 and xs[i] < x:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, min(ys)) if x < xs[0] else y


@dataclass(frozen=True)
class StepProfile:
    """ms of one engine step: `ms[i][j]` for `rows[i]` rows of `tokens[j]` new tokens each, at one
    context; `measured` is False for a profile derived or assumed rather than timed as a batch."""

    name: str
    source: str
    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]
    measured: bool = True

    def __post_init__(self) -> None:
        if not self.rows or not self.tokens or len(self.ms) != len(self.rows):
            raise ValueError(f"step profile {self.name!r}: a cost for every row count and token count")
        if any(len(r) != len(self.tokens) or min(r) <= 0 for r in self.ms):
            raise ValueError(f"step profile {self.name!r}: positive costs, one per token count")

    def cost(self, rows: int, tokens: int) -> float:
        """One step over `rows` rows carrying `tokens` new tokens in all (spread evenly)."""
        per_row = tokens / max(rows, 1)
        by_rows = [_between(self.tokens, list(r), per_row) for r in self.ms]
        return _between(self.rows, by_rows, rows)

    def server_costs(self) -> tuple[tuple[int, float], ...]:
        """The step costs a server's draft budget reads (server/budget.py: seconds by the tokens a
        step holds): one row's steps by its tokens, then each other row count's by all its tokens."""
        costs: dict[int, float] = {}
        for r, row in sorted(zip(self.rows, self.ms)):  # more rows than one override its totals
            costs.update({r * t: ms / 1000 for t, ms in zip(self.tokens, row)})
        if 1 not in costs:
            raise ValueError(f"step profile {self.name!r}: a server's budget needs one row of one token")
        return tuple(sorted(costs.items()))

    @classmethod
    def compute_bound(cls, device: DeviceProfile, rows: tuple[int, ...] = (1, 2, 4, 8, 16)) -> StepProfile:
        """Where a step costs what one sequence as long as all its tokens costs (a CPU here)."""
        tokens = tuple(range(1, 10))
        return cls(
            name=f"{device.name} (compute-bound)",
            source=f"{device.source}; a step of r rows of t tokens priced as one sequence of r*t",
            rows=rows,
            tokens=tokens,
            ms=tuple(tuple(device.target_cost(r * t) for t in tokens) for r in rows),
            measured=False,
        )


def read_step_profile(path: str | Path, model: str | None = None, context: int | None = None) -> StepProfile:
    """`model`'s profile (default: the only or first one) at `context` (default: the smallest) from
    benchmarks/step_profile.py's JSON; row counts it could not measure are left out."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable step profile JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        found = doc.get("format") if isinstance(doc, dict) else None
        raise ValueError(
            f"{path}: not a step profile of version {VERSION} (format {found!r}); write one with "
            "python -m benchmarks.step_profile"
        )
    name = model or next(iter(doc["models"]))
    if name not in doc["models"]:
        raise ValueError(f"{path}: no model {name!r}; measured: {', '.join(doc['models'])}")
    contexts = doc["models"][name]["contexts"]
    at = str(context if context is not None else min(int(c) for c in contexts))
    if at not in contexts:
        raise ValueError(f"{path}: {name} not measured at context {at}; measured: {', '.join(contexts)}")
    table = {int(r): v for r, v in contexts[at].items() if isinstance(v, dict) and v}
    if not table:
        raise ValueError(f"{path}: {name} at context {at} has no measured row count")
    rows = tuple(sorted(table))
    tokens = tuple(sorted(int(t) for t in table[rows[0]]))
    return StepProfile(
        name=f"{doc.get('device_name', doc['device'])}:{name}:{doc['dtype']}:context {at}",
        source=f"benchmarks/step_profile.py on {doc.get('device_name')} (torch {doc.get('torch')}, "
        f"{doc['dtype']}, "
        + doc["models"][name].get("source", f"random weights of the {name} shape")
        + f"), {at} tokens of context a row",
        rows=rows,
        tokens=tokens,
        ms=tuple(tuple(float(table[r][str(t)]) for t in tokens) for r in rows),
    )


@dataclass(frozen=True)
class Load:
    """One design at N devices: per-user ms per token at p50 and p95, the server's tokens/s."""

    design: str
    devices: int
    p50_ms: float
    p95_ms: float
    server_tok_s: float


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _load(design: str, n: int, per_user_ms: list[float], total_s: float, tokens: int) -> Load:
    return Load(design, n, median(per_user_ms), _percentile(per_user_ms, 0.95), n * tokens / total_s)


def _right(rng: random.Random, p: float, most: int) -> int:
    """How many of `most` proposed tokens are right before the first wrong one."""
    n = 0
    while n < most and rng.random() < p:
        n += 1
    return n


def _round_trip(
    step: StepProfile, device: DeviceProfile, n: int, rtt_ms: float, tokens: int, k: int, p: float, seed: int
) -> Load:
    """Devices that wait for each verdict: event by event, the server stepping over the rows whose
    proposal has arrived (idle until one does)."""
    rng, half = random.Random(seed), rtt_ms / 2000
    arrivals = [(device.draft_cost(k, 0) / 1000 + half, i) for i in range(n)]
    heapq.heapify(arrivals)
    done, finished, now = [0] * n, [0.0] * n, 0.0
    while arrivals:
        now = max(now, arrivals[0][0])
        ready = []
        while arrivals and arrivals[0][0] <= now:
            ready.append(heapq.heappop(arrivals)[1])
        want = [min(k, tokens - done[i] - 1) for i in ready]
        now += step.cost(len(ready), sum(1 + w for w in want)) / 1000
        for i, w in zip(ready, want):
            done[i] += _right(rng, p, w) + 1
            if done[i] >= tokens:
                finished[i] = now + half
            else:
                heapq.heappush(arrivals, (now + 2 * half + device.draft_cost(k, done[i]) / 1000, i))
    return _load("round-trip", n, [1000 * t / tokens for t in finished], max(finished), tokens)


def _server_ngram(step: StepProfile, n: int, tokens: int, k: int, found: float, p: float, seed: int) -> Load:
    rng = random.Random(seed)
    done, finished, now = [0] * n, [0.0] * n, 0.0
    while any(d < tokens for d in done):
        running = [i for i in range(n) if done[i] < tokens]
        want = [min(k, tokens - done[i] - 1) if rng.random() < found else 0 for i in running]
        now += step.cost(len(running), sum(1 + w for w in want)) / 1000
        for i, w in zip(running, want):
            done[i] += _right(rng, p, w) + 1
            if done[i] >= tokens:
                finished[i] = now
    return _load("server-ngram", n, [1000 * t / tokens for t in finished], now, tokens)


@dataclass(frozen=True)
class Workload:
    """What every device asks and how its drafts fare (see the module doc): `rtt_ms` to the server,
    `tokens` a request, the device's per-token `acceptance`, `k` tokens a round-trip round, the
    server's `budget` of drafted tokens a row and step (streaming), and the server's n-gram: `ngram_k`
    tokens proposed where a match is found (`ngram_found`), each right with `ngram_acceptance`."""

    rtt_ms: float = 50.0
    tokens: int = 128
    acceptance: float = 0.6
    k: int = 3
    budget: int = 6
    ngram_k: int = 5
    ngram_found: float = 0.5
    ngram_acceptance: float = 0.5
    seed: int = 0


def load(design: str, step: StepProfile, device: DeviceProfile, devices: int, **workload: Any) -> Load:
    """`design` (one of DESIGNS) with `devices` devices on `step`; `workload`: `Workload`'s fields."""
    w = Workload(**workload)
    if design not in DESIGNS:
        raise ValueError(f"unknown design {design!r}; the designs are {', '.join(DESIGNS)}")
    if devices < 1 or w.tokens < 2:
        raise ValueError(f"need devices >= 1 and tokens >= 2, got {devices} and {w.tokens}")
    if design == "alone":
        ms = step.cost(devices, devices)
        return Load("alone", devices, ms, ms, 1000 * devices / ms)
    if design == "round-trip":
        return _round_trip(step, device, devices, w.rtt_ms, w.tokens, w.k, w.acceptance, w.seed)
    if design == "server-ngram":
        return _server_ngram(step, devices, w.tokens, w.ngram_k, w.ngram_found, w.ngram_acceptance, w.seed)
    server = DeviceProfile(
        name=step.name, source=step.source, drafter_ms=0.0, target_ms=(1.0,), prefill_ms_per_token=0.0
    )
    r = simulate_streaming(
        server,
        device,
        step_ms=step.cost,
        rtt_ms=w.rtt_ms,
        devices=devices,
        acceptance=w.acceptance,
        budget=w.budget,
        tokens=w.tokens,
        seed=w.seed,
    )
    per_user = list(r.device_ms_per_token)
    return _load("streaming", devices, per_user, max(per_user) * w.tokens / 1000, w.tokens)


def capacity(at: Callable[[int], Load], target_ms: float, most: int = 1024) -> tuple[int, Load | None]:
    """The largest N <= `most` whose `at(N).p95_ms` is within `target_ms` (0 and None where one device
    already misses it), searched by doubling then bisection (p95 grows with N)."""
    first = at(1)
    if first.p95_ms > target_ms:
        return 0, None
    good, best, bad = 1, first, None
    while bad is None and good < most:
        trial = min(most, 2 * good)
        result = at(trial)
        if result.p95_ms <= target_ms:
            good, best = trial, result
        else:
            bad = trial
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        result = at(mid)
        if result.p95_ms <= target_ms:
            good, best = mid, result
        else:
            bad = mid
    return good, best


def _at(
    design: str, step: StepProfile, device: DeviceProfile, rtt: float, kw: dict[str, Any], n: int
) -> Load:
    return load(design, step, device, n, rtt_ms=rtt, **kw)


def capacity_table(
    step: StepProfile, device: DeviceProfile, rtts: list[float], targets: list[float], **kw: Any
) -> list[dict[str, Any]]:
    """One row per (RTT, target, design): the capacity and the load there."""
    rows = []
    for rtt in rtts:
        for target in targets:
            for design in DESIGNS:
                n, at = capacity(partial(_at, design, step, device, rtt, kw), target)
                rows.append(
                    {
                        "rtt_ms": rtt,
                        "target_ms": target,
                        "design": design,
                        "capacity": n,
                        "p95_ms": round(at.p95_ms, 2) if at else None,
                        "server_tok_s": round(at.server_tok_s, 1) if at else None,
                    }
                )
    return rows


def against_bench(
    measured: list[dict[str, Any]],
    server: DeviceProfile,
    device: DeviceProfile,
    *,
    acceptance: float,
    budget: int = 6,
    seeds: int = 8,
    step: StepProfile | None = None,
    server_budget: bool = False,
) -> list[dict[str, Any]]:
    """The streaming model's prediction of each "server alone" and "device drafting" row of
    `omnidraft bench --remote` (its JSON rows), beside what was measured: the server's tokens/s and
    the median request's seconds a token. Where the rows list their requests' lengths and times to
    first token (`request_tokens`, `request_ttft_s`), the model replays them request by request,
    each device sending its share one after another as the bench's devices do, each prompt read by
    the server in its time to first token with one device, less the round trip (no other request
    queued before it: `_requests`); otherwise every device asks for the mean length at once, the
    row's time to first token added. `step`: a batched step profile for the server's steps
    (default: `server`'s, as if compute-bound); `server_budget`: each step takes the draft budget
    the server computes from `step`'s costs for its rows (`budget` its ceiling), not `budget`."""
    if server_budget and step is None:
        raise ValueError("the server's own budget is computed from a step profile: pass one")
    costs = step.server_costs() if server_budget and step is not None else ()
    reads = _prompt_reads(measured)
    out = []
    for row in measured:
        if row.get("row") not in ("server alone", "device drafting"):
            continue
        n = int(row["devices"])
        requests = _requests(row, reads)
        tokens = max(2, round(row["tokens"] / row["requests"]))
        runs = [
            simulate_streaming(
                server,
                device,
                step_ms=step.cost if step is not None else None,
                rtt_ms=float(row["rtt_ms"]),
                devices=n,
                acceptance=acceptance,
                budget=budget if row["row"] == "device drafting" else 0,
                tokens=tokens,
                shared_cpu=True,  # the bench's devices share one core
                seed=seed,
                ttft_s=0.0 if requests else float(row.get("ttft_s") or 0.0),
                requests=requests,
                server_costs=costs,
            )
            for seed in range(seeds)
        ]
        per_token = [ms / 1000 for r in runs for ms in r.device_ms_per_token]
        if requests:
            rate = sum(r.server_tok_s for r in runs) / len(runs)
        else:
            rate = n * tokens / (tokens * sum(per_token) / len(per_token))
        predicted = {"tok_s": rate, "s_per_token_p50": median(per_token)}
        got = {"tok_s": row["tok_s"], "s_per_token_p50": row.get("request_s_per_token_p50")}
        entry: dict[str, Any] = {"rtt_ms": row["rtt_ms"], "devices": n, "row": row["row"]}
        for key in predicted:
            entry[f"predicted_{key}"] = round(predicted[key], 3)
            entry[f"measured_{key}"] = got[key]
            entry[f"error_{key}"] = round(predicted[key] / got[key] - 1, 3) if got[key] else None
        out.append(entry)
    return out


def _prompt_reads(measured: list[dict[str, Any]]) -> list[float]:
    """Per prompt (in the order sent), the server's seconds to read it: the least time to first
    token of the one-device rows, less their round trip."""
    reads: list[float] = []
    for row in measured:
        if row.get("row") in ("server alone", "device drafting") and int(row.get("devices", 0)) == 1:
            rtt = float(row["rtt_ms"]) / 1000
            for j, t in enumerate(row.get("request_ttft_s") or []):
                if t is None:
                    continue
                read = max(0.0, float(t) - rtt)
                reads[j : j + 1] = [min(reads[j], read)] if j < len(reads) else [read]
    return reads


def _requests(row: dict[str, Any], reads: list[float]) -> tuple[tuple[int, float], ...]:
    """A bench row's requests as (tokens, seconds the server reads its prompt in), in the order
    sent: a one-device row's own (nothing queued before its requests; a prompt the server has seen
    reads faster from its prefix cache), another row's the least of the one-device rows'; () where
    the rows do not list them."""
    lengths = row.get("request_tokens")
    if int(row["devices"]) == 1:
        reads = _prompt_reads([row])
    if not lengths or len(lengths) > len(reads):
        return ()
    return tuple((int(n), reads[j]) for j, n in enumerate(lengths) if n > 0)


def fit_acceptance(
    measured: list[dict[str, Any]], server: DeviceProfile, device: DeviceProfile, **kw: Any
) -> float:
    """The per-token acceptance at which `against_bench` (same keywords) predicts the one-device
    "device drafting" row's server tokens/s as measured (the first such row: bisection, the rate grows
    with it); the other rows are then predictions."""
    rows = [r for r in measured if r.get("row") == "device drafting" and int(r.get("devices", 0)) == 1]
    if not rows:
        raise ValueError("no one-device 'device drafting' row to fit the acceptance to")
    low, high = 0.0, 1.0
    for _ in range(12):
        mid = (low + high) / 2
        (fit,) = against_bench(rows[:1], server, device, acceptance=mid, **kw)
        if fit["error_tok_s"] is None:
            raise ValueError("the one-device 'device drafting' row has no measured tokens/s")
        low, high = (mid, high) if fit["error_tok_s"] < 0 else (low, mid)
    return round((low + high) / 2, 3)
