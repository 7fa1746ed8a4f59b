"""`python -m benchmarks draft-lengths`: fixed k vs the hysteresis fallback vs acceptance heads, live.

1. Train one acceptance head per schedule (joint, interleaved) on recorded target traces of a
   training split (`adapt_eval.traces_for`, cached): the engine runs against a `ReplayTarget`, so the
   labels are exactly what live greedy verification would give, with drafter forwards only.
   While training, the head only records (the fallback policy picks the draft lengths).
2. Evaluate live on the benchmark prompts: per prompt the target alone once, then every variant,
   each timed, side by side in one process. Heads are frozen during evaluation and use the
   cost-aware threshold from the pairing's live cost model.
Without online distillation ("joint" here means the head's update schedule of Algorithm 3, fresh
rows at the adapter's cadence; no adapter is trained, so rows compare draft policies only).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from omnidraft.adaptive.acceptance_head import HeadConfig
from omnidraft.adaptive.policy import Hysteresis
from omnidraft.bench.datasets import load_prompts
from omnidraft.bench.runner import compare_pairings, paired_ratio
from omnidraft.distill.trace_store import ReplayTarget
from omnidraft.store.atomic import atomic_write_bytes

from .adapt_eval import prompts_for, traces_for

__all__ = ["Prequential", "against_best_fixed", "run_draft_policies", "train_heads", "write_draft_report"]


def train_heads(
    drafter: Any,
    target: Any,
    train: str,
    n_train: int,
    max_new_tokens: int,
    cache: Path,
    configs: dict[str, HeadConfig],
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """One acceptance head per schedule, trained on the replayed training traces; cached under `cache`.

    The drafting rollout (the fallback policy picks draft lengths; features and labels are
    recorded) runs once; each schedule then replays the same per-request rows through its own
    update cadence, as it would have seen them online. Returns (heads, their `Prequential` scores).
    """
    from safetensors.torch import load_file, save_file

    from omnidraft.adaptive.acceptance_head import AcceptanceHead
    from omnidraft.adaptive.head_trainer import HeadTrainer

    # v2: heads with the confidence calibration path; a cache of older heads is not reused
    stem = f"head-v2-{drafter.name}-{target.name}-{train.replace(':', '-')}-{n_train}-{max_new_tokens}"
    paths = {name: cache / f"{stem}-{name}.safetensors" for name in configs}
    scores_path = cache / f"{stem}-scores.json"
    if all(p.exists() for p in paths.values()) and scores_path.exists():
        heads = {}
        for name, config in configs.items():
            heads[name] = AcceptanceHead(drafter.hidden_size, config.width, config.depth)
            heads[name].load_state_dict(load_file(str(paths[name])))
        return heads, json.loads(scores_path.read_text())
    traces = traces_for(target, train, n_train, max_new_tokens, cache)
    prompts = prompts_for(target, train, traces)
    any_config = next(iter(configs.values()))
    pair = drafter.pair(
        ReplayTarget.like(target, traces),
        k=4,
        stop_confidence=0.3,
        head=replace(any_config, warmup=10**9, steps=0, capacity=10**9),
        adaptive=Hysteresis(k_min=2, k_max=any_config.k_max),
    )
    requests = []  # (features, labels) of each request's rounds
    for i, (trace, prompt) in enumerate(zip(traces, prompts)):
        before = len(pair.head_trainer.labels)
        pair.generate(prompt, max_new_tokens=max(1, len(trace.continuation) - 1))
        requests.append((pair.head_trainer.features[before:], pair.head_trainer.labels[before:]))
        progress(f"head rollout {i + 1}/{len(traces)}")
    heads, scores = {}, {}
    for name, config in configs.items():
        head = AcceptanceHead(drafter.hidden_size, config.width, config.depth, seed=config.seed)
        trainer = HeadTrainer(head, config)
        score = Prequential()
        for i, (features, labels) in enumerate(requests):
            if trainer.steps and labels:  # scored before it trains on them
                score.add(head.prob(torch.cat(features)), torch.cat(labels))
            for x, y in zip(features, labels):
                trainer.add_rows(x, y)
            if config.train == "interleaved":
                trainer.end_request()
            elif (i + 1) % config.interval == 0:
                trainer.update()
        if trainer.fresh:
            trainer.update()
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(paths[name]))
        heads[name], scores[name] = head.eval(), score.report()
    atomic_write_bytes(scores_path, json.dumps(scores, indent=1).encode())
    return heads, scores


class Prequential:
    """Online (prequential) score of a head: each request's rows are predicted before the head
    trains on them. Reports the head's BCE, the BCE of always predicting the acceptance rate seen
    so far (what a head must beat to be informative), and mean predicted vs observed acceptance
    (calibration: the cost-aware stopping rule multiplies these probabilities)."""

    def __init__(self) -> None:
        self.bce = self.base = self.prob = 0.0
        self.rows = self.accepted = 0

    def add(self, probs: torch.Tensor, labels: torch.Tensor) -> None:
        rate = min(max(self.accepted / self.rows, 1e-3), 1 - 1e-3) if self.rows else 0.5
        bce = torch.nn.functional.binary_cross_entropy
        self.bce += float(bce(probs.clamp(1e-6, 1 - 1e-6), labels, reduction="sum"))
        self.base += float(bce(torch.full_like(labels, rate), labels, reduction="sum"))
        self.prob += float(probs.sum())
        self.rows += len(labels)
        self.accepted += int(labels.sum())

    def report(self) -> dict[str, float]:
        n = max(self.rows, 1)
        return {
            "rows": self.rows,
            "bce": self.bce / n,
            "constant_bce": self.base / n,
            "mean_prob": self.prob / n,
            "accept_rate": self.accepted / n,
        }


def _variants(
    drafter: Any, target: Any, fixed: list[int], confident: list[int], heads: dict[str, Any], k_max: int
) -> dict[str, Any]:
    """Fixed k drafts exactly k tokens a round (the paper's static baseline). Every other row decides
    its length as it drafts: the drafter's confidence alone (stop after a token it gives p < 0.3,
    the engine's default), the hysteresis fallback, and the two heads."""
    pairs = {f"fixed k={k}": drafter.pair(target, k=k, stop_confidence=0.0) for k in fixed}
    pairs |= {f"confidence stop, k≤{k}": drafter.pair(target, k=k, stop_confidence=0.3) for k in confident}
    pairs["fallback (hysteresis)"] = drafter.pair(
        target, k=4, stop_confidence=0.3, adaptive=Hysteresis(k_min=2, k_max=k_max)
    )
    for schedule, head in heads.items():
        pair = drafter.pair(
            target,
            k=4,
            head=HeadConfig(train=None, warmup=0, k_max=k_max, width=head.width, depth=head.depth),
        )
        pair.head.load_state_dict(head.state_dict())
        pairs[f"head ({schedule})"] = pair
    return pairs


def against_best_fixed(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each adaptive row against the fastest fixed-k row, paired per prompt (`paired_ratio`)."""
    fixed = [r for r in rows if r["variant"].startswith("fixed k=")]
    if not fixed:
        return {}
    best = max(fixed, key=lambda r: r["speedup"])
    return {
        "best_fixed": best["variant"],
        "adaptive": {
            r["variant"]: paired_ratio(r["prompt_s"], best["prompt_s"])
            for r in rows
            if not r["variant"].startswith("fixed k=")
        },
    }


def run_draft_policies(
    drafter: Any,
    target: Any,
    *,
    dataset: str,
    train: str,
    n: int,
    n_train: int,
    max_new_tokens: int,
    train_tokens: int,
    fixed: list[int],
    k_max: int,
    cache: Path,
    confident: Sequence[int] = (),
    train_only: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any] | None:
    """Rows: variant -> acceptance, τ, tokens/s, speedup over the target alone, identical count;
    and each adaptive variant against the best fixed k, paired per prompt.
    `train_only` stops after training (and caching) the heads: that part needs no idle machine."""
    configs = {
        "joint": HeadConfig(train="joint", k_max=k_max, interval=1, steps=5),
        "interleaved": HeadConfig(train="interleaved", k_max=k_max, interval=4, steps=10),
    }
    heads, scores = train_heads(drafter, target, train, n_train, train_tokens, cache, configs, progress)
    if train_only:
        return None
    pairs = _variants(drafter, target, fixed, list(confident), heads, k_max)
    result = compare_pairings(pairs, load_prompts(dataset, n), max_new_tokens, progress)
    return {
        "dataset": dataset,
        "train": train,
        "n_train": n_train,
        "max_new_tokens": max_new_tokens,
        "head_scores": scores,
        **result,
        "against_best_fixed": against_best_fixed(result["rows"]),
    }


def write_draft_report(results: list[dict[str, Any]], out: Path, name: str) -> str:
    table = (
        "| pair | dataset | variant | acceptance | τ | drafted/round | tok/s | speedup vs target | identical "
        "|\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    for res in results:
        for r in res["rows"]:
            table += (
                f"| {res['pair']} | {res['dataset']} | {r['variant']} | {r['acceptance_rate']:.3f} | "
                f"{r['tau']:.2f} | "
                f"{r['drafted_per_round']:.1f} | {r['tok_s']:.2f} | {r['speedup']:.2f}× | "
                f"{r['identical']}/{r['prompts']} |\n"
            )
    table += (
        "\nEach adaptive policy against the best fixed k, paired per prompt (geometric mean of the fixed "
        "run's time over the policy's, 95% interval; above 1 = the policy is faster):\n\n"
        "| pair | dataset | best fixed | policy | time ratio | 95% interval | prompts faster |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    for res in results:
        versus = res.get("against_best_fixed") or {}
        for variant, c in versus.get("adaptive", {}).items():
            table += (
                f"| {res['pair']} | {res['dataset']} | {versus['best_fixed']} | {variant} | {c['ratio']:.3f} "
                "| "
                f"{c['low']:.3f}–{c['high']:.3f} | {c['wins']}/{c['prompts']} |\n"
            )
    table += (
        "\nHeads scored online on their training stream (each request predicted before training on it):\n\n"
        "| pair | dataset | head | rows | BCE | BCE of the mean rate | mean predicted p | acceptance |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    for res in results:
        for schedule, sc in res.get("head_scores", {}).items():
            table += (
                f"| {res['pair']} | {res['dataset']} | {schedule} | {sc['rows']} | {sc['bce']:.3f} | "
                f"{sc['constant_bce']:.3f} | {sc['mean_prob']:.3f} | {sc['accept_rate']:.3f} |\n"
            )
    atomic_write_bytes(out / f"{name}.json", json.dumps(results, indent=1).encode())
    atomic_write_bytes(out / f"{name}.md", table.encode())
    return table
