"""`python -m benchmarks replay`: acceptance of decoding and drafter variants on recorded target traces.

In greedy mode the target's part of every round is fixed by its recorded continuation
(distill/trace_store.py), so each variant runs the whole engine against a `ReplayTarget`: exact
greedy acceptance, τ and draft lengths with drafter forwards only, minutes instead of hours.
It times each drafter scheme alone (ms per drafted token, `benchmarks.drafters`), not the variants end
to end: confirm a variant that wins here with `omnidraft bench`.

Variants are a drafter numeric scheme (`SCHEMES`) times a set of `DecodeConfig` overrides
("heal=off,k=8"). Used to choose the engine's defaults: token healing (translate/healing.py) and
int8 drafting with per-channel weights and smoothed MLPs (int8.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from omnidraft.bench.datasets import load_prompts
from omnidraft.decode.stats import GenerationStats
from omnidraft.distill.trace_store import ReplayTarget
from omnidraft.runtime.backends import draft_ms
from omnidraft.store.atomic import atomic_write_bytes

from .adapt_eval import prompts_for, traces_for

__all__ = ["SCHEMES", "parse_decode", "replay_variant", "run_replay"]

SCHEMES = (
    "fp32",
    "int8",
    "int8-per-channel",
    "int8-per-tensor",
)  # int8: the default (per-channel, MLPs smoothed)
_KEYS = {"k": int, "stop": float, "heal": bool, "strategy": str}


def parse_decode(text: str) -> dict[str, Any]:
    """ "heal=off,k=8" -> DecodeConfig overrides. Keys: k, stop (stop_confidence), heal (on/off), strategy."""
    overrides: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in _KEYS:
            raise ValueError(f"decode variant item {item!r} is not KEY=VALUE with KEY one of {sorted(_KEYS)}")
        if _KEYS[key] is bool:
            if value not in ("on", "off"):
                raise ValueError(f"{key} takes on or off, got {value!r}")
            overrides[key] = value == "on"
        else:
            overrides[key] = _KEYS[key](value)
    if "stop" in overrides:
        overrides["stop_confidence"] = overrides.pop("stop")
    return overrides


def drafter_for(scheme: str, fp32: Any) -> Any:
    """A Drafter of the loaded fp32 drafter model under `scheme` (the model itself for fp32)."""
    from omnidraft.draft.torch_drafter import TorchDrafter as Drafter
    from omnidraft.runtime.int8 import quantize_int8

    if scheme not in SCHEMES:
        raise ValueError(f"unknown drafter scheme {scheme!r}; use one of {SCHEMES}")
    model = fp32.model
    if scheme == "int8":
        model = quantize_int8(model, fp32.tokenizer)
    elif scheme == "int8-per-channel":
        model = quantize_int8(model)
    elif scheme == "int8-per-tensor":
        model = quantize_int8(model, per_channel=False)
    return Drafter(model, fp32.tokenizer, fp32.name)


def replay_variant(
    drafter: Any, replay: ReplayTarget, traces: list[Any], prompts: list[str], overrides: dict[str, Any]
) -> dict[str, float]:
    """Acceptance rate, τ, share of rounds whose first proposal is accepted, drafted tokens per
    round and n-gram hits per round of one variant; checks every output against its trace."""
    pair = drafter.pair(replay, **overrides)
    rounds, tokens, identical, started = [], 0, 0, time.perf_counter()
    for trace, prompt in zip(traces, prompts):
        out = pair.generate(prompt, max_new_tokens=max(1, len(trace.continuation) - 1))
        identical += out.token_ids == trace.continuation[: len(out.token_ids)]
        rounds += out.rounds
        tokens += len(out.token_ids)
    s = GenerationStats.from_rounds(rounds, tokens, time.perf_counter() - started)
    return {
        "acceptance_rate": s.acceptance_rate,
        "tau": s.mean_accepted_length,
        "first_accepted": sum(r.accepted > 0 for r in rounds) / max(1, len(rounds)),
        "drafted_per_round": sum(r.drafted for r in rounds) / max(1, len(rounds)),
        "ngram_hits_per_round": s.ngram_hits_per_round,
        "rounds": len(rounds),
        "prompts": len(traces),
        "identical": identical,
        "seconds": time.perf_counter() - started,
    }


def run_replay(
    drafter_spec: str,
    target: Any,
    *,
    datasets: list[str],
    n: int,
    max_new_tokens: int,
    schemes: list[str],
    decodes: list[str],
    base: dict[str, Any],
    cache: Path,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every (dataset, scheme, decode variant) on the first `n` traces of each dataset."""
    from omnidraft.store.models import load_model

    fp32 = load_model(drafter_spec)
    drafters = {scheme: drafter_for(scheme, fp32) for scheme in schemes}
    ids = fp32.tokenizer(" ".join(load_prompts("humaneval", 3)))["input_ids"][:200]
    costs = {}
    for scheme, drafter in drafters.items():  # timed first, while nothing else of this run competes
        progress(f"timing {scheme}")
        costs[scheme] = draft_ms(drafter, ids)
    rows = []
    for dataset in datasets:
        traces = traces_for(target, dataset, n, max_new_tokens, cache)
        prompts = prompts_for(target, dataset, traces)
        replay = ReplayTarget.like(target, traces)
        for scheme, drafter in drafters.items():
            for decode in decodes:
                progress(f"{dataset} {scheme} {decode or 'defaults'}")
                row = replay_variant(drafter, replay, traces, prompts, {**base, **parse_decode(decode)})
                rows.append({"dataset": dataset, "drafter": scheme, "decode": decode or "defaults", **row})
    return {
        "pair": f"{fp32.name}:{target.name}",
        "n": n,
        "max_new_tokens": max_new_tokens,
        "base": base,
        "ms_per_token": costs,
        "rows": rows,
    }


def write_replay_report(result: dict[str, Any], out: Path, name: str) -> str:
    table = (
        f"# {result['pair']}: replayed greedy traces, {result['n']} prompts x {result['max_new_tokens']} "
        "tokens "
        f"per dataset, base config {result['base']}\n\n"
        "| drafter | ms per drafted token |\n|---|---|\n"
        + "".join(f"| {scheme} | {ms:.1f} |\n" for scheme, ms in result.get("ms_per_token", {}).items())
        + "\n| dataset | drafter | decode | acceptance | τ | first proposal accepted | drafted/round | "
        "n-gram/round | identical |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    for r in result["rows"]:
        table += (
            f"| {r['dataset']} | {r['drafter']} | {r['decode']} | {r['acceptance_rate']:.3f} | "
            f"{r['tau']:.3f} | "
            f"{r['first_accepted']:.3f} | {r['drafted_per_round']:.2f} | {r['ngram_hits_per_round']:.3f} | "
            f"{r['identical']}/{r['prompts']} |\n"
        )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / f"{name}.json", json.dumps(result, indent=1).encode())
    atomic_write_bytes(out / f"{name}.md", table.encode())
    return table
