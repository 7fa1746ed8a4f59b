"""The `omnidraft` command: generate, demo, bench. Argument parsing and orchestration live here."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["main"]

DRAFTER = "smollm2-135m"
TARGET = "qwen2.5-coder-1.5b"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omnidraft", description="Cross-vocabulary speculative decoding.")
    sub = p.add_subparsers(dest="command", required=True)

    def decoding(q: argparse.ArgumentParser) -> None:
        q.add_argument("--k", type=int, default=6, help="most drafter tokens per round")
        q.add_argument("--stop-confidence", type=float, default=0.3,
                       help="end a draft after a token the drafter gives less probability than this (0: never)")
        q.add_argument("--strategy", choices=["text", "ngram"], default="text")
        q.add_argument("--adaptive-k", type=int, default=None, metavar="K_MAX",
                       help="move the draft length with acceptance (hysteresis), up to K_MAX; default: fixed --k")
        q.add_argument("--max-new-tokens", type=int, default=128)

    g = sub.add_parser("generate", help="stream one speculative generation")
    g.add_argument("prompt")
    g.add_argument("--pair", default=f"{DRAFTER}:{TARGET}", help="DRAFTER:TARGET (presets, .gguf paths or HF dirs)")
    g.add_argument("--mode", choices=["greedy", "match", "exact", "omnidraft"], default="greedy")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    decoding(g)

    d = sub.add_parser("demo", help="a few GSM8K and HumanEval prompts, omnidraft vs the target alone")
    d.add_argument("--target", default=TARGET)
    d.add_argument("--drafter", default=DRAFTER)
    d.add_argument("--n", type=int, default=2, help="prompts per dataset")
    decoding(d)

    b = sub.add_parser("bench", help="omnidraft vs target alone vs HF assisted generation")
    b.add_argument("--pair", action="append", help="DRAFTER:TARGET, repeatable")
    b.add_argument("--dataset", action="append", help="gsm8k | humaneval | FILE.jsonl, repeatable")
    b.add_argument("--n", type=int, default=10)
    b.add_argument("--no-hf", action="store_true", help="skip the HF assisted-generation baseline")
    b.add_argument("--out", default="bench_out")
    b.add_argument("--name", default="bench")
    b.add_argument("--trace", default=None, help="append per-round JSONL traces to this file")
    decoding(b)
    c = sub.add_parser("calibrate", help="time the real models; write a device_sim device profile")
    c.add_argument("--pair", default=f"{DRAFTER}:{TARGET}")
    c.add_argument("--out", required=True, help="profile JSON to write (device_sim --profiles FILE)")
    c.add_argument("--max-tokens", type=int, default=12)
    decoding(c)

    s = sub.add_parser("simulate", help="python -m device_sim with the same arguments", add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def _split_pair(pair: str) -> tuple[str, str]:
    drafter, sep, target = pair.partition(":")
    if not sep or not drafter or not target:
        raise SystemExit(f"--pair must be DRAFTER:TARGET, got {pair!r}")
    return drafter, target


def _load_pair(drafter_spec: str, target_spec: str, args: argparse.Namespace) -> Any:
    import omnidraft as od

    started = time.perf_counter()
    drafter, target = od.Drafter.load(drafter_spec), od.LocalTarget.load(target_spec)
    logging.getLogger("omnidraft").info("loaded %s and %s in %.1f s", drafter, target, time.perf_counter() - started)
    extra = {"mode": getattr(args, "mode", "greedy"), "temperature": getattr(args, "temperature", 0.0)}
    if args.adaptive_k is not None:
        from .adaptive.policy import Hysteresis

        extra["adaptive"] = Hysteresis(k_min=2, k_max=args.adaptive_k)
    return drafter.pair(target, k=args.k, stop_confidence=args.stop_confidence, strategy=args.strategy, **extra)


def _generate(args: argparse.Namespace) -> None:
    import torch

    pair = _load_pair(*_split_pair(args.pair), args)
    gen = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    for piece in pair.stream(args.prompt, max_new_tokens=args.max_new_tokens, generator=gen):
        sys.stdout.write(piece)
        sys.stdout.flush()
    s = pair.last.stats
    print(f"\n\n[{s.new_tokens} tokens, {s.tokens_per_second:.2f} tok/s, acceptance {s.acceptance_rate:.2f}, "
          f"τ {s.mean_accepted_length:.2f}, n-gram hits/round {s.ngram_hits_per_round:.2f}]", file=sys.stderr)


def _run(pair_spec: str, datasets: list[str], args: argparse.Namespace, hf: bool, trace: str | None,
         partial: Callable[[list, dict], None] = lambda *_: None) -> tuple[list, dict]:
    from tqdm import tqdm

    from .bench.datasets import load_prompts
    from .bench.runner import run_prompts, summarize
    from .stats import write_trace

    pair = _load_pair(*_split_pair(pair_spec), args)
    summaries, per_prompt = [], {}
    for dataset in datasets:
        prompts = load_prompts(dataset, args.n)
        bar = tqdm(total=len(prompts), desc=f"{pair_spec} {dataset}", file=sys.stderr)
        record = (lambda i, out: write_trace(trace, out.rounds, {"pair": pair_spec, "dataset": dataset, "prompt": i})) if trace else None
        head = {"pair": pair_spec, "dataset": dataset, "k": pair.config.k, "stop_confidence": pair.config.stop_confidence,
                "adaptive_k_max": pair.config.adaptive.k_max if pair.config.adaptive else None,
                "max_new_tokens": args.max_new_tokens}

        def done(results: list, head: dict = head, key: str = f"{pair_spec}/{dataset}") -> None:
            per_prompt[key] = [r.as_dict() for r in results]
            partial([*summaries, {**head, **summarize(results)}], per_prompt)

        results = run_prompts(pair, prompts, args.max_new_tokens, hf=hf, trace=record, done=done,
                              progress=lambda msg: (bar.set_postfix_str(msg), bar.update(msg.endswith("omnidraft"))))
        bar.close()
        summaries.append({**head, **summarize(results)})
    return summaries, per_prompt


def _demo(args: argparse.Namespace) -> None:
    summaries, per_prompt = _run(f"{args.drafter}:{args.target}", ["gsm8k", "humaneval"], args, hf=False, trace=None)
    print(f"\nomnidraft demo: {args.drafter} drafting for {args.target}, greedy, {args.max_new_tokens} new tokens\n")
    print(f"{'prompt':<16}{'accept':>8}{'τ':>7}{'n-gram/rd':>11}{'omni tok/s':>12}{'target tok/s':>14}{'speedup':>9}  identical")
    for key, rows in per_prompt.items():
        for r in rows:
            tokens = r["new_tokens"]
            print(f"{key.split('/')[1] + ' #' + str(r['index']):<16}{r['acceptance_rate']:>8.2f}{r['mean_accepted_length']:>7.2f}"
                  f"{r['ngram_hits_per_round']:>11.2f}{tokens / r['omnidraft_s']:>12.2f}{tokens / r['target_s']:>14.2f}"
                  f"{r['speedup']:>8.2f}×  {'yes' if r['identical'] else 'NO'}")
    for s in summaries:
        print(f"{'total ' + s['dataset']:<16}{s['acceptance_rate']:>8.2f}{s['mean_accepted_length']:>7.2f}"
              f"{s['ngram_hits_per_round']:>11.2f}{s['omnidraft_tok_s']:>12.2f}{s['target_tok_s']:>14.2f}"
              f"{s['speedup']:>8.2f}×  {s['identical_rate']:.0%}")


def _bench(args: argparse.Namespace) -> None:
    from .bench.report import markdown_table, write_report

    pairs = args.pair or [f"{DRAFTER}:qwen2.5-coder-0.5b"]
    summaries, per_prompt = [], {}
    for pair_spec in pairs:
        s, p = _run(pair_spec, args.dataset or ["gsm8k", "humaneval"], args, hf=not args.no_hf, trace=args.trace,
                    partial=lambda rows, prompts: write_report(args.out, args.name, [*summaries, *rows], {**per_prompt, **prompts}))
        summaries += s
        per_prompt.update(p)
        paths = write_report(args.out, args.name, summaries, per_prompt)  # rewritten after each pair
    print(markdown_table(summaries))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")


def _calibrate(args: argparse.Namespace) -> None:
    import json

    from .atomic import atomic_write_bytes
    from .calibrate import calibrate

    profile = calibrate(_load_pair(*_split_pair(args.pair), args), max_tokens=args.max_tokens)
    atomic_write_bytes(Path(args.out), json.dumps({"devices": [profile]}, indent=1).encode())
    print(json.dumps(profile, indent=1))


def _simulate(args: argparse.Namespace) -> None:
    from device_sim.__main__ import main as simulate_main

    simulate_main(args.rest)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("transformers", "httpx", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if getattr(args, "n", 1) < 1 or getattr(args, "max_new_tokens", 1) < 1:
        raise SystemExit(f"--n and --max-new-tokens must be >= 1, got {getattr(args, 'n', 1)} and {args.max_new_tokens}")
    commands = {"generate": _generate, "demo": _demo, "bench": _bench, "calibrate": _calibrate, "simulate": _simulate}
    commands[args.command](args)


if __name__ == "__main__":
    main()
