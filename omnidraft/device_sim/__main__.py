"""python -m omnidraft.device_sim (or `omnidraft simulate`): replay, sweep and validate recorded
omnidraft traces. Imports no torch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .hardware import DeviceProfile, NetworkProfile, load_profiles
from .simulate import Scenario, read_trace, simulate, sweep_k


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m omnidraft.device_sim", description=__doc__)
    p.add_argument("--profiles", action="append", default=[], help="extra profile JSON files")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("replay", "expected latency of a trace per scenario"),
        ("sweep", "best draft length per scenario"),
        ("validate", "predicted vs measured wall time of each generation in a trace"),
        ("plot", "PNG: expected speedup against round-trip time, one line per device"),
    ):
        q = sub.add_parser(name, help=help_)
        q.add_argument("trace")
        q.add_argument("--device", action="append", help="device profile name(s); default: all")
        q.add_argument("--server", default=None, help="target host profile: the target runs remotely")
        q.add_argument("--network", action="append", help="network profile name(s) (with --server)")
        q.add_argument(
            "--rtt",
            type=float,
            action="append",
            default=[],
            metavar="MS",
            help="an ad-hoc network of this round-trip time (loopback bandwidth), repeatable (with --server)",
        )
        q.add_argument(
            "--select",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="only the generations whose trace header has KEY=VALUE (e.g. dataset=gsm8k, rtt_ms=50.0)",
        )
        if name == "plot":
            q.add_argument("--png", required=True, help="where to write the plot")
            q.add_argument("--max-rtt", type=float, default=200.0)
    sub.add_parser("list", help="list the profiles and their sources")
    s = sub.add_parser(
        "stream",
        help="devices drafting ahead for a batched server across a network (device_sim/streaming.py)",
    )
    s.add_argument("--server", required=True, help="the server's profile (its target_ms)")
    s.add_argument("--device", required=True, help="the device's profile (its drafter_ms)")
    s.add_argument("--rtt", type=float, action="append", required=True, metavar="MS")
    s.add_argument("--devices", type=int, action="append", metavar="N", help="devices at once (default 1)")
    s.add_argument(
        "--acceptance", type=float, required=True, help="per-token acceptance of the device's guesses"
    )
    s.add_argument("--budget", type=int, default=6, help="draft tokens the server takes a step")
    s.add_argument("--tokens", type=int, default=128)
    s.add_argument(
        "--ttft", type=float, default=0.0, metavar="S", help="seconds to each request's first token (prefill)"
    )
    s.add_argument("--shared-cpu", action="store_true", help="every device drafts on one CPU (this machine)")
    s.add_argument("--seeds", type=int, default=8, help="runs averaged (the text's right guesses differ)")
    g = sub.add_parser(
        "gpu-profile", help="server profiles from a GPU check JSON (python -m benchmarks.gpu_check)"
    )
    g.add_argument("check")
    g.add_argument("--out", required=True, help="profile file to write (pass it to --profiles)")
    g.add_argument(
        "--context", type=int, default=None, help="context the costs are read at (default: the middle one)"
    )
    _capacity_args(sub)
    return p


def _capacity_args(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "capacity", help="devices one server holds within a per-user time per token, per design (capacity.py)"
    )
    where = c.add_mutually_exclusive_group(required=True)
    where.add_argument("--steps", help="a batched step profile JSON (python -m benchmarks.step_profile)")
    where.add_argument("--server", help="a server profile whose step is compute-bound (its target_ms)")
    c.add_argument("--model", default=None, help="with --steps: the model shape (default: the first)")
    c.add_argument("--context", type=int, default=None, help="with --steps: the context (default: smallest)")
    c.add_argument("--device", required=True, help="the device's profile (its drafter_ms)")
    c.add_argument("--rtt", type=float, action="append", required=True, metavar="MS")
    c.add_argument(
        "--target-ms", type=float, action="append", metavar="MS", help="p95 ms a token (default 50)"
    )
    c.add_argument("--acceptance", type=float, default=None, help="the device's per-token acceptance")
    c.add_argument("--trace", default=None, help="fit --acceptance to these recorded rounds instead")
    c.add_argument("--tokens", type=int, default=128)
    c.add_argument("--ngram-found", type=float, default=0.5, help="server n-gram: a match found a step")
    c.add_argument("--ngram-acceptance", type=float, default=0.5, help="server n-gram: per-token acceptance")
    c.add_argument("--json", default=None, help="also write the rows here")
    v = sub.add_parser(
        "capacity-check",
        help="the streaming model against measured `omnidraft bench --remote` rows (its JSON)",
    )
    v.add_argument("bench")
    v.add_argument("--server", required=True, help="the server's profile (its target_ms)")
    v.add_argument("--device", required=True, help="the device's profile (its drafter_ms)")
    v.add_argument(
        "--acceptance",
        type=float,
        default=None,
        help="the device's per-token acceptance (default: fitted to the one-device drafting row)",
    )
    v.add_argument("--budget", type=int, default=6, help="draft tokens the server takes a row and step")
    v.add_argument("--seeds", type=int, default=8)
    v.add_argument(
        "--steps", default=None, help="the server's batched step profile JSON (default: --server's)"
    )
    v.add_argument(
        "--server-budget",
        action="store_true",
        help="each step takes the draft budget the server computes from --steps for its rows, "
        "as `omnidraft serve` does (--budget its ceiling)",
    )


def _scenarios(args, cat):
    devices = args.device or sorted(cat.devices)
    for ms in args.rtt:
        cat.networks[f"rtt-{ms:g}ms"] = NetworkProfile(
            name=f"rtt-{ms:g}ms", source="ad-hoc: --rtt on the command line", rtt_ms=ms, bandwidth_mbps=10000
        )
    networks = (args.network or []) + [f"rtt-{ms:g}ms" for ms in args.rtt] or (
        ["loopback"] if args.server else ["none"]
    )
    for name in devices + ([args.server] if args.server else []) + networks:
        if name not in cat.devices and name not in cat.networks:
            raise SystemExit(
                f"unknown profile {name!r}; known: {', '.join(sorted(cat.devices) + sorted(cat.networks))}"
            )
    server = cat.devices[args.server] if args.server else None
    for d in devices:
        for n in networks:
            yield f"{d} / {n}", Scenario(device=cat.devices[d], server=server, network=cat.networks[n])


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    cat = load_profiles(*args.profiles)
    if args.command == "gpu-profile":
        from .gpu import profiles_from_check

        try:
            devices = profiles_from_check(args.check, args.context)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        Path(args.out).write_text(json.dumps({"devices": devices}, indent=1))
        print("\n".join(f"{d['name']}: target_ms {d['target_ms']}" for d in devices))
        print(f"wrote {args.out}")
        return
    if args.command == "stream":
        return _stream(args, cat.devices)
    if args.command == "capacity":
        return _capacity(args, cat.devices)
    if args.command == "capacity-check":
        return _capacity_check(args, cat.devices)
    if args.command == "list":
        profiles: list[DeviceProfile | NetworkProfile] = [*cat.devices.values(), *cat.networks.values()]
        for p in profiles:
            print(f"{p.name:<28} {p.source}")
        return
    try:
        select = dict(item.split("=", 1) for item in args.select)
    except ValueError:
        raise SystemExit(f"--select takes KEY=VALUE, got {args.select}") from None
    try:
        runs = read_trace(args.trace, select=select)
    except (OSError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    if args.command == "replay":
        print(
            "speedup is over the target alone (remote: the server generating the whole completion from one "
            "request, streamed); fwd/tok: target forwards per committed token (alone: 1.00)"
        )
        print(
            f"{'scenario':<44}{'tok/s':>8}{'speedup':>9}{'TTFT s':>8}{'bytes/tok':>10}{'fwd/tok':>9}  "
            "latency-objective default"
        )
        for label, sc in _scenarios(args, cat):
            r = simulate(runs, sc)
            choice = "speculate" if r.speculation_pays else "target alone (speculation slower)"
            speed = f"{r.tokens_per_s:>8.2f}{r.speedup:>8.2f}×"
            costs = f"{r.ttft_s:>8.2f}{r.bytes_per_token:>10.1f}{r.forwards_per_token:>9.2f}"
            print(f"{label:<44}{speed}{costs}  {choice}")
    elif args.command == "sweep":
        for label, sc in _scenarios(args, cat):
            rows = sweep_k(runs, sc)
            best = max(rows, key=lambda row: row[2])
            print(
                f"{label}: best k = {best[0]} (τ {best[1]:.2f}, {best[2]:.2f} tok/s); "
                + ", ".join(f"k={k}:{tps:.2f}" for k, _, tps in rows)
            )
    elif args.command == "plot":
        _plot(runs, args, cat)
    else:
        _validate(runs, args, cat)


def _plot(runs, args, cat) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not args.server:
        raise SystemExit("plot sweeps the network between device and target: give --server PROFILE")
    rtts = [args.max_rtt * i / 40 for i in range(41)]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for d in args.device or sorted(cat.devices):
        speedups = [
            simulate(
                runs,
                Scenario(
                    device=cat.devices[d],
                    server=cat.devices[args.server],
                    network=NetworkProfile(name="sweep", source="sweep", rtt_ms=r),
                ),
            ).speedup
            for r in rtts
        ]
        ax.plot(rtts, speedups, label=d)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("round-trip time (ms)")
    ax.set_ylabel("speedup vs the server generating alone (streamed)")
    ax.set_title(f"target on {args.server}; trace {args.trace.rsplit('/', 1)[-1]}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


def _validate(runs, args, cat) -> None:
    print(f"{'scenario':<44}{'predicted s':>12}{'measured s':>12}{'error':>8}")
    for label, sc in _scenarios(args, cat):
        predicted = simulate(runs, sc).seconds
        measured = sum(r.seconds for run in runs for r in run)
        print(f"{label:<44}{predicted:>12.2f}{measured:>12.2f}{(predicted - measured) / measured:>+8.1%}")


def _stream(args: argparse.Namespace, devices: dict[str, DeviceProfile]) -> None:
    from .streaming import simulate_streaming

    server = args.server
    for name in (server, args.device):
        if name not in devices:
            raise SystemExit(f"unknown device profile {name!r}; known: {', '.join(sorted(devices))}")
    print(
        f"{'RTT ms':>7}{'devices':>8}{'device tok/s':>14}{'server tok/s':>14}{'alone tok/s':>13}"
        f"{'speedup':>9}{'steps/token':>13}"
    )
    for rtt in args.rtt:
        for n in args.devices or [1]:
            runs = [
                simulate_streaming(
                    devices[server],
                    devices[args.device],
                    rtt_ms=rtt,
                    devices=n,
                    acceptance=args.acceptance,
                    budget=args.budget,
                    tokens=args.tokens,
                    shared_cpu=args.shared_cpu,
                    seed=seed,
                    ttft_s=args.ttft,
                )
                for seed in range(args.seeds)
            ]
            mean = lambda key: sum(getattr(r, key) for r in runs) / len(runs)  # noqa: E731
            print(
                f"{rtt:>7g}{n:>8}{mean('device_tok_s'):>14.2f}{mean('server_tok_s'):>14.2f}"
                f"{mean('alone_tok_s'):>13.2f}{mean('speedup'):>8.2f}x{mean('steps_per_token'):>13.2f}"
            )


def _capacity(args: argparse.Namespace, devices: dict[str, DeviceProfile]) -> None:
    from .capacity import StepProfile, capacity_table, read_step_profile
    from .simulate import acceptance_per_position

    for name in (args.device, args.server):
        if name is not None and name not in devices:
            raise SystemExit(f"unknown device profile {name!r}; known: {', '.join(sorted(devices))}")
    try:
        step = (
            read_step_profile(args.steps, args.model, args.context)
            if args.steps
            else StepProfile.compute_bound(devices[args.server])
        )
        acceptance = acceptance_per_position(read_trace(args.trace)) if args.trace else args.acceptance
    except (OSError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    if acceptance is None:
        raise SystemExit("give --acceptance or --trace (recorded rounds to fit it to)")
    rows = capacity_table(
        step,
        devices[args.device],
        args.rtt,
        args.target_ms or [50.0],
        tokens=args.tokens,
        acceptance=acceptance,
        ngram_found=args.ngram_found,
        ngram_acceptance=args.ngram_acceptance,
    )
    how = "measured" if step.measured else "not measured as a batch"
    print(f"server step: {step.name} ({how}); {step.source}")
    print(
        f"device: {args.device}, acceptance {acceptance:.2f} a token; server n-gram (assumed): "
        f"found {args.ngram_found:.2f}, acceptance {args.ngram_acceptance:.2f}"
    )
    print(f"{'RTT ms':>7}{'target ms':>10}  {'design':<13}{'capacity':>9}{'p95 ms':>8}{'server tok/s':>13}")
    for r in rows:
        p95 = f"{r['p95_ms']:>8.1f}" if r["p95_ms"] is not None else f"{'-':>8}"
        tps = f"{r['server_tok_s']:>13.1f}" if r["server_tok_s"] is not None else f"{'-':>13}"
        print(f"{r['rtt_ms']:>7g}{r['target_ms']:>10g}  {r['design']:<13}{r['capacity']:>9}{p95}{tps}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"step": step.name, "acceptance": acceptance, "rows": rows}, indent=1)
        )


def _capacity_check(args: argparse.Namespace, devices: dict[str, DeviceProfile]) -> None:
    from .capacity import against_bench, fit_acceptance, read_step_profile

    for name in (args.server, args.device):
        if name not in devices:
            raise SystemExit(f"unknown device profile {name!r}; known: {', '.join(sorted(devices))}")
    try:
        measured = json.loads(Path(args.bench).read_text())
        kw = {
            "budget": args.budget,
            "seeds": args.seeds,
            "step": read_step_profile(args.steps) if args.steps else None,
            "server_budget": args.server_budget,
        }
        server, device = devices[args.server], devices[args.device]
        acceptance = args.acceptance
        if acceptance is None:
            acceptance = fit_acceptance(measured, server, device, **kw)
            print(f"acceptance {acceptance} a token: fitted to the one-device drafting row")
        rows = against_bench(measured, server, device, acceptance=acceptance, **kw)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{args.bench}: not the JSON of `omnidraft bench --remote`: {exc}") from None
    print(
        "| RTT ms | devices | row | server tok/s predicted / measured | error "
        "| request s/token p50 predicted / measured | error |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:

        def cell(key: str) -> str:
            got, err = r[f"measured_{key}"], r[f"error_{key}"]
            return (
                f"{r[f'predicted_{key}']:.3f} / {got:.3f} | {err:+.0%}"
                if got
                else f"{r[f'predicted_{key}']:.3f} / - | -"
            )

        print(
            f"| {r['rtt_ms']:g} | {r['devices']} | {r['row']} | {cell('tok_s')} | {cell('s_per_token_p50')} |"
        )
    errors = [abs(r[k]) for r in rows for k in ("error_tok_s", "error_s_per_token_p50") if r[k] is not None]
    if errors:
        print(f"largest error {max(errors):.0%}: {'within' if max(errors) <= 0.15 else 'outside'} 15%")


if __name__ == "__main__":
    main()
