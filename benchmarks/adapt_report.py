"""The report of `python -m benchmarks adapt` (benchmarks/adapt.py): its result as JSON, markdown
tables and a PNG of the held-out curves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omnidraft.store.atomic import atomic_write_bytes

FULL = frozenset({"full", "full-spans"})  # variants that fine-tune every weight instead of a LoRA adapter
NO_GAIN = 0.01  # τ: a full cache gaining less than this has no gain to share out

__all__ = ["markdown", "write_report"]


def write_report(out: Path, name: str, result: dict[str, Any]) -> None:
    """`name`.json (the result as measured), .md (its tables) and .png (its curves) under `out`, each
    atomically."""
    atomic_write_bytes(out / f"{name}.json", json.dumps(result, indent=1).encode())
    atomic_write_bytes(out / f"{name}.md", markdown(result).encode())
    _plot(result, out / f"{name}.png")


def _schedule(cfg: dict[str, Any]) -> str:
    if not cfg.get("decay_steps"):
        return f"{cfg['lr']} (constant)"
    return f"{cfg['lr']} → {cfg['lr'] * cfg['final_lr_ratio']:.2g} (cosine over {cfg['decay_steps']} steps)"


def _lengths(result: dict[str, Any]) -> str:
    train, held_out = result["max_new_tokens"], result.get("eval_max_new_tokens", result["max_new_tokens"])
    return (
        f"{train} tokens"
        if train == held_out
        else f"{train} tokens a training prompt, {held_out} a held-out one"
    )


def _full_lr(result: dict[str, Any]) -> str:
    rates = {v["lr"] for name, v in result["variants"].items() if name in FULL and "lr" in v}
    return f" Full fine-tuning at lr {', '.join(map(str, sorted(rates)))}." if rates else ""


def markdown(result: dict[str, Any]) -> str:
    base, cfg = result["baseline"], result["config"]
    precision = result.get("drafter_precision", "int8")  # (results before 2026-11-25: int8, trained on fp32)
    through = (
        "its int8 weights"
        if precision == "int8" and result.get("train_weights") == "drafting"
        else "fp32 weights"
    )
    lines = [
        f"# {result['pair']}: train {result['train']} ({result['n_train']} prompts), held-out "
        f"{result['eval']} "
        f"({result['n_eval']} prompts), {_lengths(result)}, k={result['k']}, "
        f"{precision} drafter trained through {through}\n",
        f"Training: lr {_schedule(cfg)}, λ {cfg['lam']}, rank {result['rank']} on "
        f"{'/'.join(result.get('modules', []))}; "
        f"spans also weighs an NLL on the committed direct tokens by {cfg.get('direct_nll', 0.0)} "
        "(the paper's dm, hybrid and full: 0)." + _full_lr(result) + "\n",
        "| variant | steps | acceptance | Δ acceptance | τ | Δ τ | n-gram/round |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in result["variants"].items():
        f = v["final"]
        lines.append(
            f"| {name} | {f['step']} | {f['acceptance_rate']:.3f} | "
            f"{f['acceptance_rate'] - base['acceptance_rate']:+.3f} | "
            f"{f['tau']:.2f} | {f['tau'] / base['tau'] - 1:+.1%} | {f['ngram_hits_per_round']:.2f} |"
        )
    if "baseline_fixed_k" in result:
        fixed = result["baseline_fixed_k"]
        lines += [
            "",
            f"Same drafters at a fixed draft length (k={result['k']}, no early stop: the paper's setting):",
            "",
            "| variant | acceptance | Δ acceptance | τ | Δ τ |",
            "|---|---|---|---|---|",
        ]
        for name, v in result["variants"].items():
            if "fixed_k" in v:
                f = v["fixed_k"]
                lines.append(
                    f"| {name} | {f['acceptance_rate']:.3f} | "
                    f"{f['acceptance_rate'] - fixed['acceptance_rate']:+.3f} | "
                    f"{f['tau']:.2f} | {f['tau'] / fixed['tau'] - 1:+.1%} |"
                )
    for name, v in result["variants"].items():
        if "profile" in v:
            p = v["profile"]
            lines.append(
                f"\n{name}: profile {p['disk_bytes'] / 2**20:.2f} MB on disk (adapter, metadata, empty "
                "cache); "
                f"adapter {p['adapter_ram_bytes'] / 2**20:.2f} MB in RAM"
            )
        if "through_lora" in v:
            t = v["through_lora"]
            lines.append(
                f"\n{name}, drafting through peft's LoRA layers instead of merged (distill/merged.py): "
                f"acceptance {t['acceptance_rate']:.3f}, τ {t['tau']:.2f} (merged: "
                f"{v['final']['acceptance_rate']:.3f}, {v['final']['tau']:.2f})"
            )
    lines += _agreement_table(result) + _tts_table(result) + _live_table(result)
    for row in result.get("cache_ablation", []):
        if row is result["cache_ablation"][0]:
            lines += [
                "",
                'n-gram cache ("ngram" translation, unadapted drafter):',
                "",
                "| cache | policy | τ | n-gram/round | cache KB | share of the full cache's τ gain |",
                "|---|---|---|---|---|---|",
            ]
        lines.append(
            f"| {row['cache']} | {row.get('policy', '–')} | {row['tau']:.3f} | "
            f"{row['ngram_hits_per_round']:.3f} | "
            f"{row.get('ngram_bytes', 0) / 1024:.0f} | {_share(row.get('gain_kept'))} |"
        )
    if result.get("cache_ablation") and result["cache_ablation"][1].get("gain_kept") is None:
        lines.append(
            f"\nThe full cache gains less than {NO_GAIN} τ on these prompts, so no share of its gain is "
            "reported."
        )
    return "\n".join(lines) + "\n"


def _agreement_table(result: dict[str, Any]) -> list[str]:
    before = result.get("agreement")
    after = {
        name: v["agreement"]
        for name, v in result["variants"].items()
        if v.get("agreement") and name != "none"
    }
    if not before:
        return []
    lines = [
        "",
        "Teacher-forced top-1 agreement with the target at direct positions, by the target's margin "
        "(top-1 minus top-2 log-probability, nats):",
        "",
        "| " + " | ".join(["margin", "share of positions", "before", *after]) + " |",
        "|---|---|---|" + "---|" * len(after),
    ]
    total = before[-1]["positions"] or 1
    for i, row in enumerate(before):
        cells = [_rate(row["agreement"])] + [_rate(rows[i]["agreement"]) for rows in after.values()]
        lines.append(f"| {row['margin']} | {row['positions'] / total:.1%} | " + " | ".join(cells) + " |")
    return lines


def _tts_table(result: dict[str, Any]) -> list[str]:
    tts = result.get("tts")
    if not tts:
        return []
    lines = [
        "",
        f"Test-Time Speculation: a fast Adam step (lr {tts['lr']}) every {tts['every']} rounds on what the "
        "running "
        "request has verified, undone when it ends (the unadapted drafter on a fresh adapter):",
        "",
        "| variant | draft length | acceptance: without | with | τ: without | with | fast steps a request | "
        "s a step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in result["variants"].items():
        for setting, w in v.get("tts", {}).items():
            r = (
                v.get("fixed_k", v["final"]) if setting == "fixed k" else v["final"]
            )  # (no early stop: final is fixed k)
            steps = w.get("tts_steps", 0)  # (results before the step timer: no cost columns)
            cost = f"{steps / result['n_eval']:.1f} | {w['tts_seconds'] / steps:.2f}" if steps else "– | –"
            lines.append(
                f"| {name} | {setting} | {r['acceptance_rate']:.3f} | {w['acceptance_rate']:.3f} | "
                f"{r['tau']:.2f} | "
                f"{w['tau']:.2f} ({w['tau'] / r['tau'] - 1:+.1%}) | {cost} |"
            )
    return lines


def _live_table(result: dict[str, Any]) -> list[str]:
    live = result.get("live")
    if not live:
        return []
    lines = [
        "",
        f"Live check: the first {live['prompts']} held-out prompts verified by the target itself, beside "
        "replay of "
        "its recording:",
        "",
        "| variant | draft length | acceptance: replay | live | τ: replay | live | live output = recording |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, settings in live["variants"].items():
        for setting, v in settings.items():
            r, w = v["replay"], v["live"]
            lines.append(
                f"| {name} | {setting} | {r['acceptance_rate']:.3f} | {w['acceptance_rate']:.3f} | "
                f"{r['tau']:.2f} | "
                f"{w['tau']:.2f} | {w['same_as_recorded']}/{live['prompts']} |"
            )
    return lines


def _rate(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _share(kept: float | None) -> str:
    return "–" if kept is None else f"{kept:.0%}"


def _plot(result: dict[str, Any], path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, label in zip(
        axes,
        ("acceptance_rate", "tau", "ngram_hits_per_round"),
        ("acceptance rate", "τ (tokens per target forward)", "n-gram hits per round"),
    ):
        for name, v in result["variants"].items():
            ax.plot([p["step"] for p in v["curve"]], [p[key] for p in v["curve"]], marker="o", label=name)
        ax.set_xlabel("optimizer steps")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{result['pair']} held-out {result['eval']}")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
