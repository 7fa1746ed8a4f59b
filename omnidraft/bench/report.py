"""Write a benchmark's results: JSON (everything), a markdown table, and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..store.atomic import atomic_write_bytes

__all__ = ["gap_table", "markdown_table", "write_report"]

COLUMNS = [
    ("pair", "pair", "{}"),
    ("dataset", "dataset", "{}"),
    ("n", "prompts", "{}"),
    ("accept", "acceptance_rate", "{:.2f}"),
    ("τ", "mean_accepted_length", "{:.2f}"),
    ("drafted/round", "drafted_per_round", "{:.2f}"),
    ("rounds drafting", "speculating", "{:.0%}"),
    ("n-gram/round", "ngram_hits_per_round", "{:.2f}"),
    ("omnidraft tok/s", "omnidraft_tok_s", "{:.2f}"),
    ("target alone tok/s", "target_tok_s", "{:.2f}"),
    ("omnidraft speedup", "speedup", "{:.2f}×"),
    ("worst request", "worst_speedup", "{:.2f}×"),
    ("stock-kernel HF", "stock_speedup", "{:.2f}×"),
    ("prompt lookup", "lookup_speedup", "{:.2f}×"),
    ("HF assisted", "assisted_speedup", "{:.2f}×"),
    ("HF assisted τ", "assisted_tau", "{:.2f}"),
    ("identical", "identical_rate", "{:.0%}"),
    ("translate+resync", "bookkeeping", "{:.2%}"),
]
NOTE = (
    "Speedups are over the target alone: the same model object on the kernels measured fastest on this "
    "machine "
    "(`omnidraft doctor`), HF generate, greedy, in the same run. Peer rows run on that same model object: "
    "stock-kernel HF is it on stock F.linear; prompt lookup is HF's `prompt_lookup_num_tokens=10`.\n"
)


def _cell(fmt: str, value: Any) -> str:
    return "–" if value is None else fmt.format(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One line per (pair, dataset) summary."""
    head = "| " + " | ".join(c[0] for c in COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    body = ""
    for row in rows:
        row = {**row, "bookkeeping": row["time_split"]["translate"] + row["time_split"]["resync"]}
        body += "| " + " | ".join(_cell(fmt, row.get(key)) for _, key, fmt in COLUMNS) + " |\n"
    return NOTE + "\n" + head + body


def gap_table(rows: list[dict[str, Any]]) -> str:
    """Where each pairing's time per committed token goes, and the speedup at its τ if one part
    cost nothing more: drafting free (the drafter's step is the lever), or each verify as cheap as
    one target step (the target's multi-token verify is). docs/benchmarks.md reads it."""
    head = (
        "| pair | dataset | target step ms | τ | ms/token | drafting | verifying | other | speedup | "
        "free drafts | 1-step verify |\n|" + "---|" * 11 + "\n"
    )
    body = ""
    for row in rows:
        step, per_token, tau = (
            1000 / row["target_tok_s"],
            1000 / row["omnidraft_tok_s"],
            row["mean_accepted_length"],
        )
        split = row["time_split"]
        draft, verify = split["draft"] * per_token, split["verify"] * per_token
        other = per_token - draft - verify
        body += (
            f"| {row['pair']} | {row['dataset']} | {step:.0f} | {tau:.2f} | {per_token:.0f} | {draft:.0f} | "
            f"{verify:.0f} | {other:.0f} | {step / per_token:.2f}× | {step / (per_token - draft):.2f}× | "
            f"{step / (draft + other + step / tau):.2f}× |\n"
        )
    return head + body


def write_report(
    out_dir: str | Path, name: str, summaries: list[dict[str, Any]], per_prompt: dict[str, Any]
) -> dict[str, Path]:
    """Write `name`.json, `name`.md and `name`.png under `out_dir`; return their paths."""
    out = Path(out_dir)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md", "png": out / f"{name}.png"}
    doc = {"summaries": summaries, "per_prompt": per_prompt}
    atomic_write_bytes(paths["json"], json.dumps(doc, indent=1).encode())
    gap = "\n## Where the time per committed token goes\n\n" + gap_table(summaries)
    atomic_write_bytes(paths["md"], (markdown_table(summaries) + gap).encode())
    _plot(summaries, paths["png"])
    return paths


def _plot(summaries: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{s['pair'].split(':')[1]}\n{s['dataset']}" for s in summaries]
    x = range(len(summaries))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(summaries)), 4))
    width = 0.38
    ax1.bar([i - width / 2 for i in x], [s["speedup"] for s in summaries], width, label="omnidraft")
    ax1.bar(
        [i + width / 2 for i in x],
        [s.get("assisted_speedup") or 0 for s in summaries],
        width,
        label="HF assisted",
    )
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set_ylabel("speedup vs target alone (wall clock)")
    ax2.bar(
        [i - width / 2 for i in x], [s["mean_accepted_length"] for s in summaries], width, label="omnidraft"
    )
    ax2.bar(
        [i + width / 2 for i in x],
        [s.get("assisted_tau") or 0 for s in summaries],
        width,
        label="HF assisted",
    )
    ax2.set_ylabel("τ: tokens per target forward")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
