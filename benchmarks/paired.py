"""Before/after speed of two source trees, paired: `python -m benchmarks.paired --before A --after B`.

A change that should not move speed (a refactor) is checked here: each tree decodes the same
prompts in a process of its own (`PYTHONPATH=tree`), the two alternating (before, after, then
after, before, ...), alone on the machine. Per prompt, the speed ratio is the before tree's
seconds over the after tree's (each the median of its repeats); the report gives the median
ratio with a bootstrap 95% interval per workload, and checks that every greedy output is the same
in both trees. The child uses the public API only (`od.Drafter.load`, a target's `load`, `pair`,
`generate`), so an older tree runs it too. Make the trees with `git worktree add DIR REV`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["main"]


def child(args: argparse.Namespace) -> None:
    """In the tree under test: load the pairing, decode each workload's prompts, write JSON."""
    import time

    import omnidraft as od
    from omnidraft.bench.datasets import load_prompts

    drafter_name, target_name = args.pair.split(":")
    if args.engine == "vllm":
        target = od.VLLMTarget.load(target_name, dtype="float32")
    else:
        target = od.LocalTarget.load(target_name)
    pair = od.Drafter.load(drafter_name).pair(target, **({"k": args.k} if args.k else {}))
    pair.generate("Warm up.", max_new_tokens=8)
    rows = []
    for workload in args.workload:
        for i, prompt in enumerate(load_prompts(workload, args.n)):
            started = time.perf_counter()
            out = pair.generate(prompt, max_new_tokens=args.max_new_tokens)
            seconds = time.perf_counter() - started
            speculated = any(r.proposed for r in out.rounds)  # else the target decoded it alone
            row = {"workload": workload, "prompt": i, "seconds": seconds, "ids": out.token_ids}
            rows.append({**row, "speculated": speculated, "rounds": len(out.rounds)})
    Path(args.out).write_text(json.dumps({"source": od.__file__, "rows": rows}))


def run_tree(tree: str, args: argparse.Namespace, out: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, __file__, "--child", "--out", out, "--pair", args.pair, "--engine", args.engine]
    cmd += ["--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens), "--k", str(args.k or 0)]
    for w in args.workload:
        cmd += ["--workload", w]
    subprocess.run(cmd, env=env, check=True, cwd=tree)
    done = json.loads(Path(out).read_text())
    if not Path(done["source"]).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"{tree}: the child imported omnidraft from {done['source']}, not from the tree")
    return list(done["rows"])


def bootstrap(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95% interval of the median ratio, resampling prompts."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def report(runs: dict[str, list[list[dict]]], args: argparse.Namespace) -> str:
    lines = [
        f"{args.pair} on {args.engine}{f', k={args.k}' if args.k else ''}, {args.n} prompts x "
        f"{args.max_new_tokens} tokens a workload, "
        f"{args.repeats} runs a tree, alternating",
        "",
        "| workload | before tok/s | after tok/s | median ratio (after speed / before) | 95% interval | "
        "outputs identical |",
        "|---|---|---|---|---|---|",
    ]
    found: dict[tuple[str, str, int], list[dict]] = {}
    for tree, tree_runs in runs.items():
        for run in tree_runs:
            for r in run:
                found.setdefault((tree, r["workload"], r["prompt"]), []).append(r)
    for workload in args.workload:
        prompts = sorted({p for (_, w, p) in found if w == workload})
        ratios, same, tokens, secs = [], 0, 0, {"before": 0.0, "after": 0.0}
        for i in prompts:
            per = {tree: statistics.median(r["seconds"] for r in found[tree, workload, i]) for tree in runs}
            for tree in runs:
                secs[tree] += per[tree]
            every = found["before", workload, i] + found["after", workload, i]
            same += len({json.dumps(r["ids"]) for r in every}) == 1
            tokens += len(every[0]["ids"])
            ratios.append(per["before"] / per["after"])
        low, high = bootstrap(ratios)
        lines.append(
            f"| {workload} | {tokens / secs['before']:.2f} | {tokens / secs['after']:.2f} | "
            f"{statistics.median(ratios):.3f} | {low:.3f}-{high:.3f} | {same}/{len(prompts)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.paired", description=__doc__)
    p.add_argument("--before", help="the source tree before the change")
    p.add_argument("--after", help="the source tree after it")
    p.add_argument("--pair", default="smollm2-135m:qwen2.5-coder-0.5b")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    p.add_argument("--workload", action="append", help="repeatable (default: gsm8k, humaneval, code-edit)")
    p.add_argument("--n", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs a tree")
    p.add_argument("--keep", help="a directory to keep each run's JSON in")
    p.add_argument(
        "--k",
        type=int,
        default=0,
        help="a fixed draft length: the loop's own speed, without the cost policy's timing-driven "
        "choices (default 0: the pairing's defaults)",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.workload = args.workload or ["gsm8k", "humaneval", "code-edit"]
    if args.child:
        child(args)
        return
    if not args.before or not args.after:
        p.error("--before and --after are required")
    runs: dict[str, list[list[dict]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = str(Path(args.keep).resolve()) if args.keep else scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for r in range(args.repeats):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for tree in order:
                out = str(Path(tmp) / f"{tree}-{r}.json")
                runs[tree].append(run_tree(getattr(args, tree), args, out))
                print(f"run {r} {tree}: done", file=sys.stderr, flush=True)
    print(report(runs, args))


if __name__ == "__main__":
    main()
