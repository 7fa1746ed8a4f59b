"""`python -m benchmarks drafters`: drafting backends side by side (PyTorch fp32/int8, llama.cpp,
exported ONNX graphs).

1. Drafter cost: ms per drafted token, greedy, after a prompt of about 200 tokens, median of
   `reps` drafts of `tokens` tokens each (the drafter alone, no target).
2. End to end: each drafter paired with the same target over benchmark prompts
   (`compare_pairings`: target alone once per prompt, then every pairing, in one process), so
   speedup, acceptance and τ compare backends on the same machine state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from omnidraft.bench.datasets import load_prompts
from omnidraft.bench.runner import compare_pairings
from omnidraft.runtime.backends import draft_ms
from omnidraft.store.atomic import atomic_write_bytes

__all__ = ["run_drafters"]


def run_drafters(
    drafters: dict[str, Any],
    target: Any,
    *,
    datasets: list[str],
    n: int,
    max_new_tokens: int,
    k: int,
    stop_confidence: float,
    files: dict[str, Path],
    out: Path,
    name: str,
    drafts: str = "model",
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Cost per token and end-to-end rows per drafter; writes `name`.json/.md under `out`. `drafts`:
    the pairings' draft source ("model" by default, so that τ compares the drafters alone)."""
    prompt = " ".join(load_prompts("humaneval", 3))
    result: dict[str, Any] = {
        "target": target.name if target is not None else None,
        "k": k,
        "stop_confidence": stop_confidence,
        "drafts": drafts,
        "costs": [],
        "runs": [],
    }
    for label, drafter in drafters.items():
        progress(f"timing {label}")
        ids = drafter.tokenizer(prompt)["input_ids"][:200]
        size = files[label].stat().st_size if label in files else None
        result["costs"].append(
            {
                "drafter": label,
                "ms_per_token": draft_ms(drafter, ids),
                "file_mb": size / 2**20 if size else None,
            }
        )
    for dataset in datasets:
        pairs = {
            label: d.pair(target, k=k, stop_confidence=stop_confidence, drafts=drafts)
            for label, d in drafters.items()
        }
        for label, pair in pairs.items():  # a row drafts on the backend its label names, never on a copy
            if pair.drafter is not drafters[label]:
                raise ValueError(
                    f"row {label!r} would draft on {type(pair.drafter).__name__}, not the drafter timed"
                )
        heads = {label: getattr(d, "head", None) for label, d in drafters.items()}
        for head in heads.values():
            if head is not None:
                head.support_sizes.clear()
        rows = compare_pairings(pairs, load_prompts(dataset, n), max_new_tokens, progress)
        for row in rows["rows"]:  # a shortlisted head's mean support over the run's drafter calls
            head = heads.get(row["variant"])
            row["support"] = (
                sum(head.support_sizes) / len(head.support_sizes)
                if head is not None and head.support_sizes
                else None
            )
        result["runs"].append({"dataset": dataset, **rows})
        _write(result, out, name)
    _write(result, out, name)
    return result


def markdown(result: dict[str, Any]) -> str:
    title = (
        f"# drafting backends for {result['target']} (k={result['k']}, stop {result['stop_confidence']}, "
        f"{result.get('drafts', 'hybrid')} drafts)"
        if result["target"]
        else "# drafting backends: the drafter alone"
    )
    lines = [title, "", "| drafter | ms per drafted token | file MB |", "|---|---|---|"]
    for c in result["costs"]:
        lines.append(
            f"| {c['drafter']} | {c['ms_per_token']:.1f} | {'%.0f' % c['file_mb'] if c['file_mb'] else '–'} |"
        )
    for run in result["runs"]:
        lines += [
            "",
            f"{run['dataset']}: target alone {run['target_tok_s']:.2f} tok/s",
            "",
            "| drafter | mean support | acceptance | τ | draft ms/token | tok/s | speedup vs target | "
            "identical |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in run["rows"]:
            support = f"{r['support']:.0f}" if r.get("support") else "all"
            lines.append(
                f"| {r['variant']} | {support} | {r['acceptance_rate']:.3f} | {r['tau']:.2f} | "
                f"{r['draft_ms_per_token']:.1f} | {r['tok_s']:.2f} | {r['speedup']:.2f}× | "
                f"{r['identical']}/{r['prompts']} |"
            )
    return "\n".join(lines) + "\n"


def _write(result: dict[str, Any], out: Path, name: str) -> None:
    atomic_write_bytes(out / f"{name}.json", json.dumps(result, indent=1).encode())
    atomic_write_bytes(out / f"{name}.md", markdown(result).encode())
