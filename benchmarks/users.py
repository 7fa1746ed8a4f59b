"""`python -m benchmarks users`: does a user's own adapter draft better *for that user* than the
per-target adapter every user shares, after how many of the user's requests, at what cost?

Each user is an ordered stream of requests of one kind (a developer completing functions, a math
tutor, a news summarizer, an analyst answering from documents: `USERS`), from the repository's
data. Per user the first `n_train` requests are the stream it works through and the next `n_test`
are held back. The target's greedy continuations with their top-k rows are recorded once (cached
beside the results, adapt_eval.traces_for); everything after runs the drafter only, against a
`ReplayTarget` of those recordings, as benchmarks/adapt.py does:
- "none": the drafter without an adapter, on each user's held-back requests;
- "own": a fresh adapter per user, trained online (Algorithm 2, the pairing's `TrainConfig`) on
  that user's stream in order, scored on that user's held-back requests after each checkpoint;
- "shared": one adapter trained on every user's stream interleaved (request i of each user in
  turn), scored at the same checkpoints of each user's stream;
- "cross": each user's final adapter on every other user's held-back requests;
- "own from shared" (`from_shared`): what a new user of the SDK gets when a shared adapter exists
  (distill/attach.py): an adapter trained on the *other* users' streams, then on this user's own,
  scored at 0 (the shared adapter without this user) and after each checkpoint of the user's stream;
- "switch:A" (`switch=(A, B)`): user A's whole stream, then B's, scored on B's held-back requests
  at 0, 5, 10 and 25 requests of B's work: how fast an adapter recovers when its user's work
  changes (against B's "none" and "own" rows);
- live (`live`, a target on the fastest local engine: `--live` puts the target on llama.cpp): each
  user's held-back requests timed on that engine alone and through a pairing of its defaults
  drafting with no adapter and with each kind's final adapter, side by side per request
  (bench/llama.time_rows): the speed a user sees, against the engine and against no adapter.
Figures per score: greedy acceptance, tau (adapt_eval.evaluate). Costs: the adapter's bytes,
training seconds per request and per committed token, the process's peak RSS. The plot (PNG):
acceptance against the user's requests, one line per user and adapter kind.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import time
from functools import partial
from pathlib import Path
from typing import Any

from omnidraft.distill.buffer import build_example
from omnidraft.distill.trace_store import ReplayTarget
from omnidraft.distill.trainer import OnlineTrainer, TrainConfig
from omnidraft.translate.vocab_map import build_vocab_map

from .adapt_eval import evaluate, prompts_for, request_of, traces_for
from .users_report import markdown, plot

__all__ = ["USERS", "add_args", "live_speed", "run", "run_users"]

log = logging.getLogger("omnidraft")

USERS = {"developer": "humaneval", "math-tutor": "gsm8k", "news-summarizer": "summarize", "analyst": "rag"}
SWITCH_AFTER = (0, 5, 10, 25)  # requests of the new work after a switch, scored


def run_users(
    drafter: Any,
    target: Any,
    *,
    n_train: int,
    n_test: int,
    max_new_tokens: int,
    checkpoints: list[int],
    config: TrainConfig,
    rank: int,
    k: int,
    out: Path,
    name: str,
    users: dict[str, str] = USERS,
    switch: tuple[str, str] | None = None,
    from_shared: bool = False,
    federated: bool = False,
    live: Any = None,
    live_tokens: int = 64,
) -> dict[str, Any]:
    """The experiment of the module doc; writes `name`.json/.md/.png under `out`."""
    from omnidraft.distill.adapters import AdapterConfig

    out.mkdir(parents=True, exist_ok=True)
    streams, held = {}, {}
    for user, dataset in users.items():
        traces = traces_for(target, dataset, n_train + n_test, max_new_tokens, out)
        prompts = prompts_for(target, dataset, traces)
        streams[user] = list(zip(traces[:n_train], prompts[:n_train]))
        held[user] = (traces[n_train:], prompts[n_train:])
    replay = ReplayTarget.like(
        target, [t for u in users for t, _ in streams[u]] + [t for u in users for t in held[u][0]]
    )
    t2d = build_vocab_map(drafter.token_bytes, target.token_bytes, drafter.tokenizer, target.tokenizer).t2d
    lora = AdapterConfig(rank=rank, alpha=2 * rank)
    checkpoints = sorted({c for c in checkpoints if 0 < c <= n_train} | {n_train})
    rows: list[dict[str, Any]] = []

    def score(adapter: str | None, user: str) -> dict[str, float]:
        traces, prompts = held[user]
        figures = evaluate(drafter, replay, traces, prompts, k=k, stop_confidence=0.0, adapter=adapter)
        return {"acceptance": figures["acceptance_rate"], "tau": figures["tau"]}

    costs: dict[str, Any] = {}
    result = {
        "pair": f"{drafter.name}:{target.name}",
        "users": users,
        "n_train": n_train,
        "n_test": n_test,
        "max_new_tokens": max_new_tokens,
        "k": k,
        "rank": rank,
        "config": dict(vars(config)),
        "rows": rows,
        "costs": costs,
    }

    def save() -> None:  # after each phase: a run cut short keeps what it measured
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        (out / f"{name}.md").write_text(markdown(result))

    for user in users:
        rows.append({"user": user, "adapter": "none", "requests": 0, **score(None, user)})
    save()
    finals: dict[str, dict[str, str | None]] = {user: {"none": None} for user in users}
    for user in users:  # "own": each user's adapter on its own stream
        adapter = finals[user]["own"] = f"user_{user}_{time.time_ns()}"
        stream = streams[user]
        trained = _train(drafter, adapter, lora, t2d, target, config, [stream], checkpoints, costs, user)
        for requests, state in trained.items():
            _rewind(drafter, adapter, state)
            rows.append({"user": user, "adapter": "own", "requests": requests, **score(adapter, user)})
        save()
    shared = f"shared_{time.time_ns()}"  # "shared": all streams interleaved, scored at each user's count
    trained = _train(
        drafter, shared, lora, t2d, target, config, list(streams.values()), checkpoints, costs, "shared"
    )
    for requests in trained:
        _rewind(drafter, shared, trained[requests])
        for user in users:
            rows.append({"user": user, "adapter": "shared", "requests": requests, **score(shared, user)})
        save()
    for user in users:  # "cross": a user's final adapter on the others' requests
        finals[user]["shared"] = shared  # (left at its last checkpoint: the final one)
        for other in users:
            if other != user:
                own = score(finals[user]["own"], other)
                rows.append({"user": other, "adapter": f"cross:{user}", "requests": n_train, **own})
    save()
    for user in users if from_shared else []:  # the others' shared adapter, then the user's own stream
        others = [streams[other] for other in users if other != user]
        base = f"without_{user}_{time.time_ns()}"
        start = _train(drafter, base, lora, t2d, target, config, others, [n_train], costs, f"without {user}")
        rows.append({"user": user, "adapter": "own from shared", "requests": 0, **score(base, user)})
        adapter = finals[user]["own from shared"] = f"from_shared_{user}_{time.time_ns()}"
        label = f"{user} from shared"
        trained = _train(
            drafter,
            adapter,
            lora,
            t2d,
            target,
            config,
            [streams[user]],
            checkpoints,
            costs,
            label,
            start[n_train],
        )
        for requests, state in trained.items():
            _rewind(drafter, adapter, state)
            rows.append(
                {"user": user, "adapter": "own from shared", "requests": requests, **score(adapter, user)}
            )
        save()
    if federated:  # adapters averaged across the users' devices, no text pooled (distill/federated.py)
        rows += _federated(drafter, lora, t2d, target, config, streams, checkpoints, costs, score, result)
        save()
    if switch is not None:  # a user whose work changes: A's stream, then B's
        first, then = switch
        after = [c for c in SWITCH_AFTER if c <= n_train]
        adapter = f"switch_{time.time_ns()}"
        stream = streams[first] + streams[then][: max(after)]
        marks = [n_train + c for c in after]
        trained = _train(drafter, adapter, lora, t2d, target, config, [stream], marks, costs, "switch")
        for requests, state in trained.items():
            _rewind(drafter, adapter, state)
            kind = f"switch:{first}"
            rows.append(
                {"user": then, "adapter": kind, "requests": requests - n_train, **score(adapter, then)}
            )
        save()
    if live is not None:  # last: the switch run moved no final adapter
        result["live"] = live_speed(drafter, live, {u: held[u][1] for u in users}, finals, live_tokens)
        save()
    plot(result, out / f"{name}.png")
    return result


def _federated(
    drafter: Any,
    lora: Any,
    t2d: Any,
    target: Any,
    config: TrainConfig,
    streams: dict[str, list[tuple[Any, str]]],
    checkpoints: list[int],
    costs: dict[str, Any],
    score: Any,
    result: dict[str, Any],
) -> list[dict[str, Any]]:
    """FedAvg rounds between checkpoints: each user's device trains from the last shared adapter on
    its own requests of the round ("federated + own": that adapter, scored on the user's held-back
    requests), uploads it, and the server's average of the round's uploads (weighted by requests,
    clipped: `fedavg`) is the next shared adapter ("federated", scored on every user). Every own
    adapter starts from the same initial weights (the trainer's seed), as a first shared version."""
    import torch

    from omnidraft.distill.adapters import adapter_state
    from omnidraft.distill.federated import encode_state, fedavg

    torch.manual_seed(config.seed)
    fed = f"federated_{time.time_ns()}"
    drafter.add_adapter(fed, lora)
    shared = {k: v.clone() for k, v in adapter_state(drafter.trainable, fed).items()}
    rows, done, sent = [], 0, []
    for mark in checkpoints:
        uploads = []
        for user, stream in streams.items():
            local = f"fedlocal_{user}_{mark}_{time.time_ns()}"
            label = f"federated {user}"
            state = _train(
                drafter,
                local,
                lora,
                t2d,
                target,
                config,
                [stream[done:mark]],
                [mark - done],
                costs,
                label,
                shared,
            )[mark - done]
            _rewind(drafter, local, state)
            rows.append({"user": user, "adapter": "federated + own", "requests": mark, **score(local, user)})
            uploads.append((state, mark - done))
            sent.append(len(encode_state(state)))
        shared = fedavg(uploads, shared)
        _rewind(drafter, fed, shared)
        for user in streams:
            rows.append({"user": user, "adapter": "federated", "requests": mark, **score(fed, user)})
        done = mark
    result["federated_bytes_sent_per_round"] = max(sent)
    return rows


def live_speed(
    drafter: Any,
    target: Any,
    prompts: dict[str, list[str]],
    adapters: dict[str, dict[str, str | None]],
    max_new_tokens: int,
) -> dict[str, Any]:
    """Per user, `prompts[user]` timed side by side: `target`'s engine alone (llama-cpp-python's own
    generate for a llama.cpp target, as `omnidraft bench` times it) and one pairing of the defaults
    per adapter kind, drafting with `adapters[user][kind]`. Per user and kind: the summary of
    bench/llama.summarize_llama (speed over the engine, worst request, identical outputs) and the
    speed over the pairing with no adapter."""
    from omnidraft.bench.baselines import target_alone
    from omnidraft.bench.llama import llama_alone, pairing_row, summarize_llama, time_rows
    from omnidraft.llamacpp.llama_target import LlamaCppTarget

    alone = "engine alone"
    if isinstance(target, LlamaCppTarget):
        engine = llama_alone(target, max_new_tokens)
    else:
        engine = lambda p, ids: target_alone(target, p, max_new_tokens)  # noqa: E731
    kinds = list(next(iter(adapters.values())))
    pairs = {kind: drafter.pair(target) for kind in kinds}
    engine("Warm up.", target.tokenizer("Warm up.")["input_ids"])
    for pair in pairs.values():
        pair.adapter = None
        pair.generate("Warm up.", max_new_tokens=8)
    result: dict[str, Any] = {"engine": type(target).__name__, "tokens": max_new_tokens, "users": {}}
    for user, texts in prompts.items():
        rows = {alone: engine}
        for kind, pair in pairs.items():
            pair.adapter = adapters[user][kind]
            rows[kind] = partial(pairing_row, pair, max_new_tokens)
        log.info("live: %s, %d requests", user, len(texts))
        results = time_rows(rows, texts, target.tokenizer, lambda _: None)
        summary = summarize_llama(results, base=alone)
        none_rate = next(s["tok_s"] for s in summary if s["row"] == "none")
        for s in summary:
            s["over_none"] = s["tok_s"] / none_rate
        result["users"][user] = {"requests": results, "summary": summary}
    return result


def _train(
    drafter: Any,
    adapter: str,
    lora: Any,
    t2d: Any,
    target: Any,
    config: TrainConfig,
    streams: list[list[tuple[Any, str]]],
    checkpoints: list[int],
    costs: dict[str, Any],
    label: str,
    start: dict[str, Any] | None = None,
) -> dict[int, dict[str, Any]]:
    """A fresh `adapter` (or one starting as the state `start`) trained online on `streams` read in
    turn (request i of each, then i + 1); its state at each checkpoint (requests per stream), kept
    to score after."""
    import torch

    from omnidraft.distill.adapters import adapter_state

    torch.manual_seed(config.seed)
    drafter.add_adapter(adapter, lora)
    if start is not None:
        _rewind(drafter, adapter, start)
    drafter.activate(adapter)
    trainer = OnlineTrainer(drafter.learner, t2d, config, step_lock=drafter.lock)
    states: dict[int, dict[str, Any]] = {}
    seconds, tokens = 0.0, 0
    for i in range(max(checkpoints)):
        for stream in streams:
            trace, prompt = stream[i]
            started = time.perf_counter()
            drafter.activate(adapter)
            request = request_of(trace, prompt, config.topk)
            example = build_example(
                request, drafter, target.token_bytes, t2d, spans=config.spans, context=config.context
            )
            if trainer.add(example):
                trainer.update()
            seconds += time.perf_counter() - started
            tokens += len(trace.continuation)
        if i + 1 in checkpoints:
            states[i + 1] = {
                key: value.clone() for key, value in adapter_state(drafter.trainable, adapter).items()
            }
            log.info(
                "%s: %d requests a stream, %d steps, %.0f s training", label, i + 1, trainer.steps, seconds
            )
    requests = max(checkpoints) * len(streams)
    costs[label] = {
        "train_s_per_request": seconds / requests,
        "train_ms_per_token": 1e3 * seconds / max(1, tokens),
        "steps": trainer.steps,
        "adapter_bytes": sum(v.numel() * v.element_size() for v in states[max(checkpoints)].values()),
    }
    return states


def _rewind(drafter: Any, adapter: str, state: dict[str, Any]) -> None:
    """Put `adapter`'s weights back to `state` (a checkpoint kept by `_train`)."""
    from omnidraft.distill.adapters import load_adapter_state

    with drafter.lock:
        load_adapter_state(drafter.trainable, adapter, state)


def add_args(sub: Any) -> None:
    u = sub.add_parser("users", help="per-user adapters against the shared one, on four users' streams")
    u.add_argument("--pair", default="smollm2-135m:qwen2.5-coder-0.5b")
    u.add_argument("--n-train", type=int, default=40, help="requests in each user's stream")
    u.add_argument("--n-test", type=int, default=6, help="each user's held-back requests")
    u.add_argument("--max-new-tokens", type=int, default=32)
    u.add_argument(
        "--checkpoint", type=int, action="append", help="score after this many requests, repeatable"
    )
    u.add_argument("--interval", type=int, default=4, help="requests between updates")
    u.add_argument("--epochs", type=int, default=2, help="passes over the buffer per update")
    u.add_argument("--lr", type=float, default=1e-3)
    u.add_argument(
        "--context", type=int, default=0, help="prompt tokens kept before each reply in training (0: all)"
    )
    u.add_argument("--rank", type=int, default=8)
    u.add_argument("--k", type=int, default=4)
    u.add_argument("--out", default="users_out")
    u.add_argument("--name", default="users")
    u.add_argument(
        "--from-shared",
        action="store_true",
        help="also each user's own adapter started from one trained on the other users' streams",
    )
    u.add_argument(
        "--federated",
        action="store_true",
        help="also adapters averaged across the users' devices (FedAvg rounds at the checkpoints)",
    )
    u.add_argument(
        "--live",
        action="store_true",
        help="also time each user's held-back requests on llama.cpp: alone, and drafting with each adapter",
    )
    u.add_argument("--live-tokens", type=int, default=64, help="tokens a live request generates")
    u.add_argument(
        "--switch",
        metavar="A:B",
        help="also a user whose work changes: user A's stream, then user B's (e.g. developer:math-tutor)",
    )


def run(args: argparse.Namespace) -> None:
    import omnidraft as od
    from omnidraft.cli.options import split_pair

    if min(args.n_train, args.n_test, args.max_new_tokens, args.rank, args.k, args.live_tokens) < 1:
        raise SystemExit("--n-train, --n-test, --max-new-tokens, --rank, --k, --live-tokens must be >= 1")
    try:  # TrainConfig checks its own values (--interval, --epochs, --context), before anything loads
        config = TrainConfig(interval=args.interval, epochs=args.epochs, lr=args.lr, context=args.context)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    switch = tuple(args.switch.split(":")) if args.switch else None
    if switch is not None and (len(switch) != 2 or not set(switch) <= set(USERS) or switch[0] == switch[1]):
        raise SystemExit(f"--switch takes two different users A:B of {', '.join(USERS)}; got {args.switch!r}")
    drafter_spec, target_spec = split_pair(args.pair)
    drafter = od.Drafter.load(drafter_spec, backend="torch")
    target = od.LocalTarget.load(target_spec, kernels=False)
    live = od.LlamaCppTarget(target_spec) if args.live else None
    result = run_users(
        drafter,
        target,
        n_train=args.n_train,
        n_test=args.n_test,
        max_new_tokens=args.max_new_tokens,
        checkpoints=args.checkpoint or [10, 25, 50, 100],
        config=config,
        rank=args.rank,
        k=args.k,
        out=Path(args.out),
        name=args.name,
        switch=switch,
        from_shared=args.from_shared,
        federated=args.federated,
        live=live,
        live_tokens=args.live_tokens,
    )
    print(markdown(result))
