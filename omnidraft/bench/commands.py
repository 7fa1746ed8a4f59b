"""The `omnidraft bench` command: the headline benchmark (omnidraft beside the target alone and the
peers), and its remote, k-grid and draft-source variants. Argument parsing lives in cli/options.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from ..cli.options import DRAFTER, TARGET, load_pair, split_pair
from .pairs import loaded_pairs

__all__ = ["bench", "bench_engine", "bench_network", "run_pair"]


def run_pair(
    pair_spec: str,
    datasets: list[str],
    args: argparse.Namespace,
    peers: tuple[str, ...],
    trace: str | None,
    partial: Callable[[list, dict], object] = lambda *_: None,
) -> tuple[list, dict]:
    from tqdm import tqdm

    from ..decode.stats import write_trace
    from ..targets.local import LocalTarget
    from .datasets import load_prompts
    from .runner import pairing_costs, run_prompts, summarize

    pair = load_pair(*split_pair(pair_spec), args)
    if not isinstance(pair.target, LocalTarget):  # the HF peers run the target's own PyTorch model
        peers = ()
    summaries: list[dict[str, Any]] = []
    per_prompt: dict[str, Any] = {}
    for dataset in datasets:
        prompts = load_prompts(dataset, args.n)
        bar = tqdm(total=len(prompts), desc=f"{pair_spec} {dataset}", file=sys.stderr)
        record = (
            (
                lambda i, out: write_trace(
                    trace, out.rounds, {"pair": pair_spec, "dataset": dataset, "prompt": i}
                )
            )
            if trace
            else None
        )
        head = {
            "pair": pair_spec,
            "dataset": dataset,
            "k": pair.config.k,
            "stop_confidence": pair.config.stop_confidence,
            "adaptive_k_max": pair.config.adaptive.k_max if pair.config.adaptive else None,
            "max_new_tokens": args.max_new_tokens,
        }

        def done(results: list, head: dict = head, key: str = f"{pair_spec}/{dataset}") -> None:
            per_prompt[key] = [r.as_dict() for r in results]
            partial([*summaries, {**head, **summarize(results)}], per_prompt)

        results = run_prompts(
            pair,
            prompts,
            args.max_new_tokens,
            peers=peers,
            trace=record,
            done=done,
            progress=lambda msg: (bar.set_postfix_str(msg), bar.update(msg.endswith("omnidraft"))),
        )
        bar.close()
        summary = summarize(results)
        step = sum(r.target_s for r in results) / sum(r.new_tokens for r in results)
        summaries.append({**head, **summary, "costs": pairing_costs(pair, step)})
    return summaries, per_prompt


def _bench_remote(args: argparse.Namespace) -> None:
    import json

    from tqdm import tqdm

    from ..decode.stats import write_trace
    from ..store.atomic import atomic_write_bytes
    from .datasets import load_prompts
    from .remote import run_remote

    rows = []
    for pair_spec, drafter, target in loaded_pairs(args.pair, f"{DRAFTER}:{TARGET}", args.target_backend):
        for dataset in args.dataset or ["gsm8k", "humaneval"]:
            bar = tqdm(desc=f"{pair_spec} {dataset} remote", file=sys.stderr)
            record = (
                (
                    lambda rtt, i, out, dataset=dataset, pair_spec=pair_spec: write_trace(
                        args.trace,
                        out.rounds,
                        {"pair": pair_spec, "dataset": dataset, "prompt": i, "rtt_ms": rtt * 1000},
                    )
                )
                if args.trace
                else None
            )
            for row in run_remote(
                drafter,
                target,
                load_prompts(dataset, args.n),
                args.max_new_tokens,
                [ms / 1000 for ms in args.rtt or [20, 50, 100]],
                k=args.k,
                progress=bar.set_postfix_str,
                trace=record,
            ):
                rows.append({"pair": pair_spec, "dataset": dataset, **row})
            bar.close()
    out = Path(args.out)
    table = (
        "Speedup is over the server alone: one completion request, the whole completion generated on the "
        "server, "
        "at the same injected RTT. fwd/token: target forwards per committed token (what speculating saves a "
        "server). speculated: requests the latency objective chose to speculate on.\n\n"
        "| pair | dataset | RTT ms | row | s/request | tok/s | speedup | fwd/token | bytes sent/token | "
        "identical | "
        "speculated |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    for r in rows:
        table += (
            f"| {r['pair']} | {r['dataset']} | {r['rtt_ms']:.0f} | {r['row']} | "
            f"{r['seconds_per_request']:.2f} | "
            f"{r['tok_s']:.2f} | {r['speedup']:.2f}× | {r['forwards_per_token']:.2f} | "
            f"{r['bytes_sent_per_token']:.0f} | "
            f"{r['identical']}/{r['prompts']} | {r['speculated']}/{r['prompts']} |\n"
        )
    atomic_write_bytes(out / f"{args.name}.json", json.dumps(rows, indent=1).encode())
    atomic_write_bytes(out / f"{args.name}.md", table.encode())
    print(table)
    print(f"wrote {out / args.name}.json and .md")


def bench_network(args: argparse.Namespace) -> None:
    """Devices drafting for a server (vLLM, OpenVINO, llama.cpp) across a delaying proxy, against
    the fastest engine alone here (bench/network.py)."""
    import json

    from tqdm import tqdm

    from ..store.atomic import atomic_write_bytes
    from ..targets.fastest import candidates
    from ..targets.registry import resolved
    from .datasets import load_prompts
    from .network import NetworkRun, markdown, run_network

    out, text = Path(args.out), ""
    results: list[dict[str, Any]] = []
    for pair_spec in args.pair or [f"{DRAFTER}:qwen2.5-coder-0.5b"]:
        drafter_spec, target_spec = split_pair(pair_spec)
        engine = resolved(target_spec, args.target_backend, {})
        others = tuple(e for e in candidates(target_spec) if e != engine)
        for dataset in args.dataset or ["mixed"]:
            bar = tqdm(desc=f"{pair_spec} {dataset} network", file=sys.stderr)
            run = NetworkRun(
                drafter_spec,
                target_spec,
                load_prompts(dataset, args.n),
                args.max_new_tokens,
                args.rtt or [0.0, 50.0],
                args.devices or [1],
                stock=not args.no_stock,
                sampling={"temperature": args.temperature, "top_p": args.top_p} if args.temperature else None,
                log=str(out / f"{args.name}-servers.log"),
                engine=engine,
                others=others,
            )
            rows = run_network(
                run,
                progress=bar.set_postfix_str,
                done=lambda rows: atomic_write_bytes(
                    out / f"{args.name}.partial.json", json.dumps([*results, *rows], indent=1).encode()
                ),
            )
            bar.close()
            results += [{"pair": pair_spec, "dataset": dataset, **r} for r in rows]
            text += (
                f"\n{pair_spec} {dataset}, {args.n} prompts, {args.max_new_tokens} tokens, the server on "
                f"{engine}; speedups against the fastest engine streaming alone "
                f"({', '.join(sorted({r['against'] for r in rows}))})\n\n{markdown(rows)}"
            )
            atomic_write_bytes(out / f"{args.name}.json", json.dumps(results, indent=1).encode())
            atomic_write_bytes(out / f"{args.name}.md", text.encode())
    print(text)
    print(f"wrote {out / args.name}.json and .md")


def _bench_k_grid(args: argparse.Namespace) -> None:
    import json

    from tqdm import tqdm

    from ..store.atomic import atomic_write_bytes
    from .datasets import load_prompts
    from .runner import default_against_fixed_k

    out, results, table = Path(args.out), [], ""
    for pair_spec, drafter, target in loaded_pairs(args.pair, f"{DRAFTER}:qwen2.5-coder-0.5b"):
        for dataset in args.dataset or ["gsm8k", "humaneval"]:
            bar = tqdm(desc=f"{pair_spec} {dataset} k-grid", file=sys.stderr)
            res = default_against_fixed_k(
                drafter,
                target,
                load_prompts(dataset, args.n),
                args.max_new_tokens,
                args.k_grid,
                progress=bar.set_postfix_str,
            )
            bar.close()
            results.append({"pair": pair_spec, "dataset": dataset, **res})
            r = res["default_vs_best"]
            table += (
                f"\n{pair_spec} {dataset}: target alone {res['target_tok_s']:.2f} tok/s; default vs best "
                "fixed "
                f"{res['best_fixed']}: {r['ratio']:.3f} (95% {r['low']:.3f}-{r['high']:.3f}), faster on "
                f"{r['wins']}/{r['prompts']} prompts\n\n| variant | tok/s | speedup | τ | drafted/round | "
                "identical |\n"
                "|---|---|---|---|---|---|\n"
            )
            table += "".join(
                f"| {row['variant']} | {row['tok_s']:.2f} | {row['speedup']:.2f}× | {row['tau']:.2f} | "
                f"{row['drafted_per_round']:.2f} | {row['identical']}/{row['prompts']} |\n"
                for row in res["rows"]
            )
            atomic_write_bytes(out / f"{args.name}.json", json.dumps(results, indent=1).encode())
            atomic_write_bytes(out / f"{args.name}.md", table.encode())
    print(table)
    print(f"wrote {out / args.name}.json and .md")


def _bench_sources(args: argparse.Namespace) -> None:
    import json

    from tqdm import tqdm

    from ..store.atomic import atomic_write_bytes
    from .datasets import load_prompts
    from .sources import markdown, run_sources

    out, results = Path(args.out), {}
    for pair_spec, drafter, target in loaded_pairs(args.pair, f"{DRAFTER}:{TARGET}"):
        bar = tqdm(desc=f"{pair_spec} drafts", file=sys.stderr)
        datasets = args.dataset or ["summarize", "rag", "code-edit", "chat", "gsm8k", "humaneval"]
        results[pair_spec] = run_sources(
            drafter,
            target,
            {d: load_prompts(d, args.n) for d in datasets},
            args.max_new_tokens,
            drafts=tuple(args.drafts) + (("relaxed",) if args.relaxed else ()),
            peers=() if args.no_peers else tuple(args.peer or ("lookup", "assisted")),
            progress=bar.set_postfix_str,
            k=args.k,
            stop_confidence=args.stop_confidence,
            strategy=args.strategy,
        )
        bar.close()
        text = "".join(f"## {spec}\n\n{markdown(r)}\n" for spec, r in results.items())
        atomic_write_bytes(out / f"{args.name}.json", json.dumps(results, indent=1).encode())
        atomic_write_bytes(out / f"{args.name}.md", text.encode())
    print(text)
    print(f"wrote {out / args.name}.json and .md")


def bench_engine(args: argparse.Namespace) -> None:
    """The target on llama.cpp or vLLM: every contender on that engine in one run (bench/llama.py,
    bench/vllm.py), against the engine alone."""
    import json

    from tqdm import tqdm

    from ..store.atomic import atomic_write_bytes
    from .datasets import load_prompts
    from .llama import run_llama, summarize_llama
    from .vllm import run_vllm

    engine = args.target_backend
    base = "llama.cpp alone" if engine == "llama.cpp" else "vLLM alone"
    out, results, text = Path(args.out), {}, ""
    default = "qwen2.5-coder-1.5b" if engine == "llama.cpp" else "qwen2.5-coder-0.5b"
    datasets = args.dataset or ["gsm8k", "humaneval"]
    for pair_spec in args.pair or [f"{DRAFTER}:{default}"]:
        drafter_spec, target_spec = split_pair(pair_spec)
        runs: dict[str, list[dict[str, Any]]] = {}
        notes: dict[str, list[str]] = {d: [] for d in datasets}
        bar = tqdm(desc=f"{pair_spec} {engine}", file=sys.stderr)
        if engine == "vllm":  # every dataset on one engine (vLLM's CPU build starts two engines a process)
            sets = {d: load_prompts(d, args.n) for d in datasets}
            runs = run_vllm(
                drafter_spec,
                target_spec,
                sets,
                args.max_new_tokens,
                ngram=not args.no_peers,
                repeats=args.repeats,
                notes=notes,
                progress=bar.set_postfix_str,
            )
        else:
            for dataset in datasets:
                runs[dataset] = run_llama(
                    drafter_spec,
                    target_spec,
                    load_prompts(dataset, args.n),
                    args.max_new_tokens,
                    peers=not args.no_peers,
                    repeats=args.repeats,
                    notes=notes[dataset],
                    progress=bar.set_postfix_str,
                )
        bar.close()
        for dataset, rows in runs.items():
            results[f"{pair_spec}/{dataset}"] = rows
            text += (
                f"\n{pair_spec} {dataset}, {args.n} prompts, {args.max_new_tokens} tokens; speedup over "
                f"{base} (total time; worst: the slowest request against {base} on the same prompt)\n\n"
                "| row | tok/s | speedup | worst request | identical |\n|---|---|---|---|---|\n"
            )
            text += "".join(
                f"| {r['row']} | {r['tok_s']:.2f} | {r['speedup']:.2f}× | {r['worst']:.2f}× "
                f"| {r['identical']}/{r['prompts']} |\n"
                for r in summarize_llama(rows, base=base)
            )
            text += "".join(f"\n- {note}" for note in notes[dataset]) + "\n"
        atomic_write_bytes(out / f"{args.name}.json", json.dumps(results, indent=1).encode())
        atomic_write_bytes(out / f"{args.name}.md", text.encode())
    print(text)
    print(f"wrote {out / args.name}.json and .md")


# the built-in engines' own comparisons (a registered engine may bring its own: targets/registry.py)
ENGINE_BENCHES: dict[str, Callable[[argparse.Namespace], None]] = {
    "llama.cpp": bench_engine,
    "vllm": bench_engine,
}
# a serving engine's hybrid bench: devices streaming to `omnidraft serve` across a delaying proxy
REMOTE_BENCHES: dict[str, Callable[[argparse.Namespace], None]] = {
    name: bench_network for name in ("vllm", "openvino", "openvino-int4", "llama.cpp")
}


def bench(args: argparse.Namespace) -> None:
    from ..targets.registry import engine, resolved
    from .report import markdown_table, write_report

    if args.target_backend == "auto":  # the fastest engine here for the (first) pair's target
        first = (args.pair or [f"{DRAFTER}:{TARGET}"])[0]
        args.target_backend = resolved(split_pair(first)[1], "auto", {})
    chosen = engine(args.target_backend)
    if args.remote:
        return (chosen.bench_remote or REMOTE_BENCHES.get(chosen.name, _bench_remote))(args)
    if (own := chosen.bench or ENGINE_BENCHES.get(chosen.name)) is not None:
        return own(args)
    if args.k_grid:
        return _bench_k_grid(args)
    if args.drafts and len(args.drafts) > 1:
        return _bench_sources(args)

    pairs = args.pair or [f"{DRAFTER}:qwen2.5-coder-0.5b"]
    summaries: list[dict[str, Any]] = []
    per_prompt: dict[str, Any] = {}
    for pair_spec in pairs:
        s, p = run_pair(
            pair_spec,
            args.dataset or ["gsm8k", "humaneval"],
            args,
            trace=args.trace,
            peers=() if args.no_peers else tuple(args.peer or ("stock", "lookup", "assisted")),
            partial=lambda rows, prompts: write_report(
                args.out, args.name, [*summaries, *rows], {**per_prompt, **prompts}
            ),
        )
        summaries += s
        per_prompt.update(p)
        paths = write_report(args.out, args.name, summaries, per_prompt)  # rewritten after each pair
    print(markdown_table(summaries))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
