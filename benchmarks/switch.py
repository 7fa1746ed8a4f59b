"""Moving one drafter between targets: what `drafter.pair(other_target)` costs in time and memory.

The pairing-profile promise (issue 3): the base drafter's weights are loaded once and shared by
every target; a pairing adds only its LoRA adapter, n-gram cache and vocabulary map, and moving
between pairings takes milliseconds. This module measures that on real models, with learning on:
each pairing's first request is also checked token for token against the target alone, so the
figures are of pairings that work. It is not a decoding-speed benchmark (see runner.py) and it
makes no claim about acceptance (see adapt.py).

Memory is read as the process's resident set (Linux `/proc/self/status`), so it includes what
torch's allocator keeps: read its deltas as "about", the adapter and base byte counts as exact.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from omnidraft.bench.baselines import target_alone
from omnidraft.distill.adapters import adapter_state
from omnidraft.distill.trainer import TrainConfig
from omnidraft.store.profiles import ProfileStore
from omnidraft.translate.vocab_map import build_vocab_map

__all__ = ["markdown", "rss_bytes", "run_switch_bench"]

MB = 2**20


def rss_bytes() -> int | None:
    """Resident set size of this process, or None where /proc is not there to ask."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _seconds(fn: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def _delta(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


def _tensor_bytes(values: Any) -> int:
    """Bytes of the tensors among `values`, looking into tuples (an int8 linear's state holds its
    packed weight and bias as one); dtypes and other entries count nothing."""
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, (tuple, list)):
            total += _tensor_bytes(v)
    return total


def _first_request(
    drafter: Any,
    target: Any,
    store: ProfileStore,
    user: str,
    prompt: str,
    max_new_tokens: int,
    train: TrainConfig,
) -> tuple[Any, dict[str, Any]]:
    """Pair with `target` for the first time, learning; one request; save. Returns (pairing, row)."""
    rss0 = rss_bytes()
    vmap_s = _seconds(
        lambda: build_vocab_map(drafter.token_bytes, target.token_bytes, drafter.tokenizer, target.tokenizer)
    )[1]
    pair, pair_s = _seconds(lambda: drafter.pair(target, user=user, learn=True, train=train, store=store))
    rss1 = rss_bytes()
    out = pair.generate(prompt, max_new_tokens=max_new_tokens)  # interval 1: the request ends in an update
    pair.learner.wait()
    rss2 = rss_bytes()
    home, save_s = _seconds(pair.save)
    return pair, {
        "target": target.name,
        "vocab_map_s": vmap_s,
        "first_pair_s": pair_s,
        "save_s": save_s,
        "identical": out.token_ids == target_alone(target, prompt, max_new_tokens).token_ids,
        "updates": pair.learner.steps,
        "ngram_entries": len(pair.speculator.translator.cache),
        "adapter_bytes": _tensor_bytes(adapter_state(drafter.trainable, pair.adapter).values()),
        "profile_disk_bytes": sum(f.stat().st_size for f in Path(home).rglob("*") if f.is_file()),
        "rss_pair_bytes": _delta(rss1, rss0),
        "rss_first_request_bytes": _delta(rss2, rss1),
    }


def run_switch_bench(
    drafter: Any,
    targets: list[Any],
    *,
    prompts: list[str],
    max_new_tokens: int = 24,
    user: str = "bench",
    store: ProfileStore,
    repeats: int = 200,
) -> dict[str, Any]:
    """Pair `drafter` with each of `targets` (≥ 2) in turn, then move between the pairings.

    Per target: the first `pair(..., learn=True)` (the first one of an int8 drafter also loads its
    fp32 base, which every later adapter shares), one learning request on `prompts[0]` checked
    against the target alone, an atomic save. Then: `activate` between the adapters `repeats`
    times; `pair()` again from the saved profiles (what a restarted app does); and one request per
    pairing on every other prompt, alternating targets, each checked against the target alone.
    `store`: where the profiles go (a scratch directory: the bench overwrites user `user`'s).
    """
    if len(targets) < 2:
        raise ValueError(f"switching needs at least two targets, got {len(targets)}")
    if len({t.name for t in targets}) != len(targets):
        raise ValueError(f"targets must differ, got {[t.name for t in targets]}")
    if not prompts or max_new_tokens < 1 or repeats < 1:
        raise ValueError(
            f"need prompts, max_new_tokens >= 1 and repeats >= 1, got {len(prompts)}, "
            f"{max_new_tokens}, {repeats}"
        )
    train = TrainConfig(interval=1, batch_size=1, cpu_share=0)  # every request learned from
    rss_start = rss_bytes()
    pairs, rows = [], []
    for target in targets:
        pair, row = _first_request(drafter, target, store, user, prompts[0], max_new_tokens, train)
        pairs.append(pair)
        rows.append(row)
    names = [p.adapter for p in pairs]
    times = []
    for i in range(repeats):
        times.append(_seconds(lambda i=i: drafter.activate(names[i % len(names)]))[1])
    reloaded = [_seconds(lambda t=t: drafter.pair(t, user=user, store=store))[1] for t in targets]
    identical = [
        pair.generate(prompt, max_new_tokens=max_new_tokens).token_ids
        == target_alone(pair.target, prompt, max_new_tokens).token_ids
        for prompt in prompts[1:]
        for pair in pairs
    ]
    base = drafter.trainable.get_base_model()
    return {
        "drafter": drafter.name,
        "user": user,
        "max_new_tokens": max_new_tokens,
        "rows": rows,
        "base_bytes": _tensor_bytes(p for n, p in base.named_parameters() if "lora_" not in n),
        "drafting_copy_bytes": 0
        if drafter.model is drafter.trainable
        else _tensor_bytes(  # (its LoRA modules are the adapters')
            v for n, v in drafter.model.state_dict().items() if "lora_" not in n
        ),
        "activate_ms": {
            "median": 1000 * statistics.median(times),
            "max": 1000 * max(times),
            "repeats": repeats,
        },
        "repair_from_profile_s": dict(zip([t.name for t in targets], reloaded)),
        "alternating_identical": f"{sum(identical)}/{len(identical)}",
        "rss_total_bytes": _delta(rss_bytes(), rss_start),
    }


def _mb(value: int | None) -> str:
    return "–" if value is None else f"{value / MB:.1f} MB"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# {result['drafter']}: one drafter, {len(result['rows'])} pairings (user {result['user']!r}, "
        "learning on)\n",
        "| target | vocab map | first pair() | save | first request = target alone | updates | adapter | "
        "profile on disk | RSS: pair() | RSS: first learning request |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['target']} | {1000 * r['vocab_map_s']:.0f} ms | {1000 * r['first_pair_s']:.0f} ms | "
            f"{1000 * r['save_s']:.0f} ms | {'yes' if r['identical'] else 'NO'} | {r['updates']} | "
            f"{_mb(r['adapter_bytes'])} | {_mb(r['profile_disk_bytes'])} | {_mb(r['rss_pair_bytes'])} | "
            f"{_mb(r['rss_first_request_bytes'])} |"
        )
    a = result["activate_ms"]
    lines += [
        "",
        f"Switching the active adapter (`activate`, what a request of the other pairing does first): "
        f"median {a['median']:.2f} ms, at most {a['max']:.2f} ms over {a['repeats']} switches.",
        "`pair()` again from the saved profile (the adapter already on the drafter, the vocabulary map and "
        "healer shared; profile read from disk): "
        + ", ".join(f"{name} {1000 * s:.0f} ms" for name, s in result["repair_from_profile_s"].items())
        + ".",
        "Requests alternating between the pairings, each equal to the target alone: "
        f"{result['alternating_identical']}.",
        f"Shared by every pairing: the base weights, {_mb(result['base_bytes'])} fp32"
        + (
            f", and the int8 drafting copy, {_mb(result['drafting_copy_bytes'])}"
            if result["drafting_copy_bytes"]
            else ""
        )
        + f". Process RSS grew {_mb(result['rss_total_bytes'])} over the whole run (every pairing, its "
        "optimizer state and the targets' KV caches included).",
    ]
    return "\n".join(lines) + "\n"
