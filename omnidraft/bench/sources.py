"""Where drafts come from, measured: the drafter model only, retrieval only and the hybrid (the
default), beside the target alone and the peers (HF prompt lookup, HF assisted generation), per
workload, in one process (`compare_pairings`); optionally the hybrid under relaxed verification,
a LOSSY row, with its quality cost (outputs identical to the target's, ROUGE-L against them).
docs/retrieval.md has the figures and the command.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from .runner import compare_pairings, paired_ratio

if TYPE_CHECKING:
    from ..draft.base import Drafter
    from ..target import Target

__all__ = ["RELAXED_ROW", "hybrid_against", "markdown", "run_sources"]

RELAXED_ROW = "omnidraft hybrid, relaxed (LOSSY)"


def run_sources(
    drafter: Drafter,
    target: Target,
    workloads: dict[str, list[str]],
    max_new_tokens: int,
    *,
    drafts: tuple[str, ...] = ("model", "retrieval", "hybrid"),
    peers: tuple[str, ...] = ("lookup", "assisted"),
    progress: Callable[[str], object] = lambda _: None,
    **config: Any,
) -> dict[str, Any]:
    """Per workload (its name: its prompts), fresh pairings (one per `drafts` value, `config` passed
    on; "relaxed": the hybrid under relaxed-lossy verification, a LOSSY row) so that each
    workload's costs and acceptance are measured on it alone, and the hybrid's paired ratios
    (`hybrid_against`)."""
    n = max(map(len, workloads.values()), default=0)
    out: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": n, "datasets": {}}
    for dataset, prompts in workloads.items():
        pairs = {}
        for d in drafts:
            if d == "relaxed":
                pairs[RELAXED_ROW] = drafter.pair(target, drafts="hybrid", mode="relaxed-lossy", **config)
            else:
                pairs[f"omnidraft {d}"] = drafter.pair(target, drafts=d, **config)
        result = compare_pairings(
            pairs, prompts, max_new_tokens, progress=partial(_prefixed, progress, dataset), peers=peers
        )
        result.update(hybrid_against(result["rows"]))
        out["datasets"][dataset] = result
    return out


def hybrid_against(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The hybrid row's paired ratios (above 1: the hybrid faster): `hybrid_vs_model` against model
    drafts only, and `hybrid_vs_best` against the fastest other row by tok/s, peers included
    (`best_other` names it). Lossy rows are not rivals. Empty without a hybrid row."""
    by_name = {r["variant"]: r for r in rows}
    hybrid = by_name.get("omnidraft hybrid")
    if hybrid is None:
        return {}
    out: dict[str, Any] = {}
    if "omnidraft model" in by_name:
        out["hybrid_vs_model"] = paired_ratio(hybrid["prompt_s"], by_name["omnidraft model"]["prompt_s"])
    rivals = [r for r in rows if r is not hybrid and r["variant"] != RELAXED_ROW]
    if rivals:
        best = max(rivals, key=lambda r: r["tok_s"])
        out["best_other"] = best.get("label", best["variant"])
        out["hybrid_vs_best"] = paired_ratio(hybrid["prompt_s"], best["prompt_s"])
    return out


def markdown(result: dict[str, Any]) -> str:
    """One table per dataset: speedup over the target alone, τ, retrieved share, identical outputs."""
    lines = []
    for dataset, res in result["datasets"].items():
        lines += [
            f"### {dataset} (target alone {res['target_tok_s']:.2f} tok/s)",
            "",
            "| row | speedup | tok/s | τ | retrieved | identical | ROUGE-L vs target |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in res["rows"]:
            retrieved = f"{r['retrieved_share']:.0%}" if "retrieved_share" in r else "-"
            lines.append(
                f"| {r.get('label', r['variant'])} "
                f"| {r['speedup']:.2f}× | {r['tok_s']:.2f} | {r['tau']:.2f} | {retrieved} "  # speed
                f"| {r['identical']}/{r['prompts']} | {r.get('rouge_l', float('nan')):.3f} |"  # output
            )
        paired = [
            (f"hybrid vs {what}", res[key])
            for key, what in (
                ("hybrid_vs_model", "model drafts"),
                ("hybrid_vs_best", f"the fastest other row ({res.get('best_other')})"),
            )
            if key in res
        ]
        lines += [""] * bool(paired) + [
            f"{name}, paired: {h['ratio']:.3f}× [{h['low']:.3f}, {h['high']:.3f}], "
            f"faster on {h['wins']}/{h['prompts']} prompts"
            for name, h in paired
        ]
        lines.append("")
    return "\n".join(lines)


def _prefixed(progress: Callable[[str], object], prefix: str, msg: str) -> None:
    progress(f"{prefix} {msg}")
