"""`python -m benchmarks learning-cost`: what learning (`learn=True`) costs a user's replies and the
device's CPU, on the real pair.

One user's session: `--requests` prompts of a dataset in order, each reply followed by `--think`
seconds with nothing asked (the user reading it). The same session runs on a fresh pairing and a
fresh adapter each time, after one warm-up request, each a user's pairing of its own (a profile
whose past outputs retrieval drafts from, as a learning pairing's): no adapter ("off"); a fresh
adapter drafting, learning off ("adapter": what drafting with an adapter costs, whatever it learned);
learning on in the background (the default: the learner's thread works only between requests,
held to `TrainConfig.cpu_share` of the requests' CPU, or `--cpu-share`); the same learning from
every request ("uncapped": `cpu_share=0`); learning on inline (`TrainConfig(background=False)`:
done before `generate` returns, at the same share as "background"); and the "adapter" run again
("adapter-again"): what the same run reads twice, request by request, is the noise a learning run's
replies are read against. The runs are interleaved (`interleaved`): each prompt is asked of every
run in turn, in an order rotated each prompt, and each reply's think time ends once its run's
learning is done (`spill_s`, the time past the think), so no run learns beside another's requests
and the machine's drift falls on every run alike. A learning run's replies before its adapter's
first step draft with the same weights as the "adapter" run's, so what differs there is learning's
work (between requests, and inside them: what a learning pairing keeps to learn from), not what the
adapter learned. Per run: every reply's latency (median and worst) and the time it waited for a
unit of learning to stop (`learner.waited`), the process's CPU seconds inside requests and between
them, the adapter's optimizer steps. Learning's CPU share: the CPU spent with learning on (inside
requests and between them, what a think time left included) less the same in the "adapter" run,
over that run's requests' CPU; beside it the learner's own count (`cpu_learning` over
`cpu_requests`: its units' CPU over the requests').
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["Session", "add_args", "interleaved", "markdown", "run", "session"]

RUNS = ("off", "adapter", "background", "uncapped", "inline", "adapter-again")
CONTROL = ("off", "adapter", "adapter-again")  # runs that do not learn


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Session:
    """One run's record, reply by reply: `request` asks one prompt, then lets `think` seconds pass
    with nothing asked (the user reading the reply: background learning works then) and waits for
    whatever learning is still queued (`spill_s`), so no run's learning runs beside another run's
    requests when runs are interleaved."""

    def __init__(self, pair: Any) -> None:
        self.pair, self.learner = pair, pair.learner
        self.latencies: list[float] = []
        self.waits: list[float] = []  # per reply: the time it waited for a unit of learning to stop
        self.spills: list[float] = []  # per reply: learning still queued after the think time, s
        self.rounds: list[dict[str, Any]] = []
        self.stepped: list[int] = []
        self.cpu_in = self.cpu_between = 0.0

    def request(self, prompt: str, max_new_tokens: int, think: float) -> None:
        learner = self.learner
        w0 = learner.waited if learner is not None else 0.0
        self.stepped.append(learner.steps if learner is not None else 0)
        c0, t0 = _cpu(), time.perf_counter()
        out = self.pair.generate(prompt, max_new_tokens=max_new_tokens)
        stats = out.stats
        self.latencies.append(time.perf_counter() - t0)
        self.waits.append(learner.waited - w0 if learner is not None else 0.0)
        split = {part: share * stats.seconds for part, share in stats.time_split.items()}
        self.rounds.append(
            {
                "rounds": stats.rounds,
                "proposed": sum(r.proposed for r in out.rounds),
                "draft_s": split["draft"],
                "verify_s": split["verify"],
            }
        )
        c1 = _cpu()
        self.cpu_in += c1 - c0
        time.sleep(think)
        t2 = time.perf_counter()
        if learner is not None:
            learner.wait()
        self.spills.append(time.perf_counter() - t2)
        self.cpu_between += _cpu() - c1

    def result(self) -> dict[str, Any]:
        """The run's record (its learning is done: each `request` waited for it)."""
        learner = self.learner
        return {
            "latency_s": self.latencies,
            "waited_s": self.waits,
            "spill_s": self.spills,
            "rounds": self.rounds,  # per reply: its rounds and the seconds they spent drafting and verifying
            "steps_before": self.stepped,  # per reply: the adapter's optimizer steps when it began
            "cpu_in_requests_s": self.cpu_in,
            "cpu_between_s": self.cpu_between,
            "steps": learner.steps if learner is not None else 0,
            "learned_from": len(self.latencies) - learner.skipped if learner is not None else 0,
            "learner_cpu_s": learner.cpu_learning if learner is not None else 0.0,
            "learner_requests_cpu_s": learner.cpu_requests if learner is not None else 0.0,
        }


def session(pair: Any, prompts: list[str], max_new_tokens: int, think: float) -> dict[str, Any]:
    """Run `prompts` through `pair` as one user would, `think` seconds after each reply."""
    return interleaved({"run": pair}, prompts, max_new_tokens, think)["run"]


def interleaved(
    pairs: dict[str, Any], prompts: list[str], max_new_tokens: int, think: float
) -> dict[str, dict[str, Any]]:
    """Every run's session, prompt by prompt: each prompt asked of every run in turn, the order
    rotated by one each prompt, so what drifts on the machine over the minutes a session takes
    (clocks, caches, other load) falls on every run alike; a run's replies compare with another's
    request by request."""
    sessions = {name: Session(pair) for name, pair in pairs.items()}
    names = list(sessions)
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            sessions[name].request(prompt, max_new_tokens, think)
    return {name: run.result() for name, run in sessions.items()}


def _per_round(rounds: list[dict[str, Any]], part: str) -> float:
    """`part` a round over a run's replies: seconds drafting or verifying (interference shows
    there), or "proposed", the draft tokens a round verified (longer drafts show there)."""
    return sum(r[part] for r in rounds) / max(1, sum(r["rounds"] for r in rounds))


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Learning's cost: {result['pair']} on {result['target_backend']}, {result['requests']} "
        f"{result['dataset']} requests x {result['max_new_tokens']} tokens, {result['think']} s "
        "between requests",
        "",
        "| learning | reply median s | worst reply s | CPU s in requests | CPU s between | steps "
        "| requests learned from |",
        "|---|---|---|---|---|---|---|",
    ]
    runs = [name for name in RUNS if name in result["runs"]]
    for name in runs:
        r = result["runs"][name]
        lat = r["latency_s"]
        lines.append(
            f"| {name} | {statistics.median(lat):.2f} | {max(lat):.2f} | {r['cpu_in_requests_s']:.1f} | "
            f"{r['cpu_between_s']:.1f} | {r['steps']} | {r['learned_from']} |"
        )
    ref = "adapter" if "adapter" in runs else "off"
    off = result["runs"][ref]
    lines += [
        "",
        f"Request by request against the {ref!r} run (the same requests; the runs that do not learn read "
        "the noise):",
        "",
        "| run | median reply ratio | before its first step | total | worst request (which) | its rounds "
        "| longest wait for learning to stop s | target ms a round | drafter ms a round | drafts a round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in [n for n in runs if n != ref]:
        r = result["runs"][name]
        ratios = [a / max(b, 1e-9) for a, b in zip(r["latency_s"], off["latency_s"])]
        worst = max(range(len(ratios)), key=ratios.__getitem__)
        per, both = r["rounds"], off["rounds"]
        first = [x for x, n in zip(ratios, r["steps_before"]) if n == 0]
        lines.append(
            f"| {name} | {statistics.median(ratios):.3f} | "
            f"{f'{statistics.median(first):.3f} ({len(first)})' if first else '-'} "
            f"| {sum(r['latency_s']) / sum(off['latency_s']):.3f} "
            f"| {ratios[worst]:.2f} (#{worst + 1}) | {per[worst]['rounds']} against {both[worst]['rounds']} "
            f"| {max(r['waited_s']):.3f} | {1000 * _per_round(per, 'verify_s'):.0f} "
            f"| {1000 * _per_round(per, 'draft_s'):.0f} | {_per_round(per, 'proposed'):.1f} |"
        )
    base = off["cpu_in_requests_s"] + off["cpu_between_s"]
    for name in [n for n in runs if n not in CONTROL]:
        r = result["runs"][name]
        extra = r["cpu_in_requests_s"] + r["cpu_between_s"] - base
        own = r["learner_cpu_s"] / max(r["learner_requests_cpu_s"], 1e-9)
        spills = [x for x in r["spill_s"] if x > 0.01]
        past = f" longest {max(spills):.1f} s, after {len(spills)} replies" if spills else " none"
        lines.append(
            f"\nLearning {name}: {extra:.1f} CPU s, {extra / max(off['cpu_in_requests_s'], 1e-9):.0%} of the "
            f"requests' own CPU time ({own:.0%} by the learner's own count); learning left when the "
            f"think time ended:{past}."
        )
    return "\n".join(lines) + "\n"


def add_args(sub: Any) -> None:
    p = sub.add_parser("learning-cost", help="what learn=True costs a user's replies and the CPU")
    p.add_argument("--pair", default="smollm2-135m:qwen2.5-coder-0.5b")
    p.add_argument("--target-backend", choices=["llama.cpp", "torch"], default="llama.cpp")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--think", type=float, default=3.0, help="seconds between a reply and the next request")
    p.add_argument("--interval", type=int, default=8, help="requests between updates (TrainConfig)")
    p.add_argument("--context", type=int, default=0, help="TrainConfig.context (0: the whole prompt)")
    p.add_argument(
        "--cpu-share", type=float, default=None, help="TrainConfig.cpu_share (default: TrainConfig's)"
    )
    p.add_argument("--out", default="users_out")
    p.add_argument("--name", default="learning-cost")


def run(args: argparse.Namespace) -> None:
    import omnidraft as od
    from omnidraft.bench.datasets import load_prompts
    from omnidraft.cli.options import split_pair
    from omnidraft.distill.adapters import AdapterConfig
    from omnidraft.distill.trainer import TrainConfig
    from omnidraft.store.profiles import ProfileStore

    if args.requests < 1 or args.max_new_tokens < 1 or args.think < 0:
        raise SystemExit("--requests and --max-new-tokens must be >= 1, --think >= 0")
    runs = list(RUNS)
    share = {} if args.cpu_share is None else {"cpu_share": args.cpu_share}
    try:  # TrainConfig checks its own values (--interval, --context, --cpu-share), before anything loads
        configs = {
            name: TrainConfig(
                interval=args.interval,
                context=args.context,
                background=name != "inline",
                **({"cpu_share": 0.0} if name == "uncapped" else share),
            )
            for name in runs
            if name not in CONTROL
        }
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    drafter_spec, target_spec = split_pair(args.pair)
    drafter = od.Drafter.load(drafter_spec, backend="torch")
    target = (od.LlamaCppTarget if args.target_backend == "llama.cpp" else od.LocalTarget).load(target_spec)
    prompts = load_prompts(args.dataset, args.requests)
    result: dict[str, Any] = {**{k: v for k, v in vars(args).items() if k != "func"}, "runs": {}}
    with tempfile.TemporaryDirectory() as store_dir:
        store = ProfileStore(store_dir)
        drafter.add_adapter("learning-cost-fixed", AdapterConfig())  # the "adapter" run's: never trained
        pairs = {}
        for name in runs:
            if name in configs:
                pair = drafter.pair(
                    target, k=4, user=f"user-{name}", learn=True, train=configs[name], store=store
                )
            else:
                # a user's pairing as the learning runs' are: its profile's past outputs are drafts too
                pair = drafter.pair(target, k=4, user=f"user-{name}", store=store)
                pair.adapter = "learning-cost-fixed" if name.startswith("adapter") else None
            pair.generate("Warm up.", max_new_tokens=8)
            if pair.learner is not None:
                pair.learner.wait()
            pairs[name] = pair
        result["runs"] = interleaved(pairs, prompts, args.max_new_tokens, args.think)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))
