"""`python -m benchmarks shortlists`: how much agreement with the target each shortlist policy keeps
at each support size, teacher-forced on the target's own greedy outputs (docs/shortlists.md).

Per dataset, the target (on llama.cpp) writes its greedy continuation of each prompt; the drafter
reads prompt + continuation once, and at every continuation position its full head's logits are
compared with its logits restricted to a policy's support. A position agrees when the restricted
argmax is the drafter token that follows in the target's text: the per-token acceptance of a
greedy draft that starts there. On its support a shortlisted head's logits are the full head's
(tests/test_shortlist.py), so one forward serves every policy and size:
- static (FR-Spec): the N most frequent training-corpus tokens (+ the drafter's stop ids);
- evo (EvoSpec): the most frequent N - B plus an LFU buffer of at most B ids recalled from the
  prompt and the text committed before the position;
- dyna (DynaSpec): a core of the most frequent C plus the router's top m clusters of the other
  head rows at that position's hidden state (clusters and router as `shortlist.build` makes them).
Support sizes are the measured mean per position; policies compare at equal size by
interpolating the static curve (in log size).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import torch

from omnidraft.bench.datasets import load_prompts
from omnidraft.store.atomic import atomic_write_bytes

__all__ = ["run_shortlists"]


def _continuations(target_spec: str, prompts: list[str], tokens: int) -> list[str]:
    import omnidraft as od

    target = od.LlamaCppTarget(target_spec)
    out = []
    for prompt in prompts:
        ids = list(target.begin(target.tokenizer(prompt)["input_ids"]).decode(tokens))
        out.append(target.token_bytes.join(ids).decode("utf-8", errors="replace"))
    return out


@torch.inference_mode()
def _forward(
    drafter: Any, prompt: str, continuation: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """(hidden (T, d), full logits (T, V), next ids (T,), context ids) at the continuation's positions."""
    tok = drafter.tokenizer
    start = len(tok(prompt)["input_ids"]) - 1
    ids = tok(prompt + continuation)["input_ids"]
    out = drafter.model(
        input_ids=torch.tensor([ids]), output_hidden_states=True, logits_to_keep=len(ids) - start
    )
    hidden = out.hidden_states[-1][0, start:-1].float()
    return hidden, out.logits[0, :-1].float(), torch.tensor(ids[start + 1 :]), ids[: start + 1]


def _agree(logits: torch.Tensor, nxt: torch.Tensor, support: torch.Tensor | None) -> tuple[int, int]:
    """(positions agreeing, support size summed over positions); `support` (T, V) bool or None."""
    masked = logits if support is None else logits.masked_fill(~support, float("-inf"))
    size = logits.shape[0] * logits.shape[1] if support is None else int(support.sum())
    return int((masked.argmax(-1) == nxt).sum()), size


def _mask(v: int, ids: torch.Tensor) -> torch.Tensor:
    m = torch.zeros(v, dtype=torch.bool)
    m[ids] = True
    return m


def run_shortlists(
    drafter: Any,
    target_spec: str,
    *,
    datasets: list[str],
    n: int,
    tokens: int,
    sizes: list[int],
    buffer: int,
    clusters: int,
    core: int,
    budgets: list[int],
    out: Path,
    name: str,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    from omnidraft.shortlist.build import corpus, frequent_ids, shortlist
    from omnidraft.shortlist.supports import Evo

    v = int(drafter.model.config.vocab_size)
    progress("corpus frequencies")
    ranked = frequent_ids(drafter.tokenizer, drafter.token_bytes, corpus(), v, set(drafter.stop_ids))
    stops = torch.tensor(sorted(drafter.stop_ids), dtype=torch.long)
    progress("clusters and router")
    dyna = shortlist(drafter, "dyna", size=4 * core, clusters=clusters)
    groups = [c.ids if c is not None else torch.empty(0, dtype=torch.long) for c in dyna.clusters]
    dyna_core = _mask(v, dyna.core.ids)
    result: dict[str, Any] = {
        "drafter": drafter.name,
        "target": target_spec,
        "tokens": tokens,
        "n": n,
        "buffer": buffer,
        "clusters": clusters,
        "dyna_core": len(dyna.core.ids),
        "runs": [],
    }
    for dataset in datasets:
        prompts = load_prompts(dataset, n)
        progress(f"{dataset}: target continuations")
        texts = _continuations(target_spec, prompts, tokens)
        tally: dict[str, list[int]] = {}

        def add(key: str, agree: int, size: int, count: int) -> None:
            t = tally.setdefault(key, [0, 0, 0])
            t[0], t[1], t[2] = t[0] + agree, t[1] + size, t[2] + count

        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            progress(f"{dataset}: prompt {i + 1}/{len(prompts)}")
            hidden, logits, nxt, context = _forward(drafter, prompt, text)
            t = len(nxt)
            add("full", *_agree(logits, nxt, None), t)
            for size in sizes:
                static = _mask(v, torch.cat([ranked[:size], stops]))
                add(f"static {size}", *_agree(logits, nxt, static.expand(t, v)), t)
                evo = Evo(
                    torch.nn.Linear(1, v, bias=False),
                    torch.cat([ranked[: max(1, size - buffer)], stops]),
                    buffer,
                )
                evo.begin(context)
                rows = torch.zeros(t, v, dtype=torch.bool)
                for j in range(t):
                    rows[j] = _mask(v, evo.core.ids)
                    if evo.counts:
                        rows[j, list(evo.counts)] = True
                    evo.observe([int(nxt[j])])
                add(f"evo {size}", *_agree(logits, nxt, rows), t)
            scores = dyna.router(hidden)
            for m in budgets:
                rows = dyna_core.expand(t, v).clone()
                for j, top in enumerate(scores.topk(min(m, len(groups)), dim=-1).indices.tolist()):
                    for c in top:
                        rows[j, groups[c]] = True
                add(f"dyna {m}", *_agree(logits, nxt, rows), t)
        run = {"dataset": dataset, "rows": []}
        full = tally["full"][0] / tally["full"][2]
        for key, (agree, size, count) in tally.items():
            run["rows"].append(
                {
                    "policy": key.split()[0],
                    "param": key.split()[1] if " " in key else None,
                    "support": size / count,
                    "agreement": agree / count,
                    "relative": agree / count / full,
                }
            )
        result["runs"].append(run)
        _write(result, out, name)
    return result


def _static_at(rows: list[dict[str, Any]], size: float) -> float | None:
    """The static policy's relative agreement at `size`, interpolated in log size (None outside)."""
    pts = sorted((r["support"], r["relative"]) for r in rows if r["policy"] == "static")
    for (s0, a0), (s1, a1) in zip(pts, pts[1:]):
        if s0 <= size <= s1:
            w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0)) if s1 > s0 else 0.0
            return a0 + w * (a1 - a0)
    return None


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# shortlists: {result['drafter']} on {result['target']}'s greedy text ({result['n']} prompts x "
        f"{result['tokens']} tokens per dataset)",
        "",
        f"EvoSpec buffer {result['buffer']}; DynaSpec {result['clusters']} clusters over a core of "
        f"{result['dyna_core']}. Relative: agreement / the full head's.",
        "",
    ]
    for run in result["runs"]:
        lines += [
            f"## {run['dataset']}",
            "",
            "| policy | mean support | agreement | relative | static at that size |",
            "|---|---|---|---|---|",
        ]
        for r in run["rows"]:
            at = _static_at(run["rows"], r["support"]) if r["policy"] in ("evo", "dyna") else None
            lines.append(
                f"| {r['policy']} {r['param'] or ''} | {r['support']:.0f} | {r['agreement']:.3f} | "
                f"{r['relative']:.3f} | {'%.3f' % at if at is not None else ''} |"
            )
        lines.append("")
    return "\n".join(lines)


def _write(result: dict[str, Any], out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / f"{name}.json", json.dumps(result, indent=1).encode())
    atomic_write_bytes(out / f"{name}.md", markdown(result).encode())
