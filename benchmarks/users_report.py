"""The report of `python -m benchmarks users` (benchmarks/users.py): its rows, costs and live timings
as markdown tables, and a PNG of acceptance against each user's requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["markdown", "plot"]


def markdown(result: dict[str, Any]) -> str:
    """The rows as tables: per user, acceptance / tau by adapter kind and requests; the costs."""
    lines = [
        f"# Per-user adapters: {result['pair']}, {result['n_train']} requests a user, "
        f"{result['n_test']} held back, {result['max_new_tokens']} tokens, k {result['k']}",
        "",
        "| user | adapter | requests | acceptance | tau |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        user, kind, n = row["user"], row["adapter"], row["requests"]
        lines.append(f"| {user} | {kind} | {n} | {row['acceptance']:.3f} | {row['tau']:.2f} |")
    lines += [
        "",
        "| adapter | train s / request | train ms / token | steps | adapter bytes |",
        "|---|---|---|---|---|",
    ]
    for label, c in result["costs"].items():
        lines.append(
            f"| {label} | {c['train_s_per_request']:.2f} | {c['train_ms_per_token']:.1f} | {c['steps']} | "
            f"{c['adapter_bytes']:,} |"
        )
    lines += ["", f"Peak RSS of the run: {result['peak_rss_mb']:.0f} MB."]
    if "federated_bytes_sent_per_round" in result:
        lines.append(f"Federated: {result['federated_bytes_sent_per_round']:,} bytes sent a device a round.")
    if "live" in result:
        live = result["live"]
        lines += [
            "",
            f"Live on {live['engine']}, {live['tokens']} tokens a request, each user's held-back requests:",
            "",
            "| user | run | tok/s | over the engine alone | worst request | over no adapter | identical |",
            "|---|---|---|---|---|---|---|",
        ]
        for user, figures in live["users"].items():
            for s in figures["summary"]:
                lines.append(
                    f"| {user} | {s['row']} | {s['tok_s']:.1f} | {s['speedup']:.2f}x | {s['worst']:.2f}x | "
                    f"{s['over_none']:.2f}x | {s['identical']}/{s['prompts']} |"
                )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Acceptance against the user's requests: a line per user and adapter kind ("none" at 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, user in enumerate(result["users"]):  # a colour per user, a line style per adapter kind
        start = next(r["acceptance"] for r in result["rows"] if r["user"] == user and r["adapter"] == "none")
        kinds = (("own", "-"), ("shared", "--"), ("own from shared", ":"), ("federated", "-."))
        for kind, style in (*kinds, ("federated + own", (0, (3, 1, 1, 1)))):
            points = ([] if kind == "own from shared" else [(0, start)]) + [
                (r["requests"], r["acceptance"])
                for r in result["rows"]
                if r["user"] == user and r["adapter"] == kind
            ]
            if len(points) > 1:  # (a kind this run did not measure has only the start)
                xs, ys = zip(*points)
                ax.plot(xs, ys, linestyle=style, color=f"C{i}", marker="o", label=f"{user}, {kind}")
    ax.set_xlabel("the user's requests learned from")
    ax.set_ylabel("greedy acceptance on the user's held-back requests")
    ax.set_title(result["pair"])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
