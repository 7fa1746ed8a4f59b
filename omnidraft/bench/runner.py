"""Run one pairing and its baselines over a list of prompts, side by side in one process.

Per prompt: the target alone (the fair baseline: the pairing's own target model object on the
kernel plan it verifies with), each peer row (`PEERS`: the same model on stock kernels, HF
prompt-lookup decoding, HF assisted generation) and omnidraft, each timed once after a shared
warm-up; the ratios compare runs made seconds apart on the same machine state.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import partial
from statistics import median
from typing import TYPE_CHECKING, Any, Callable, cast

from ..pairing import Pairing
from .baselines import Timed, hf_assisted, prompt_lookup, stock_generate, target_alone

if TYPE_CHECKING:
    from ..draft.base import Drafter
    from ..target import Target
    from ..targets.local import LocalTarget

__all__ = [
    "PEERS",
    "PromptResult",
    "compare_pairings",
    "rouge_l",
    "default_against_fixed_k",
    "pairing_costs",
    "paired_ratio",
    "run_prompts",
    "summarize",
]


def _hf(pair: Pairing) -> LocalTarget:
    """The pairing's target as the HF model the HF peers run (`--peers` needs a PyTorch target)."""
    return cast("LocalTarget", pair.target)


# peer rows: name -> (label in reports, runner(pair, prompt, n) -> Timed)
PEERS: dict[str, tuple[str, Callable[[Pairing, str, int], Timed]]] = {
    "stock": ("HF generate, stock kernels", lambda pair, prompt, n: stock_generate(_hf(pair), prompt, n)),
    "lookup": ("HF prompt lookup (10)", lambda pair, prompt, n: prompt_lookup(_hf(pair), prompt, n)),
    "assisted": (
        "HF assisted generation",
        lambda pair, prompt, n: hf_assisted(_hf(pair), pair.drafter, prompt, n),
    ),
}


@dataclass(frozen=True)
class PromptResult:
    index: int
    new_tokens: int
    identical: bool
    acceptance_rate: float
    mean_accepted_length: float
    ngram_hits_per_round: float
    omnidraft_s: float
    target_s: float
    time_split: dict[str, float]
    peers: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> seconds, identical, tau
    drafted_per_round: float = 0.0
    speculating: float = 1.0  # share of rounds that drafted

    @property
    def speedup(self) -> float:
        return self.target_s / self.omnidraft_s

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "speedup": self.speedup,
            **{f"{name}_speedup": self.target_s / row["seconds"] for name, row in self.peers.items()},
        }


def run_prompts(
    pair: Pairing,
    prompts: list[str],
    max_new_tokens: int,
    *,
    peers: tuple[str, ...] = tuple(PEERS),
    trace: Callable[[int, Any], None] | None = None,
    progress: Callable[[str], object] = lambda _: None,
    done: Callable[[list[PromptResult]], None] = lambda _: None,
) -> list[PromptResult]:
    """Time omnidraft, the target alone and every row of `peers` (keys of PEERS) on every prompt;
    `done` sees the results so far after each prompt (for partial reports of long runs)."""
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peer rows {sorted(unknown)}; known: {sorted(PEERS)}")
    warm = prompts[0]
    pair.generate(warm, max_new_tokens=8)
    target_alone(pair.target, warm, 8)
    for name in peers:
        PEERS[name][1](pair, warm, 8)
    results = []
    for i, prompt in enumerate(prompts):
        progress(f"prompt {i}: target alone")
        ref = target_alone(pair.target, prompt, max_new_tokens)
        rows = {}
        for name in peers:
            progress(f"prompt {i}: {name}")
            run, forwards = _counting_forwards(
                cast("LocalTarget", pair.target).model, partial(PEERS[name][1], pair, prompt, max_new_tokens)
            )
            rows[name] = {
                "seconds": run.seconds,
                "identical": run.token_ids == ref.token_ids,
                "tau": len(run.token_ids) / max(1, forwards - 1),
            }  # the prefill forward also emits a token
        progress(f"prompt {i}: omnidraft")
        out = pair.generate(prompt, max_new_tokens=max_new_tokens)
        if trace is not None:
            trace(i, out)
        results.append(
            PromptResult(
                index=i,
                new_tokens=len(out.token_ids),
                identical=out.token_ids == ref.token_ids,
                acceptance_rate=out.stats.acceptance_rate,
                mean_accepted_length=out.stats.mean_accepted_length,
                ngram_hits_per_round=out.stats.ngram_hits_per_round,
                omnidraft_s=out.stats.seconds,
                target_s=ref.seconds,
                time_split=out.stats.time_split,
                peers=rows,
                drafted_per_round=sum(r.drafted for r in out.rounds) / max(1, len(out.rounds)),
                speculating=out.stats.speculating,
            )
        )
        done(results)
    return results


def pairing_costs(pair: Pairing, target_step_s: float) -> dict[str, Any]:
    """What the pairing measured (ms): drafter step, round overhead, verify(m); and, once its cost
    policy has seen a drafting round, the first drafted token's acceptance, the per-token
    acceptance after it, target tokens per drafted token and the expected rate of each draft length.
    The limit check of docs/benchmarks.md: a round of k drafted tokens costs k * step + verify(k + 1)
    + overhead for tau tokens, which beats the target alone only while that is below tau * target step."""
    cost, policy = pair.speculator.cost, pair.policy
    out: dict[str, Any] = {
        "target_step_ms": 1000 * target_step_s,
        "draft_ms": 1000 * cost.draft if cost.draft is not None else None,
        "overhead_ms": 1000 * cost.overhead,
        "verify_ms": {m: 1000 * v for m, v in sorted(cost.verify.items())},
    }
    if policy is not None and policy.long_run.rounds > 0 and policy.ratio is not None and cost.ready:
        out.update(
            first_acceptance=policy.long_run.first,
            then_acceptance=policy.long_run.then,
            target_per_drafted=policy.ratio,
            rates_tok_s={k: round(v, 2) for k, v in policy.rates().items()},
        )
    return out


def _counting_forwards(model: Any, run: Callable[[], Timed]) -> tuple[Timed, int]:
    """`run()` and how many forwards of `model` it made (a pre-hook counts them)."""
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        return run(), len(calls)
    finally:
        handle.remove()


def summarize(results: list[PromptResult]) -> dict[str, Any]:
    """Totals and medians over prompts (tokens/s from total tokens over total time); per peer row
    its tok/s, speedup over the target alone, τ and share of outputs identical to the target's."""
    tokens = sum(r.new_tokens for r in results)
    omni_s, target_s = sum(r.omnidraft_s for r in results), sum(r.target_s for r in results)
    split = {k: sum(r.time_split[k] * r.omnidraft_s for r in results) / omni_s for k in results[0].time_split}
    out = {
        "prompts": len(results),
        "new_tokens": tokens,
        "identical_rate": sum(r.identical for r in results) / len(results),
        "acceptance_rate": sum(r.acceptance_rate for r in results) / len(results),
        "mean_accepted_length": median(r.mean_accepted_length for r in results),
        "ngram_hits_per_round": sum(r.ngram_hits_per_round for r in results) / len(results),
        "omnidraft_tok_s": tokens / omni_s,
        "target_tok_s": tokens / target_s,
        "speedup": target_s / omni_s,
        "median_speedup": median(r.speedup for r in results),
        "worst_speedup": min(r.speedup for r in results),  # the per-request floor
        "drafted_per_round": sum(r.drafted_per_round for r in results) / len(results),
        "speculating": sum(r.speculating for r in results) / len(results),
        "time_split": split,
    }
    for name in results[0].peers:
        seconds = sum(r.peers[name]["seconds"] for r in results)
        out[f"{name}_tok_s"] = tokens / seconds
        out[f"{name}_speedup"] = target_s / seconds
        out[f"{name}_tau"] = median(r.peers[name]["tau"] for r in results)
        out[f"{name}_identical_rate"] = sum(r.peers[name]["identical"] for r in results) / len(results)
    return out


def compare_pairings(
    pairs: dict[str, Pairing],
    prompts: list[str],
    max_new_tokens: int,
    progress: Callable[[str], object] = lambda _: None,
    *,
    peers: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Several pairings of one target (and `peers`, keys of PEERS, run on the first pairing's
    target), side by side: per prompt the target alone once, then each row, all timed in one
    process. The rows' order rotates from prompt to prompt, so none always runs first after the
    target (or last, when the machine has drifted most). Rows: acceptance, τ, drafted/round,
    retrieved share, tok/s, speedup, identical, and each prompt's seconds (`prompt_s`, for paired
    comparisons: `paired_ratio`)."""
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peer rows {sorted(unknown)}; known: {sorted(PEERS)}")
    first = next(iter(pairs.values()))
    target = first.target
    for pair in pairs.values():  # warm-up (and a first cost estimate for cost-aware pairings)
        pair.generate(prompts[0], max_new_tokens=16)
    for name in peers:
        PEERS[name][1](first, prompts[0], 8)
    target_alone(target, prompts[0], 8)
    names = [*pairs, *peers]
    runs: dict[str, list[Any]] = {name: [] for name in names}
    identical = {name: 0 for name in names}
    rouge = {name: 0.0 for name in names}
    alone_s = alone_tokens = 0.0
    for i, prompt in enumerate(prompts):
        progress(f"prompt {i + 1}/{len(prompts)}: target alone")
        ref = target_alone(target, prompt, max_new_tokens)
        alone_s, alone_tokens = alone_s + ref.seconds, alone_tokens + len(ref.token_ids)
        for name in names[i % len(names) :] + names[: i % len(names)]:
            progress(f"prompt {i + 1}/{len(prompts)}: {name}")
            out: Any
            if name in pairs:
                out = pairs[name].generate(prompt, max_new_tokens=max_new_tokens)
                ids = out.token_ids
            else:
                out = _counting_forwards(
                    cast("LocalTarget", target).model, partial(PEERS[name][1], first, prompt, max_new_tokens)
                )
                ids = out[0].token_ids
            runs[name].append(out)
            identical[name] += ids == ref.token_ids
            rouge[name] += rouge_l(ids, ref.token_ids) / len(prompts)
    alone_tok_s = alone_tokens / alone_s
    rows = [
        {
            "variant": name,
            "identical": identical[name],
            "prompts": len(prompts),
            "rouge_l": rouge[name],
            **(_pairing_row(outs, alone_tok_s) if name in pairs else _peer_row(name, outs, alone_tok_s)),
        }
        for name, outs in runs.items()
    ]
    return {"target_tok_s": alone_tok_s, "rows": rows}


def _pairing_row(outs: list[Any], alone_tok_s: float) -> dict[str, Any]:
    """A pairing's row: acceptance, τ, retrieved share, drafting, speed, each prompt's seconds."""
    from ..decode.stats import GenerationStats

    rounds = [r for o in outs for r in o.rounds]
    tokens, seconds = sum(len(o.token_ids) for o in outs), sum(o.stats.seconds for o in outs)
    s = GenerationStats.from_rounds(rounds, tokens, seconds)
    drafted = sum(r.drafted for r in rounds)
    return {
        "acceptance_rate": s.acceptance_rate,
        "tau": s.mean_accepted_length,
        "retrieved_share": s.retrieved_share,
        "drafted_per_round": drafted / len(rounds),
        "draft_ms_per_token": 1000 * sum(r.t_draft for r in rounds) / max(1, drafted),
        "prompt_s": [o.stats.seconds for o in outs],
        "tok_s": tokens / seconds,
        "speedup": (tokens / seconds) / alone_tok_s,
    }


def _peer_row(name: str, outs: list[Any], alone_tok_s: float) -> dict[str, Any]:
    """A peer's row (its timed output and target forwards per prompt): τ, speed, each prompt's seconds."""
    tokens, seconds = sum(len(t.token_ids) for t, _ in outs), sum(t.seconds for t, _ in outs)
    return {
        "label": PEERS[name][0],
        "tau": tokens / max(1, sum(f - 1 for _, f in outs)),
        "prompt_s": [t.seconds for t, _ in outs],
        "tok_s": tokens / seconds,
        "speedup": (tokens / seconds) / alone_tok_s,
    }


def rouge_l(candidate: list[int], reference: list[int]) -> float:
    """ROUGE-L F1 of two token sequences (longest common subsequence); 1.0 for identical ones."""
    if not candidate or not reference:
        return float(candidate == reference)
    previous = [0] * (len(reference) + 1)
    for a in candidate:
        current = [0]
        for j, b in enumerate(reference):
            current.append(previous[j] + 1 if a == b else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    return 2 * lcs / (len(candidate) + len(reference))


def paired_ratio(faster: list[float], slower: list[float]) -> dict[str, float]:
    """How much faster one pairing ran than another on the same prompts (same outputs, so time
    ratios are throughput ratios): the geometric mean of slower/faster per prompt with a 95%
    t-interval, and on how many prompts it was faster. An interval above 1 is a win the run-to-run
    drift of this machine does not explain."""
    if len(faster) != len(slower) or not faster:
        raise ValueError(
            f"paired_ratio needs the same non-empty prompts for both, got {len(faster)} and {len(slower)}"
        )
    logs = [math.log(b / a) for a, b in zip(faster, slower)]
    n, mean = len(logs), sum(logs) / len(logs)
    spread = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1)) / math.sqrt(n) if n > 1 else math.inf
    half = _T95[max(df for df in _T95 if df <= max(n - 1, 1))] * spread
    return {
        "ratio": math.exp(mean),
        "low": math.exp(mean - half),
        "high": math.exp(mean + half),
        "wins": sum(x > 0 for x in logs),
        "prompts": n,
    }


# two-sided 95% Student t quantiles by degrees of freedom; a df between two keys takes the lower
# key's (larger, so conservative) quantile, and beyond 30 the quantile at 30 (the normal's is 1.96)
_T95 = {
    1: 12.71,
    2: 4.30,
    3: 3.18,
    4: 2.78,
    5: 2.57,
    6: 2.45,
    7: 2.36,
    8: 2.31,
    9: 2.26,
    10: 2.23,
    11: 2.20,
    12: 2.18,
    13: 2.16,
    14: 2.14,
    15: 2.13,
    16: 2.12,
    17: 2.11,
    18: 2.10,
    19: 2.09,
    20: 2.09,
    25: 2.06,
    30: 2.04,
}


def default_against_fixed_k(
    drafter: Drafter,
    target: Target,
    prompts: list[str],
    max_new_tokens: int,
    ks: list[int],
    progress: Callable[[str], object] = lambda _: None,
) -> dict[str, Any]:
    """The default pairing (draft length from measured costs) beside each fixed k, same prompts,
    same run (`compare_pairings`), and how the default compares with the best fixed k per prompt
    (`paired_ratio`: above 1, the default is faster)."""
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"ks must be draft lengths >= 1, got {ks}")
    pairs = {"default": drafter.pair(target), **{f"k={k}": drafter.pair(target, k=k) for k in ks}}
    result = compare_pairings(pairs, prompts, max_new_tokens, progress)
    rows = {row["variant"]: row for row in result["rows"]}
    best = max((name for name in rows if name != "default"), key=lambda name: rows[name]["tok_s"])
    result["best_fixed"] = best
    result["default_vs_best"] = paired_ratio(rows["default"]["prompt_s"], rows[best]["prompt_s"])
    return result
