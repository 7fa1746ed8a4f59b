"""python -m device_sim: replay, sweep and validate recorded omnidraft traces. Imports no torch."""

from __future__ import annotations

import argparse
import sys

from .profiles import load_profiles
from .simulate import Scenario, read_trace, simulate, sweep_k


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m device_sim", description=__doc__)
    p.add_argument("--profiles", action="append", default=[], help="extra profile JSON files")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("replay", "expected latency of a trace per scenario"), ("sweep", "best draft length per scenario"),
                        ("validate", "predicted vs measured wall time of each generation in a trace")):
        q = sub.add_parser(name, help=help_)
        q.add_argument("trace")
        q.add_argument("--device", action="append", help="device profile name(s); default: all")
        q.add_argument("--server", default=None, help="target host profile: the target runs remotely")
        q.add_argument("--network", action="append", help="network profile name(s) (with --server)")
    sub.add_parser("list", help="list the profiles and their sources")
    return p


def _scenarios(args, cat):
    devices = args.device or sorted(cat.devices)
    networks = args.network or (["loopback"] if args.server else ["none"])
    for name in devices + ([args.server] if args.server else []) + networks:
        if name not in cat.devices and name not in cat.networks:
            raise SystemExit(f"unknown profile {name!r}; known: {', '.join(sorted(cat.devices) + sorted(cat.networks))}")
    server = cat.devices[args.server] if args.server else None
    for d in devices:
        for n in networks:
            yield f"{d} / {n}", Scenario(device=cat.devices[d], server=server, network=cat.networks[n])


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    cat = load_profiles(*args.profiles)
    if args.command == "list":
        for p in [*cat.devices.values(), *cat.networks.values()]:
            print(f"{p.name:<28} {p.source}")
        return
    try:
        runs = read_trace(args.trace)
    except (OSError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    if args.command == "replay":
        print(f"{'scenario':<44}{'tok/s':>8}{'speedup':>9}{'TTFT s':>8}{'bytes/tok':>10}")
        for label, sc in _scenarios(args, cat):
            r = simulate(runs, sc)
            print(f"{label:<44}{r.tokens_per_s:>8.2f}{r.speedup:>8.2f}×{r.ttft_s:>8.2f}{r.bytes_per_token:>10.1f}")
    elif args.command == "sweep":
        for label, sc in _scenarios(args, cat):
            rows = sweep_k(runs, sc)
            best = max(rows, key=lambda row: row[2])
            print(f"{label}: best k = {best[0]} (τ {best[1]:.2f}, {best[2]:.2f} tok/s); "
                  + ", ".join(f"k={k}:{tps:.2f}" for k, _, tps in rows))
    else:
        _validate(runs, args, cat)


def _validate(runs, args, cat) -> None:
    print(f"{'scenario':<44}{'predicted s':>12}{'measured s':>12}{'error':>8}")
    for label, sc in _scenarios(args, cat):
        predicted = simulate(runs, sc).seconds
        measured = sum(r.seconds for run in runs for r in run)
        print(f"{label:<44}{predicted:>12.2f}{measured:>12.2f}{(predicted - measured) / measured:>+8.1%}")


if __name__ == "__main__":
    sys.exit(main())
