"""The lab's experiment commands: `python -m benchmarks adapt | draft-lengths | replay | ngram-cache
| switch | drafters`.

Each turns parsed arguments (benchmarks/__main__.py's parser) into one run of its module and
prints the report. The commands a user runs day to day stay in omnidraft/cli/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omnidraft.bench.pairs import loaded_pairs
from omnidraft.cli.options import DRAFTER, split_pair
from omnidraft.decode.config import K_START

__all__ = ["adapt", "bench_cache", "bench_draft", "bench_drafters", "bench_replay", "bench_switch"]


def adapt(args: argparse.Namespace) -> None:
    from dataclasses import replace

    import omnidraft as od
    from omnidraft.distill.trainer import TrainConfig

    from .adapt import run_adapt
    from .adapt_report import markdown

    if min(args.n_train, args.n_eval, args.steps, args.eval_every, args.rank, args.record_batch) < 1:
        raise SystemExit("--n-train, --n-eval, --steps, --eval-every, --rank and --record-batch must be >= 1")
    if args.full_lr is not None and not args.full_lr > 0:
        raise SystemExit(f"--full-lr must be > 0, got {args.full_lr}")
    if args.tts_every < 0 or not args.tts_lr > 0:
        raise SystemExit(
            f"--tts-every must be >= 0 (0: off) and --tts-lr > 0, got {args.tts_every} and {args.tts_lr}"
        )
    if args.eval_max_new_tokens is not None and args.eval_max_new_tokens < 1:
        raise SystemExit(f"--eval-max-new-tokens must be >= 1, got {args.eval_max_new_tokens}")
    if args.live < 0:
        raise SystemExit(f"--live must be >= 0 (held-out prompts to check live), got {args.live}")
    drafter_spec, target_spec = split_pair(args.pair)
    quantize = "int8" if args.drafter_precision == "int8" else None
    drafter = od.Drafter.load(
        drafter_spec, quantize=quantize, train_through_int8=args.train_weights == "drafting"
    )
    target = od.LocalTarget.load(target_spec, kernels=False)
    lam = args.lam if args.lam == "dynamic" else float(args.lam)
    hard = {} if args.direct_nll is None else {"direct_nll": args.direct_nll}
    config = TrainConfig(
        interval=args.interval,
        batch_size=args.batch_size,
        epochs=args.epochs,
        lr=args.lr,
        lam=lam,
        decay_steps=args.decay_steps,
        final_lr_ratio=args.final_lr_ratio,
        **hard,
    )
    modules = tuple(m.strip() for m in args.modules.split(",") if m.strip()) if args.modules else None
    result = run_adapt(
        drafter,
        target,
        train=args.train,
        evaluation=args.eval,
        n_train=args.n_train,
        n_eval=args.n_eval,
        max_new_tokens=args.max_new_tokens,
        steps=args.steps,
        eval_every=args.eval_every,
        variants=args.variant or ["none", "hybrid", "spans"],
        config=config,
        rank=args.rank,
        k=args.k or K_START,
        modules=modules,
        stop_confidence=args.stop_confidence,
        out=Path(args.out),
        name=args.name,
        cache_study=args.cache_ablation,
        record_batch=args.record_batch,
        live=args.live,
        full_lr=args.full_lr,
        eval_max_new_tokens=args.eval_max_new_tokens,
        tts=replace(config, tts_every=args.tts_every, tts_lr=args.tts_lr) if args.tts_every else None,
        on_point=lambda p: print(
            " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in p.items()), flush=True
        ),
    )
    print(markdown(result))
    print(f"wrote {Path(args.out) / args.name}.json, .md and .png")


def bench_draft(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from .draft_lengths import run_draft_policies, write_draft_report

    if min(args.n_train, args.k_max) < 1 or any(
        k < 1 for k in (args.fixed_k or []) + (args.confidence_k or [])
    ):
        raise SystemExit("--n-train, --k-max and every --fixed-k and --confidence-k must be >= 1")
    results = []
    for pair_spec, drafter, target in loaded_pairs(args.pair, f"{DRAFTER}:qwen2.5-coder-0.5b"):
        for dataset in args.dataset or ["gsm8k", "humaneval"]:
            bar = tqdm(desc=f"{pair_spec} {dataset}", file=sys.stderr)
            res = run_draft_policies(
                drafter,
                target,
                dataset=dataset,
                train=f"{dataset}:train",
                n=args.n,
                n_train=args.n_train,
                max_new_tokens=args.max_new_tokens,
                train_tokens=args.train_tokens,
                fixed=args.fixed_k or [4, 6, 10],
                confident=args.confidence_k or [],
                k_max=args.k_max,
                cache=Path(args.cache),
                train_only=args.train_only,
                progress=bar.set_postfix_str,
            )
            bar.close()
            if res is None:
                continue
            results.append({"pair": pair_spec, **res})
            table = write_draft_report(results, Path(args.out), args.name)  # rewritten after each dataset
    if not results:
        print(f"heads trained and cached under {args.cache}")
        return
    print(table)
    print(f"wrote {Path(args.out) / args.name}.json and .md")


def bench_drafters(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    import omnidraft as od
    from omnidraft.store.models import load_model

    from .drafters import markdown, run_drafters

    drafter_spec, target_spec = split_pair(args.pair)
    files = {}
    for item in args.onnx:
        label, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            raise SystemExit(f"--onnx takes LABEL=FILE of an exported drafter, got {item!r}")
        files[label] = Path(path)
    backends = args.backend or ["fp32", "int8", "llama.cpp"]
    drafters = {}
    if "fp32" in backends:
        loaded = load_model(drafter_spec)
        drafters["pytorch fp32"] = od.TorchDrafter(loaded.model, loaded.tokenizer, loaded.name)
    if "int8" in backends:
        drafters["pytorch int8"] = od.Drafter.load(drafter_spec, backend="torch")  # not its llama.cpp copy
    if "llama.cpp" in backends:
        drafters["llama.cpp"] = od.Drafter.load(drafter_spec, backend="llama.cpp")
    for item in args.shortlist or []:
        kind, _, size = item.partition(":")
        drafter = od.Drafter.load(drafter_spec, backend="torch")
        drafter.use_shortlist(
            kind,
            size=int(size or args.shortlist_size),
            clusters=args.shortlist_clusters,
            capacity=args.shortlist_buffer,
            budget=tuple(int(b) for b in args.shortlist_budget.split(",")),
        )
        drafters[f"pytorch int8, {item} head"] = drafter
    for label, path in files.items():
        whole = od.Drafter.load(str(path))
        if (
            not whole.gathers
        ):  # a gathering graph is timed shortlisted only (its whole head is the inside graph's)
            drafters[label] = whole
        if whole.lm_head is None and not whole.gathers:
            continue
        for item in (
            args.shortlist or []
        ):  # a graph with its head outside or gathered: also each shortlisted head
            kind, _, size = item.partition(":")
            if kind == "dyna" and whole.gathers:
                continue  # DynaSpec's support follows the graph's own hidden state: outside only
            graph = od.Drafter.load(str(path))
            graph.use_shortlist(
                kind,
                size=int(size or args.shortlist_size),
                capacity=args.shortlist_buffer,
                clusters=args.shortlist_clusters,
                budget=tuple(int(b) for b in args.shortlist_budget.split(",")),
            )
            drafters[f"{label}, {item} head"] = graph
    target = None
    if args.dataset:
        target = (
            od.LlamaCppTarget(target_spec)
            if args.target_backend == "llama.cpp"
            else od.LocalTarget.load(target_spec)
        )
    bar = tqdm(desc="bench-drafters", file=sys.stderr)
    result = run_drafters(
        drafters,
        target,
        datasets=args.dataset or [],
        n=args.n,
        max_new_tokens=args.max_new_tokens,
        k=args.k or K_START,
        stop_confidence=args.stop_confidence,
        files=files,
        out=Path(args.out),
        name=args.name,
        drafts=(args.drafts or ["model"])[0],
        progress=bar.set_postfix_str,
    )
    bar.close()
    print(markdown(result))


def bench_replay(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    import omnidraft as od

    from .replay import run_replay, write_replay_report

    drafter_spec, target_spec = split_pair(args.pair)
    bar = tqdm(desc="bench-replay", file=sys.stderr)
    result = run_replay(
        drafter_spec,
        od.LocalTarget.load(target_spec, kernels=False),
        datasets=args.dataset or ["gsm8k:test"],
        n=args.n,
        max_new_tokens=args.max_new_tokens,
        schemes=args.drafter or ["int8"],
        decodes=args.decode or [""],
        base={"k": args.k or K_START, "stop_confidence": args.stop_confidence, "strategy": args.strategy},
        cache=Path(args.cache),
        progress=bar.set_postfix_str,
    )
    bar.close()
    print(write_replay_report(result, Path(args.out), args.name))


def bench_cache(args: argparse.Namespace) -> None:
    import json

    from omnidraft.store.atomic import atomic_write_bytes

    from .ngram_cache import load_end, markdown, run_cache_bench

    drafter, target = load_end(args.drafter), load_end(args.target)
    results = [
        run_cache_bench(
            drafter, target, dataset=dataset, n=args.n, k=args.k or K_START, accuracy=accuracy, seed=args.seed
        )
        for dataset in args.dataset or ["gsm8k:train", "humaneval"]
        for accuracy in args.accuracy or [0.8]
    ]
    report = "\n".join(markdown(r) for r in results)
    out = Path(args.out)
    atomic_write_bytes(out / f"{args.name}.json", json.dumps(results, indent=1).encode())
    atomic_write_bytes(out / f"{args.name}.md", report.encode())
    print(report)
    print(f"wrote {out / args.name}.json and .md")


def bench_switch(args: argparse.Namespace) -> None:
    import json
    import tempfile

    import omnidraft as od
    from omnidraft.bench.datasets import load_prompts
    from omnidraft.store.atomic import atomic_write_bytes
    from omnidraft.store.profiles import ProfileStore

    from .switch import markdown, run_switch_bench

    names = args.target or ["qwen2.5-coder-0.5b", "gemma3-270m"]
    if len(set(names)) < 2 or args.repeats < 1:
        raise SystemExit(
            f"--target needs two different targets or more, --repeats >= 1; got {names}, {args.repeats}"
        )
    drafter = od.Drafter.load(args.drafter)
    targets = [od.LocalTarget.load(name) for name in names]
    half = (args.n + 1) // 2
    prompts = [p for pair in zip(load_prompts("gsm8k", half), load_prompts("humaneval", half)) for p in pair][
        : args.n
    ]
    with tempfile.TemporaryDirectory() as scratch:  # the bench's profiles are not the user's
        result = run_switch_bench(
            drafter,
            targets,
            prompts=prompts,
            max_new_tokens=args.max_new_tokens,
            store=ProfileStore(scratch),
            repeats=args.repeats,
        )
    out = Path(args.out)
    atomic_write_bytes(out / f"{args.name}.json", json.dumps(result, indent=1).encode())
    atomic_write_bytes(out / f"{args.name}.md", markdown(result).encode())
    print(markdown(result))
    print(f"wrote {out / args.name}.json and .md")
