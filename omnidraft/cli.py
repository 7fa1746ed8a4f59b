"""The `omnidraft` command: generate, demo, bench. Argument parsing and orchestration live here."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["DRAFTER", "loaded_pairs", "main", "split_pair"]  # the helpers serve bench/commands.py too

DRAFTER = "smollm2-135m"
TARGET = "qwen2.5-coder-1.5b"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omnidraft", description="Cross-vocabulary speculative decoding.")
    sub = p.add_subparsers(dest="command", required=True)

    def decoding(q: argparse.ArgumentParser) -> None:
        q.add_argument("--k", type=int, default=None,
                       help="fixed drafter tokens per round (default: chosen each round from the pairing's measured "
                            "costs, 0 where drafting cannot pay; the lab commands use 6)")
        q.add_argument("--stop-confidence", type=float, default=0.3,
                       help="end a draft after a token the drafter gives less probability than this (0: never)")
        q.add_argument("--strategy", choices=["text", "ngram"], default="text")
        q.add_argument("--adaptive-k", type=int, default=None, metavar="K_MAX",
                       help="move the draft length with acceptance (hysteresis), up to K_MAX; default: fixed --k")
        q.add_argument("--max-new-tokens", type=int, default=128)
        q.add_argument("--drafts", action="append", choices=["hybrid", "model", "retrieval"],
                       help="where drafts come from (default hybrid: the drafter model or text retrieved from the "
                            "context, whichever is expected to be faster); `bench` takes several and compares them")

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
    b.add_argument("--peer", action="append", choices=["stock", "lookup", "assisted"],
                   help="peer rows beside the target alone, repeatable (default: all three): stock = the same model "
                        "on stock kernels, lookup = HF prompt lookup, assisted = HF assisted generation")
    b.add_argument("--no-peers", action="store_true", help="time only omnidraft and the target alone")
    b.add_argument("--out", default="bench_out")
    b.add_argument("--name", default="bench")
    b.add_argument("--trace", default=None, help="append per-round JSONL traces to this file")
    b.add_argument("--k-grid", type=int, action="append", metavar="K",
                   help="instead: the default pairing against each of these fixed draft lengths, paired per prompt")
    b.add_argument("--remote", action="store_true",
                   help="serve the target on loopback and verify over HTTP with --rtt injected per round trip")
    b.add_argument("--rtt", type=float, action="append", metavar="MS", help="round-trip time(s) in ms for --remote")
    b.add_argument("--relaxed", action="store_true",
                   help="with several --drafts: also the hybrid under relaxed verification, a LOSSY row, with ROUGE-L")
    decoding(b)
    a = sub.add_parser("adapt", help="online distillation: acceptance and τ against training steps, held-out")
    a.add_argument("--pair", default=f"{DRAFTER}:qwen2.5-coder-0.5b")
    a.add_argument("--train", default="gsm8k:train", help="dataset of training prompts")
    a.add_argument("--eval", default="gsm8k:test", help="dataset of held-out prompts")
    a.add_argument("--n-train", type=int, default=300)
    a.add_argument("--n-eval", type=int, default=50)
    a.add_argument("--steps", type=int, default=40, help="optimizer steps per variant")
    a.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every this many steps")
    a.add_argument("--variant", action="append", choices=["none", "dm", "hybrid", "spans", "full", "full-spans"],
                   help="repeatable; default: none, hybrid and spans. dm = KL only; hybrid = the paper's KL + NLL; "
                        "spans = hybrid + NLL on misaligned runs of target tokens (what learning pairings use); "
                        "full = full fine-tuning on hybrid's loss; full-spans = full fine-tuning on spans' loss")
    a.add_argument("--interval", type=int, default=8, help="requests between updates (Algorithm 2's I)")
    a.add_argument("--batch-size", type=int, default=8)
    a.add_argument("--epochs", type=int, default=1, help="passes over the buffer per update")
    a.add_argument("--lr", type=float, default=1e-4)
    a.add_argument("--full-lr", type=float,
                   help="learning rate of the full fine-tuning variants (default: --lr; every weight moves, so it wants "
                        "a smaller one)")
    a.add_argument("--decay-steps", type=int, default=0,
                   help="anneal the lr along a cosine to lr * --final-lr-ratio over this many steps (default 0: constant)")
    a.add_argument("--final-lr-ratio", type=float, default=0.1)
    a.add_argument("--lam", default="0.2", help="n-gram loss weight, or 'dynamic'")
    a.add_argument("--direct-nll", type=float,
                   help="weight of an NLL on the committed token at direct positions (hard labels), added to the KL; "
                        "default: TrainConfig's (the paper's variants dm, hybrid and full always use 0)")
    a.add_argument("--rank", type=int, default=32)
    a.add_argument("--modules", help="comma-separated projections that get LoRA adapters; default: the attention's q,k,v,o")
    a.add_argument("--cache-ablation", action="store_true", help="also measure the n-gram cache by size and policy")
    a.add_argument("--record-batch", type=int, default=8,
                   help="prompts the target records at once when traces are not cached yet (a larger batch records "
                        "faster on CPU; a near-tie argmax may flip with the batch)")
    a.add_argument("--drafter-precision", choices=["int8", "fp32"], default="int8",
                   help="weights the drafter drafts with (default int8, as Drafter.load)")
    a.add_argument("--train-weights", choices=["drafting", "fp32"], default="drafting",
                   help="weights an int8 drafter's adapter trains through: the int8 ones it drafts with, emulated in "
                        "fp32 (default), or the fp32 base")
    a.add_argument("--tts-every", type=int, default=0, metavar="S",
                   help="also score with Test-Time Speculation: a fast step every S rounds inside each held-out request")
    a.add_argument("--tts-lr", type=float, default=1e-3, help="learning rate of those fast steps")
    a.add_argument("--eval-max-new-tokens", type=int, default=None, metavar="N",
                   help="held-out requests this long (default: --max-new-tokens); Test-Time Speculation needs long ones")
    a.add_argument("--live", type=int, default=0, metavar="N",
                   help="also run the unadapted and adapted drafters against the live target on the first N held-out "
                        "prompts, beside replay's figures for them (the check that replay tells the truth)")
    a.add_argument("--out", default="adapt_out")
    a.add_argument("--name", default="adapt")
    decoding(a)

    h = sub.add_parser("bench-draft", help="draft-length policies live: fixed k, hysteresis fallback, acceptance heads")
    h.add_argument("--pair", action="append", help="DRAFTER:TARGET, repeatable")
    h.add_argument("--dataset", action="append", help="gsm8k | humaneval, repeatable (heads train on its :train split)")
    h.add_argument("--n", type=int, default=10, help="evaluation prompts per dataset")
    h.add_argument("--n-train", type=int, default=100, help="training prompts per dataset for the heads")
    h.add_argument("--max-new-tokens", type=int, default=128)
    h.add_argument("--fixed-k", type=int, action="append", help="fixed draft lengths to compare, repeatable")
    h.add_argument("--confidence-k", type=int, action="append",
                   help="also draft up to this many tokens, stopping after one the drafter gives p < 0.3; repeatable")
    h.add_argument("--k-max", type=int, default=12)
    h.add_argument("--train-tokens", type=int, default=64, help="tokens per recorded training trace")
    h.add_argument("--train-only", action="store_true", help="train and cache the heads, skip the timed evaluation")
    h.add_argument("--cache", default="bench_out/traces", help="where recorded training traces are kept")
    h.add_argument("--out", default="bench_out")
    h.add_argument("--name", default="bench-draft")

    r = sub.add_parser("bench-replay", help="acceptance of drafter and decoding variants on recorded greedy traces")
    r.add_argument("--pair", default=f"{DRAFTER}:qwen2.5-coder-0.5b")
    r.add_argument("--dataset", action="append", help="gsm8k:test | humaneval | ..., repeatable")
    r.add_argument("--n", type=int, default=50)
    r.add_argument("--drafter", action="append", choices=["fp32", "int8", "int8-per-channel", "int8-per-tensor"],
                   help="drafter numerics, repeatable (default: int8)")
    r.add_argument("--decode", action="append", help='DecodeConfig overrides such as "heal=off,k=8", repeatable '
                                                     "(keys: k, stop, heal, strategy; default: the defaults)")
    r.add_argument("--cache", default="bench_out/traces", help="where recorded traces are kept")
    r.add_argument("--out", default="bench_out")
    r.add_argument("--name", default="bench-replay")
    decoding(r)

    c = sub.add_parser("bench-cache", help="the n-gram cache by size and policy on two tokenizers (a reference drafter, no weights)")
    c.add_argument("--drafter", default="llama-2", help="drafter tokenizer: llama-2, llama-3 (data/tokenizers), a preset or a path")
    c.add_argument("--target", default="llama-3", help="target tokenizer, as --drafter")
    c.add_argument("--dataset", action="append", help="gsm8k:train | gsm8k | humaneval | humaneval:train, repeatable")
    c.add_argument("--n", type=int, default=500, help="reference answers per dataset (HumanEval has 164)")
    c.add_argument("--k", type=int, default=6, help="drafted tokens per round")
    c.add_argument("--accuracy", type=float, action="append", help="chance each drafted token is right, repeatable (default 0.8)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", default="bench_out")
    c.add_argument("--name", default="bench-cache")

    w = sub.add_parser("bench-switch", help="one drafter moving between targets: pair(), save, adapter switch, memory")
    w.add_argument("--drafter", default=DRAFTER)
    w.add_argument("--target", action="append", help="repeatable, at least two (default: qwen2.5-coder-0.5b and gemma3-270m)")
    w.add_argument("--n", type=int, default=3, help="prompts (GSM8K and HumanEval, alternating)")
    w.add_argument("--max-new-tokens", type=int, default=24)
    w.add_argument("--repeats", type=int, default=200, help="adapter switches timed")
    w.add_argument("--out", default="bench_out")
    w.add_argument("--name", default="bench-switch")

    e = sub.add_parser("export", help="export the drafter (with a pairing's adapter merged) to ONNX")
    e.add_argument("--drafter", default=DRAFTER)
    e.add_argument("--target", default=None, help="merge this target's adapter and prune for this pairing")
    e.add_argument("--user", default=None, help="whose profile's adapter (default: the target's default profile)")
    e.add_argument("--out", required=True, help="path ending in .onnx; the sidecar is OUT.json")
    e.add_argument("--quantize", choices=["int8"], default=None, help="dynamic int8 (onnxruntime quantizer)")
    e.add_argument("--prune", action="store_true",
                   help="keep only LM-head rows the pairing can use (shared vocabulary + n-gram sub-tokens); needs --target")
    e.add_argument("--parity-prompts", type=int, default=4, help="prompts for the export-time parity check (0: skip)")

    r = sub.add_parser("bench-drafters", help="drafting backends side by side: PyTorch fp32/int8 and exported ONNX graphs")
    r.add_argument("--pair", default=f"{DRAFTER}:qwen2.5-coder-0.5b", help="DRAFTER:TARGET (the PyTorch drafter)")
    r.add_argument("--onnx", action="append", default=[], metavar="LABEL=FILE", help="an exported drafter, repeatable")
    r.add_argument("--dataset", action="append", help="gsm8k | humaneval, repeatable (none: drafter costs only)")
    r.add_argument("--n", type=int, default=5)
    r.add_argument("--out", default="bench_out")
    r.add_argument("--name", default="bench-drafters")
    decoding(r)

    v = sub.add_parser("serve", help="a verification server for remote pairing (RemoteTarget)")
    v.add_argument("--target", default=TARGET)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key-file", default=None, help="file holding the API key clients must send")
    v.add_argument("--no-auth", action="store_true", help="serve without an API key (loopback development only)")
    v.add_argument("--max-sessions", type=int, default=64)
    v.add_argument("--ttl", type=float, default=600.0, help="seconds an idle session is kept")

    c = sub.add_parser("calibrate", help="time the real models; write a device_sim device profile")
    c.add_argument("--pair", default=f"{DRAFTER}:{TARGET}")
    c.add_argument("--out", required=True, help="profile JSON to write (device_sim --profiles FILE)")
    c.add_argument("--max-tokens", type=int, default=12)
    decoding(c)

    o = sub.add_parser("doctor", help="what this machine offers: backends, presets, and the measured kernel plan")
    o.add_argument("--target", action="append", default=[], help="also show this model's kernel plan, repeatable")

    s = sub.add_parser("simulate", help="python -m device_sim with the same arguments", add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def split_pair(pair: str) -> tuple[str, str]:
    """"DRAFTER:TARGET" -> (drafter spec, target spec); exits with the usage error otherwise."""
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
    return drafter.pair(target, k=args.k, stop_confidence=args.stop_confidence, strategy=args.strategy,
                        drafts=(args.drafts or ["hybrid"])[0], **extra)


def _generate(args: argparse.Namespace) -> None:
    import torch

    pair = _load_pair(*split_pair(args.pair), args)
    gen = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    for piece in pair.stream(args.prompt, max_new_tokens=args.max_new_tokens, generator=gen):
        sys.stdout.write(piece)
        sys.stdout.flush()
    s = pair.last.stats
    print(f"\n\n[{s.new_tokens} tokens, {s.tokens_per_second:.2f} tok/s, acceptance {s.acceptance_rate:.2f}, "
          f"τ {s.mean_accepted_length:.2f}, n-gram hits/round {s.ngram_hits_per_round:.2f}]", file=sys.stderr)


def _run(pair_spec: str, datasets: list[str], args: argparse.Namespace, peers: tuple[str, ...], trace: str | None,
         partial: Callable[[list, dict], None] = lambda *_: None) -> tuple[list, dict]:
    from tqdm import tqdm

    from .bench.datasets import load_prompts
    from .bench.runner import pairing_costs, run_prompts, summarize
    from .stats import write_trace

    pair = _load_pair(*split_pair(pair_spec), args)
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

        results = run_prompts(pair, prompts, args.max_new_tokens, peers=peers, trace=record, done=done,
                              progress=lambda msg: (bar.set_postfix_str(msg), bar.update(msg.endswith("omnidraft"))))
        bar.close()
        summary = summarize(results)
        step = sum(r.target_s for r in results) / sum(r.new_tokens for r in results)
        summaries.append({**head, **summary, "costs": pairing_costs(pair, step)})
    return summaries, per_prompt


def _demo(args: argparse.Namespace) -> None:
    summaries, per_prompt = _run(f"{args.drafter}:{args.target}", ["gsm8k", "humaneval"], args, peers=(), trace=None)
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


def loaded_pairs(specs: list[str] | None, default: str) -> Iterator[tuple[str, Any, Any]]:
    """(spec, drafter, target) for each DRAFTER:TARGET spec, loaded one pair at a time."""
    import omnidraft as od

    for pair_spec in specs or [default]:
        drafter_spec, target_spec = split_pair(pair_spec)
        yield pair_spec, od.Drafter.load(drafter_spec), od.LocalTarget.load(target_spec)


def _bench_remote(args: argparse.Namespace) -> None:
    import json

    from tqdm import tqdm

    from .atomic import atomic_write_bytes
    from .bench.datasets import load_prompts
    from .bench.remote import run_remote
    from .stats import write_trace

    rows = []
    for pair_spec, drafter, target in loaded_pairs(args.pair, f"{DRAFTER}:{TARGET}"):
        for dataset in args.dataset or ["gsm8k", "humaneval"]:
            bar = tqdm(desc=f"{pair_spec} {dataset} remote", file=sys.stderr)
            record = (lambda rtt, i, out, dataset=dataset, pair_spec=pair_spec: write_trace(
                args.trace, out.rounds, {"pair": pair_spec, "dataset": dataset, "prompt": i, "rtt_ms": rtt * 1000})) \
                if args.trace else None
            for row in run_remote(drafter, target, load_prompts(dataset, args.n), args.max_new_tokens,
                                  [ms / 1000 for ms in args.rtt or [20, 50, 100]], k=args.k,
                                  progress=bar.set_postfix_str, trace=record):
                rows.append({"pair": pair_spec, "dataset": dataset, **row})
            bar.close()
    out = Path(args.out)
    table = ("Speedup is over the server alone: one completion request, the whole completion generated on the server, "
             "at the same injected RTT. fwd/token: target forwards per committed token (what speculating saves a "
             "server). speculated: requests the latency objective chose to speculate on.\n\n"
             "| pair | dataset | RTT ms | row | s/request | tok/s | speedup | fwd/token | bytes sent/token | identical | "
             "speculated |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        table += (f"| {r['pair']} | {r['dataset']} | {r['rtt_ms']:.0f} | {r['row']} | {r['seconds_per_request']:.2f} | "
                  f"{r['tok_s']:.2f} | {r['speedup']:.2f}× | {r['forwards_per_token']:.2f} | {r['bytes_sent_per_token']:.0f} | "
                  f"{r['identical']}/{r['prompts']} | {r['speculated']}/{r['prompts']} |\n")
    atomic_write_bytes(out / f"{args.name}.json", json.dumps(rows, indent=1).encode())
    atomic_write_bytes(out / f"{args.name}.md", table.encode())
    print(table)
    print(f"wrote {out / args.name}.json and .md")


def _bench_k_grid(args: argparse.Namespace) -> None:
    import json

    from tqdm import tqdm

    from .atomic import atomic_write_bytes
    from .bench.datasets import load_prompts
    from .bench.runner import default_against_fixed_k

    out, results, table = Path(args.out), [], ""
    for pair_spec, drafter, target in loaded_pairs(args.pair, f"{DRAFTER}:qwen2.5-coder-0.5b"):
        for dataset in args.dataset or ["gsm8k", "humaneval"]:
            bar = tqdm(desc=f"{pair_spec} {dataset} k-grid", file=sys.stderr)
            res = default_against_fixed_k(drafter, target, load_prompts(dataset, args.n), args.max_new_tokens,
                                          args.k_grid, progress=bar.set_postfix_str)
            bar.close()
            results.append({"pair": pair_spec, "dataset": dataset, **res})
            r = res["default_vs_best"]
            table += (f"\n{pair_spec} {dataset}: target alone {res['target_tok_s']:.2f} tok/s; default vs best fixed "
                      f"{res['best_fixed']}: {r['ratio']:.3f} (95% {r['low']:.3f}-{r['high']:.3f}), faster on "
                      f"{r['wins']}/{r['prompts']} prompts\n\n| variant | tok/s | speedup | τ | drafted/round | identical |\n"
                      "|---|---|---|---|---|---|\n")
            table += "".join(f"| {row['variant']} | {row['tok_s']:.2f} | {row['speedup']:.2f}× | {row['tau']:.2f} | "
                             f"{row['drafted_per_round']:.2f} | {row['identical']}/{row['prompts']} |\n" for row in res["rows"])
            atomic_write_bytes(out / f"{args.name}.json", json.dumps(results, indent=1).encode())
            atomic_write_bytes(out / f"{args.name}.md", table.encode())
    print(table)
    print(f"wrote {out / args.name}.json and .md")


def _bench_sources(args: argparse.Namespace) -> None:
    import json

    from tqdm import tqdm

    from .atomic import atomic_write_bytes
    from .bench.sources import markdown, run_sources

    out, results = Path(args.out), {}
    for pair_spec, drafter, target in loaded_pairs(args.pair, f"{DRAFTER}:{TARGET}"):
        bar = tqdm(desc=f"{pair_spec} drafts", file=sys.stderr)
        results[pair_spec] = run_sources(
            drafter, target, args.dataset or ["summarize", "rag", "code-edit", "chat", "gsm8k", "humaneval"], args.n,
            args.max_new_tokens, drafts=tuple(args.drafts), peers=() if args.no_peers else tuple(args.peer or ("lookup", "assisted")),
            relaxed=args.relaxed, progress=bar.set_postfix_str, k=args.k, stop_confidence=args.stop_confidence, strategy=args.strategy)
        bar.close()
        text = "".join(f"## {spec}\n\n{markdown(r)}\n" for spec, r in results.items())
        atomic_write_bytes(out / f"{args.name}.json", json.dumps(results, indent=1).encode())
        atomic_write_bytes(out / f"{args.name}.md", text.encode())
    print(text)
    print(f"wrote {out / args.name}.json and .md")


def _bench(args: argparse.Namespace) -> None:
    from .bench.report import markdown_table, write_report

    if args.remote:
        return _bench_remote(args)
    if args.k_grid:
        return _bench_k_grid(args)
    if args.drafts and len(args.drafts) > 1:
        return _bench_sources(args)

    pairs = args.pair or [f"{DRAFTER}:qwen2.5-coder-0.5b"]
    summaries, per_prompt = [], {}
    for pair_spec in pairs:
        s, p = _run(pair_spec, args.dataset or ["gsm8k", "humaneval"], args, trace=args.trace,
                    peers=() if args.no_peers else tuple(args.peer or ("stock", "lookup", "assisted")),
                    partial=lambda rows, prompts: write_report(args.out, args.name, [*summaries, *rows], {**per_prompt, **prompts}))
        summaries += s
        per_prompt.update(p)
        paths = write_report(args.out, args.name, summaries, per_prompt)  # rewritten after each pair
    print(markdown_table(summaries))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")


def _export(args: argparse.Namespace) -> None:
    import json

    from .bench.datasets import load_prompts
    from .distill.adapters import config_from_state
    from .export.onnx import export_drafter
    from .models import load_model
    from .translate.token_bytes import build_token_bytes

    if args.prune and not args.target:
        raise SystemExit("--prune needs --target: pruning keeps the tokens that pairing can use")
    loaded = load_model(args.drafter)
    tokenizer, token_bytes = loaded.tokenizer, build_token_bytes(loaded.tokenizer, loaded.model.config.vocab_size)
    adapter, adapter_id, keep = None, None, None
    if args.target:
        adapter, adapter_id, keep = _pairing_for_export(loaded.name, tokenizer, token_bytes, args)
    prompts = [tokenizer(p)["input_ids"] for p in load_prompts("gsm8k", max(1, args.parity_prompts // 2))
               + load_prompts("humaneval", max(1, args.parity_prompts - args.parity_prompts // 2))][: args.parity_prompts]
    sidecar = export_drafter(loaded.model, args.out, name=loaded.name, tokenizer=tokenizer, fingerprint=token_bytes.fingerprint,
                             adapter=adapter, adapter_config=config_from_state(adapter) if adapter else None,
                             adapter_id=adapter_id, quantize=args.quantize, keep_ids=keep, parity_prompts=prompts or None)
    shown = {k: v for k, v in sidecar.items() if k != "keep_ids"}
    shown["kept_tokens"] = len(sidecar["keep_ids"]) if sidecar["keep_ids"] else None
    print(json.dumps(shown, indent=1))


def _pairing_for_export(drafter_name: str, tokenizer: Any, token_bytes: Any, args: argparse.Namespace) -> tuple:
    """(adapter tensors, adapter id, kept token ids) of the (drafter, target, user) profile for export."""
    import omnidraft as od

    from .profiles import ProfileStore
    from .translate.vocab_map import build_vocab_map

    target = od.LocalTarget.load(args.target, kernels=False)
    fingerprint = f"{token_bytes.fingerprint}:{target.token_bytes.fingerprint}"
    profile = ProfileStore().load(drafter_name, target.name, args.user or "default", fingerprint=fingerprint)
    if profile is None and args.user:
        raise SystemExit(f"no profile of user {args.user!r} for {drafter_name} -> {target.name}")
    adapter = adapter_id = keep = None
    if profile is not None and "adapter" in profile.tensors:
        adapter, adapter_id = profile.tensors["adapter"], f"{target.name}/{profile.user}@step{profile.steps}"
    if args.prune:
        vmap = build_vocab_map(token_bytes, target.token_bytes, tokenizer, target.tokenizer)
        kept = set((vmap.d2t >= 0).nonzero().flatten().tolist())
        if profile is not None and profile.ngram is not None:
            kept |= {t for key, _ in profile.ngram["entries"] for t in key}
        kept |= {i for i in (tokenizer.eos_token_id, tokenizer.bos_token_id) if isinstance(i, int)}
        keep = sorted(kept)
    return adapter, adapter_id, keep


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    import omnidraft as od

    from .remote.server import ServerConfig, create_app

    if args.api_key_file is None and not args.no_auth:
        raise SystemExit("serve needs --api-key-file FILE (or --no-auth for a loopback-only development server)")
    key = None
    if args.api_key_file is not None:
        key = Path(args.api_key_file).read_text().strip()
        if not key:
            raise SystemExit(f"{args.api_key_file} is empty: put the API key in it")
    config = ServerConfig(api_key=key, max_sessions=args.max_sessions, ttl_s=args.ttl)
    uvicorn.run(create_app(od.LocalTarget.load(args.target), config), host=args.host, port=args.port, log_level="warning")


def _calibrate(args: argparse.Namespace) -> None:
    import json

    from .atomic import atomic_write_bytes
    from .calibrate import calibrate

    profile = calibrate(_load_pair(*split_pair(args.pair), args), max_tokens=args.max_tokens)
    atomic_write_bytes(Path(args.out), json.dumps({"devices": [profile]}, indent=1).encode())
    print(json.dumps(profile, indent=1))


def _doctor(args: argparse.Namespace) -> None:
    from .doctor import report

    print("\n".join(report(args.target)))


def _simulate(args: argparse.Namespace) -> None:
    from device_sim.__main__ import main as simulate_main

    simulate_main(args.rest)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("transformers", "httpx", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if getattr(args, "n", 1) < 1 or getattr(args, "max_new_tokens", 1) < 1:
        raise SystemExit(f"--n and --max-new-tokens must be >= 1, got {getattr(args, 'n', 1)} and "
                         f"{getattr(args, 'max_new_tokens', 1)}")
    from .bench import commands as experiments

    commands = {"generate": _generate, "demo": _demo, "bench": _bench, "adapt": experiments.adapt,
                "bench-draft": experiments.bench_draft, "bench-replay": experiments.bench_replay, "export": _export,
                "bench-drafters": experiments.bench_drafters, "bench-cache": experiments.bench_cache, "serve": _serve,
                "bench-switch": experiments.bench_switch,
                "calibrate": _calibrate, "simulate": _simulate, "doctor": _doctor}
    commands[args.command](args)


if __name__ == "__main__":
    main()
