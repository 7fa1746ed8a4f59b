"""Where drafts come from, measured: the drafter model only, retrieval only and the hybrid (the
default), beside the target alone and the peers (HF prompt lookup, HF assisted generation), per
workload, in one process (`compare_pairings`); optionally the hybrid under relaxed verification,
a LOSSY row, with its quality cost (outputs identical to the target's, ROUGE-L against them).
docs/retrieval.md has the figures and the command.
"""

from __future__ import annotations

from typing import Any, Callable

from .datasets import load_prompts
from .runner import compare_pairings, paired_ratio

__all__ = ["RELAXED_ROW", "markdown", "run_sources"]

RELAXED_ROW = "omnidraft hybrid, relaxed (LOSSY)"


def run_sources(drafter: Any, target: Any, datasets: list[str], n: int, max_new_tokens: int, *,
                drafts: tuple[str, ...] = ("model", "retrieval", "hybrid"), peers: tuple[str, ...] = ("lookup", "assisted"),
                relaxed: bool = False, progress: Callable[[str], None] = lambda _: None, **config: Any) -> dict[str, Any]:
    """Per dataset, fresh pairings (one per `drafts` value, `config` passed on) so that each
    workload's costs and acceptance are measured on it alone; with both "hybrid" and "model", the
    hybrid's paired ratio against model drafts (above 1: hybrid faster)."""
    out: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": n, "datasets": {}}
    for dataset in datasets:
        pairs = {f"omnidraft {d}": drafter.pair(target, drafts=d, **config) for d in drafts}
        if relaxed:
            pairs[RELAXED_ROW] = drafter.pair(target, drafts="hybrid", mode="relaxed-lossy", **config)
        result = compare_pairings(pairs, load_prompts(dataset, n), max_new_tokens,
                                  progress=lambda msg, d=dataset: progress(f"{d} {msg}"), peers=peers)
        rows = {r["variant"]: r for r in result["rows"]}
        if "omnidraft hybrid" in rows and "omnidraft model" in rows:
            result["hybrid_vs_model"] = paired_ratio(rows["omnidraft hybrid"]["prompt_s"], rows["omnidraft model"]["prompt_s"])
        out["datasets"][dataset] = result
    return out


def markdown(result: dict[str, Any]) -> str:
    """One table per dataset: speedup over the target alone, τ, retrieved share, identical outputs."""
    lines = []
    for dataset, res in result["datasets"].items():
        lines += [f"### {dataset} (target alone {res['target_tok_s']:.2f} tok/s)", "",
                  "| row | speedup | tok/s | τ | retrieved | identical | ROUGE-L vs target |", "|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            retrieved = f"{r['retrieved_share']:.0%}" if "retrieved_share" in r else "-"
            lines.append(f"| {r.get('label', r['variant'])} | {r['speedup']:.2f}× | {r['tok_s']:.2f} | {r['tau']:.2f} | "
                         f"{retrieved} | {r['identical']}/{r['prompts']} | {r.get('rouge_l', float('nan')):.3f} |")
        if "hybrid_vs_model" in res:
            h = res["hybrid_vs_model"]
            lines.append(f"\nhybrid vs model drafts, paired: {h['ratio']:.3f}× [{h['low']:.3f}, {h['high']:.3f}], "
                         f"faster on {h['wins']}/{h['prompts']} prompts")
        lines.append("")
    return "\n".join(lines)
