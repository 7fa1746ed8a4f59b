"""The lab: `python -m benchmarks COMMAND`. The experiments behind docs/ (distillation, draft-length
policies, replayed drafter variants, the n-gram cache, adapter switching, drafting backends,
device calibration, per-user adapters); the SDK (`omnidraft/`) never imports from here."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omnidraft.cli.options import DRAFTER, TARGET, add_decoding_args, load_pair, split_pair, start_run

from . import engines, experiments, learning_cost, users


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks", description="omnidraft's experiments (see docs/)."
    )
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("adapt", help="online distillation: acceptance and τ against training steps, held-out")
    a.add_argument("--pair", default=f"{DRAFTER}:qwen2.5-coder-0.5b")
    a.add_argument("--train", default="gsm8k:train", help="dataset of training prompts")
    a.add_argument("--eval", default="gsm8k:test", help="dataset of held-out prompts")
    a.add_argument("--n-train", type=int, default=300)
    a.add_argument("--n-eval", type=int, default=50)
    a.add_argument("--steps", type=int, default=40, help="optimizer steps per variant")
    a.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every this many steps")
    a.add_argument(
        "--variant",
        action="append",
        choices=["none", "dm", "hybrid", "spans", "full", "full-spans"],
        help="repeatable; default: none, hybrid and spans. dm = KL only; hybrid = the paper's KL + NLL; "
        "spans = hybrid + NLL on misaligned runs of target tokens (what learning pairings use); "
        "full = full fine-tuning on hybrid's loss; full-spans = full fine-tuning on spans' loss",
    )
    a.add_argument("--interval", type=int, default=8, help="requests between updates (Algorithm 2's I)")
    a.add_argument("--batch-size", type=int, default=8)
    a.add_argument("--epochs", type=int, default=1, help="passes over the buffer per update")
    a.add_argument("--lr", type=float, default=1e-4)
    a.add_argument(
        "--full-lr",
        type=float,
        help="learning rate of the full fine-tuning variants (default: --lr; every weight moves, so it wants "
        "a smaller one)",
    )
    a.add_argument(
        "--decay-steps",
        type=int,
        default=0,
        help="anneal the lr along a cosine to lr * --final-lr-ratio over this many steps (default 0: "
        "constant)",
    )
    a.add_argument("--final-lr-ratio", type=float, default=0.1)
    a.add_argument("--lam", default="0.2", help="n-gram loss weight, or 'dynamic'")
    a.add_argument(
        "--direct-nll",
        type=float,
        help="weight of an NLL on the committed token at direct positions (hard labels), added to the KL; "
        "default: TrainConfig's (the paper's variants dm, hybrid and full always use 0)",
    )
    a.add_argument("--rank", type=int, default=32)
    a.add_argument(
        "--modules",
        help="comma-separated projections that get LoRA adapters; default: the attention's q,k,v,o",
    )
    a.add_argument(
        "--cache-ablation", action="store_true", help="also measure the n-gram cache by size and policy"
    )
    a.add_argument(
        "--record-batch",
        type=int,
        default=8,
        help="prompts the target records at once when traces are not cached yet (a larger batch records "
        "faster on CPU; a near-tie argmax may flip with the batch)",
    )
    a.add_argument(
        "--drafter-precision",
        choices=["int8", "fp32"],
        default="int8",
        help="weights the drafter drafts with (default int8, as Drafter.load)",
    )
    a.add_argument(
        "--train-weights",
        choices=["drafting", "fp32"],
        default="drafting",
        help="weights an int8 drafter's adapter trains through: the int8 ones it drafts with, emulated in "
        "fp32 (default), or the fp32 base",
    )
    a.add_argument(
        "--tts-every",
        type=int,
        default=0,
        metavar="S",
        help="also score with Test-Time Speculation: a fast step every S rounds inside each held-out request",
    )
    a.add_argument("--tts-lr", type=float, default=1e-3, help="learning rate of those fast steps")
    a.add_argument(
        "--eval-max-new-tokens",
        type=int,
        default=None,
        metavar="N",
        help="held-out requests this long (default: --max-new-tokens); Test-Time Speculation needs long ones",
    )
    a.add_argument(
        "--live",
        type=int,
        default=0,
        metavar="N",
        help="also run the unadapted and adapted drafters against the live target on the first N held-out "
        "prompts, beside replay's figures for them (the check that replay tells the truth)",
    )
    a.add_argument("--out", default="adapt_out")
    a.add_argument("--name", default="adapt")
    add_decoding_args(a)

    h = sub.add_parser(
        "draft-lengths", help="draft-length policies live: fixed k, hysteresis fallback, acceptance heads"
    )
    h.add_argument("--pair", action="append", help="DRAFTER:TARGET, repeatable")
    h.add_argument(
        "--dataset", action="append", help="gsm8k | humaneval, repeatable (heads train on its :train split)"
    )
    h.add_argument("--n", type=int, default=10, help="evaluation prompts per dataset")
    h.add_argument("--n-train", type=int, default=100, help="training prompts per dataset for the heads")
    h.add_argument("--max-new-tokens", type=int, default=128)
    h.add_argument("--fixed-k", type=int, action="append", help="fixed draft lengths to compare, repeatable")
    h.add_argument(
        "--confidence-k",
        type=int,
        action="append",
        help="also draft up to this many tokens, stopping after one the drafter gives p < 0.3; repeatable",
    )
    h.add_argument("--k-max", type=int, default=12)
    h.add_argument("--train-tokens", type=int, default=64, help="tokens per recorded training trace")
    h.add_argument(
        "--train-only", action="store_true", help="train and cache the heads, skip the timed evaluation"
    )
    h.add_argument("--cache", default="bench_out/traces", help="where recorded training traces are kept")
    h.add_argument("--out", default="bench_out")
    h.add_argument("--name", default="bench-draft")

    r = sub.add_parser("replay", help="acceptance of drafter and decoding variants on recorded greedy traces")
    r.add_argument("--pair", default=f"{DRAFTER}:qwen2.5-coder-0.5b")
    r.add_argument("--dataset", action="append", help="gsm8k:test | humaneval | ..., repeatable")
    r.add_argument("--n", type=int, default=50)
    r.add_argument(
        "--drafter",
        action="append",
        choices=["fp32", "int8", "int8-per-channel", "int8-per-tensor"],
        help="drafter numerics, repeatable (default: int8)",
    )
    r.add_argument(
        "--decode",
        action="append",
        help='DecodeConfig overrides such as "heal=off,k=8", repeatable '
        "(keys: k, stop, heal, strategy; default: the defaults)",
    )
    r.add_argument("--cache", default="bench_out/traces", help="where recorded traces are kept")
    r.add_argument("--out", default="bench_out")
    r.add_argument("--name", default="bench-replay")
    add_decoding_args(r)

    c = sub.add_parser(
        "ngram-cache",
        help="the n-gram cache by size and policy on two tokenizers (a reference drafter, no weights)",
    )
    c.add_argument(
        "--drafter",
        default="llama-2",
        help="drafter tokenizer: llama-2, llama-3 (data/tokenizers), a preset or a path",
    )
    c.add_argument("--target", default="llama-3", help="target tokenizer, as --drafter")
    c.add_argument(
        "--dataset", action="append", help="gsm8k:train | gsm8k | humaneval | humaneval:train, repeatable"
    )
    c.add_argument("--n", type=int, default=500, help="reference answers per dataset (HumanEval has 164)")
    c.add_argument("--k", type=int, default=6, help="drafted tokens per round")
    c.add_argument(
        "--accuracy",
        type=float,
        action="append",
        help="chance each drafted token is right, repeatable (default 0.8)",
    )
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", default="bench_out")
    c.add_argument("--name", default="bench-cache")

    w = sub.add_parser(
        "switch", help="one drafter moving between targets: pair(), save, adapter switch, memory"
    )
    w.add_argument("--drafter", default=DRAFTER)
    w.add_argument(
        "--target",
        action="append",
        help="repeatable, at least two (default: qwen2.5-coder-0.5b and gemma3-270m)",
    )
    w.add_argument("--n", type=int, default=3, help="prompts (GSM8K and HumanEval, alternating)")
    w.add_argument("--max-new-tokens", type=int, default=24)
    w.add_argument("--repeats", type=int, default=200, help="adapter switches timed")
    w.add_argument("--out", default="bench_out")
    w.add_argument("--name", default="bench-switch")

    r = sub.add_parser(
        "drafters", help="drafting backends side by side: PyTorch fp32/int8 and exported ONNX graphs"
    )
    r.add_argument(
        "--pair", default=f"{DRAFTER}:qwen2.5-coder-0.5b", help="DRAFTER:TARGET (the PyTorch drafter)"
    )
    r.add_argument(
        "--onnx", action="append", default=[], metavar="LABEL=FILE", help="an exported drafter, repeatable"
    )
    r.add_argument(
        "--dataset", action="append", help="gsm8k | humaneval, repeatable (none: drafter costs only)"
    )
    r.add_argument("--n", type=int, default=5)
    r.add_argument("--out", default="bench_out")
    r.add_argument("--name", default="bench-drafters")
    r.add_argument("--target-backend", choices=["torch", "llama.cpp"], default="torch")
    r.add_argument(
        "--backend",
        action="append",
        choices=["fp32", "int8", "llama.cpp"],
        help="drafter backends to compare, repeatable (default: all three)",
    )
    r.add_argument(
        "--shortlist",
        action="append",
        metavar="KIND[:SIZE]",
        help="also the int8 drafter with this shortlisted head (static, evo or dyna; SIZE: its core, "
        "default --shortlist-size), repeatable",
    )
    r.add_argument(
        "--shortlist-size", type=int, default=8192, help="static core size (DynaSpec: its core is 1/4 of it)"
    )
    r.add_argument("--shortlist-clusters", type=int, default=1024, help="DynaSpec's clusters of head rows")
    r.add_argument("--shortlist-buffer", type=int, default=2048, help="EvoSpec's buffer capacity")
    r.add_argument(
        "--shortlist-budget", default="8,6,4", help="DynaSpec clusters per draft position, comma-separated"
    )
    add_decoding_args(r)

    s = sub.add_parser(
        "shortlists", help="shortlist policies by support size, teacher-forced on the target's text"
    )
    s.add_argument(
        "--pair", default="gemma3-270m:qwen2.5-coder-0.5b", help="DRAFTER:TARGET (the target on llama.cpp)"
    )
    s.add_argument("--dataset", action="append", help="repeatable (default: gsm8k, humaneval, summarize)")
    s.add_argument("--n", type=int, default=10)
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--size", type=int, action="append", help="static/evo support sizes (default 1k to 64k)")
    s.add_argument("--buffer", type=int, default=512, help="EvoSpec's buffer, inside each size")
    s.add_argument("--clusters", type=int, default=1024, help="DynaSpec's clusters of head rows")
    s.add_argument("--core", type=int, default=2048, help="DynaSpec's static core")
    s.add_argument(
        "--budget", type=int, action="append", help="DynaSpec clusters per position (default 1 2 4 8 16 32)"
    )
    s.add_argument("--out", default="bench_out")
    s.add_argument("--name", default="shortlists")

    v = sub.add_parser(
        "server-rounds", help="the verification server's time per round against context length"
    )
    v.add_argument("--target", default="qwen2.5-coder-1.5b")
    v.add_argument("--target-backend", choices=["torch", "llama.cpp"], default="llama.cpp")
    v.add_argument("--context", type=int, action="append", help="context lengths (default 100 500 1000 2000)")
    v.add_argument("--rounds", type=int, default=8)

    e = sub.add_parser("engines", help="one target on llama.cpp and OpenVINO, alone and paired, taking turns")
    e.add_argument("--pair", default=f"{DRAFTER}:qwen2.5-coder-0.5b")
    e.add_argument("--dataset", default="mixed")
    e.add_argument("--n", type=int, default=24)
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--repeats", type=int, default=2)
    e.add_argument("--out", help="write the per-request results (JSON) here")
    e.add_argument("--weights", default="int8", choices=["int8", "int4"], help="OpenVINO's weights")
    e.add_argument(
        "--beside",
        action="store_true",
        help="add OpenVINO on a core fewer: alone, paired in turn, paired beside (docs/overlap.md)",
    )
    c = sub.add_parser("calibrate", help="time the real models; write a device_sim device profile")
    c.add_argument("--pair", default=f"{DRAFTER}:{TARGET}")
    c.add_argument("--out", required=True, help="profile JSON to write (device_sim --profiles FILE)")
    c.add_argument("--max-tokens", type=int, default=12)
    add_decoding_args(c)

    users.add_args(sub)
    learning_cost.add_args(sub)
    return p


def _calibrate(args: argparse.Namespace) -> None:
    import json

    from omnidraft.store.atomic import atomic_write_bytes

    from .calibrate import calibrate

    profile = calibrate(load_pair(*split_pair(args.pair), args), max_tokens=args.max_tokens)
    atomic_write_bytes(Path(args.out), json.dumps({"devices": [profile]}, indent=1).encode())
    print(json.dumps(profile, indent=1))


def _server_rounds(args: argparse.Namespace) -> None:
    import omnidraft as od

    from .server_rounds import round_times

    target = (
        od.LlamaCppTarget(args.target)
        if args.target_backend == "llama.cpp"
        else od.LocalTarget.load(args.target)
    )
    rows = round_times(target, args.context or [100, 500, 1000, 2000], rounds=args.rounds)
    print(
        f"{target.name} on {args.target_backend}: server time per verify round (3-token proposals), and the "
        "target alone's time per decoded token at the same context\n\n"
        "| context | median ms | min | max | target step ms | round / step |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['context']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['max_ms']:.1f} | "
            f"{r['step_ms']:.1f} | "
            f"{r['median_ms'] / r['step_ms']:.2f} |"
        )


def _shortlists(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    import omnidraft as od

    from .shortlists import markdown, run_shortlists

    drafter_spec, target_spec = split_pair(args.pair)
    bar = tqdm(desc="shortlists", file=sys.stderr)
    result = run_shortlists(
        od.Drafter.load(drafter_spec),
        target_spec,
        datasets=args.dataset or ["gsm8k", "humaneval", "summarize"],
        n=args.n,
        tokens=args.max_new_tokens,
        sizes=args.size or [1024, 2048, 4096, 8192, 16384, 32768, 65536],
        buffer=args.buffer,
        clusters=args.clusters,
        core=args.core,
        budgets=args.budget or [1, 2, 4, 8, 16, 32],
        out=Path(args.out),
        name=args.name,
        progress=bar.set_postfix_str,
    )
    bar.close()
    print(markdown(result))


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    start_run(args)
    run = {
        "adapt": experiments.adapt,
        "draft-lengths": experiments.bench_draft,
        "replay": experiments.bench_replay,
        "ngram-cache": experiments.bench_cache,
        "switch": experiments.bench_switch,
        "drafters": experiments.bench_drafters,
        "calibrate": _calibrate,
        "server-rounds": _server_rounds,
        "shortlists": _shortlists,
        "users": users.run,
        "learning-cost": learning_cost.run,
        "engines": engines.run,
    }
    run[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
