"""Replicas behind the router under load, one of them killed or drained mid-run (docs/deploy.md).

    python -m benchmarks.failover --engine vllm --sessions 16 --fault kill --out bench_out/failover.json

`omnidraft deploy --replicas 2` serves the target behind HAProxy; N device pairings (the default
drafter, one per thread, each with its own RemoteTarget on the router) run one prompt each, all at
once, three times: a warm-up pass, a pass with nothing failing (the reference outputs and each
request's latency), then the same requests while, `--after` seconds in, the replica holding the
most sessions is killed with -9 (`--fault kill`) or sent SIGTERM (`--fault term`: it drains).
Reported: requests completed, outputs identical to the pass with nothing failing, how many re-opened
or resumed their session, and the latency each request gained over its run in that pass (p50, max;
the resumed ones apart).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx


class Counting(logging.Handler):
    """Counts, per thread, the device's "resuming" and re-open lines (targets/remote.py)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.by_thread: dict[int, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if "resuming" in record.getMessage() or "re-opening" in record.getMessage():
            self.by_thread[record.thread or 0] = self.by_thread.get(record.thread or 0, 0) + 1


def _deploy(args: argparse.Namespace, port: int) -> tuple[subprocess.Popen, list[str]]:
    serve = ["--target", args.target, "--engine", args.engine, "--no-auth", *args.serve_arg]
    command = [sys.executable, "-m", "omnidraft.cli", "deploy", "--replicas", "2", "--port", str(port)]
    # (by default the replica hit stays down: its restart would share these two cores with the run)
    command += ([] if args.restart else ["--no-restart"]) + ["--"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}  # two engines and 16 drafters in 24 GiB
    process = subprocess.Popen(command + serve, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line.rstrip())

    threading.Thread(target=read, daemon=True).start()
    return process, lines


def _replicas(lines: list[str]) -> dict[int, int]:
    out = {}
    for line in lines:
        if line.startswith("omnidraft deploy: replica pid "):
            out[int(line.rsplit(":", 1)[1])] = int(line.split()[4])
    return out


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _wait(lines: list[str], router: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ports = _replicas(lines)
        if len(ports) == 2 and all(_ready(f"http://127.0.0.1:{p}") for p in ports) and _ready(router):
            time.sleep(1.5)
            return
        time.sleep(1)
    raise SystemExit("replicas not ready:\n" + "\n".join(lines[-40:]))


def _pass(pairs: list[Any], prompts: list[str], tokens: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{} for _ in prompts]

    def run(i: int) -> None:
        began = time.perf_counter()
        try:
            got = pairs[i].generate(prompts[i], max_new_tokens=tokens)
            out[i] = {"ids": got.token_ids, "s": time.perf_counter() - began, "thread": threading.get_ident()}
        except Exception as exc:  # noqa: BLE001 - reported
            out[i] = {"error": f"{type(exc).__name__}: {exc}", "thread": threading.get_ident()}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.failover")
    p.add_argument("--engine", default="vllm")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--drafter", default="smollm2-135m")
    p.add_argument("--drafter-backend", default="llama.cpp", help="llama.cpp: 16 drafters fit in memory")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--fault", choices=["kill", "term"], default="kill")
    p.add_argument(
        "--after", type=float, default=None, help="seconds into the run (default: 40%% of the first)"
    )
    p.add_argument("--restart", action="store_true", help="let deploy start the replica hit again")
    p.add_argument("--serve-arg", action="append", default=[], help="more `omnidraft serve` arguments")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import omnidraft as od
    from omnidraft.bench.datasets import load_prompts
    from omnidraft.bench.network import free_port

    counting = Counting()
    logging.getLogger("omnidraft").addHandler(counting)
    logging.getLogger("omnidraft").setLevel(logging.INFO)
    port = free_port()
    router = f"http://127.0.0.1:{port}"
    process, lines = _deploy(args, port)
    try:
        _wait(lines, router)
        prompts = (load_prompts("mixed", args.sessions) * args.sessions)[: args.sessions]
        drafters = [od.Drafter.load(args.drafter, backend=args.drafter_backend) for _ in prompts]
        pairs = [d.pair(od.RemoteTarget(router, retries=4)) for d in drafters]
        _pass(pairs, prompts, args.tokens)  # warm: engines compiled, prompts in their tenant's cache
        began = time.perf_counter()
        first = _pass(pairs, prompts, args.tokens)
        first_s = time.perf_counter() - began
        after = args.after if args.after is not None else 0.4 * first_s
        fault: dict[str, Any] = {}

        def strike() -> None:
            time.sleep(after)
            counts = {}
            for port_, pid in _replicas(lines).items():
                health = httpx.get(f"http://127.0.0.1:{port_}/health", timeout=5).json()
                counts[port_] = (health.get("sessions", 0), pid)
            port_, (sessions, pid) = max(counts.items(), key=lambda kv: kv[1][0])
            fault.update(port=port_, pid=pid, sessions=[n for n, _ in counts.values()], at_s=round(after, 1))
            fault["began"] = time.monotonic()
            os.kill(pid, signal.SIGKILL if args.fault == "kill" else signal.SIGTERM)

        counting.by_thread.clear()
        striker = threading.Thread(target=strike)
        striker.start()
        second = _pass(pairs, prompts, args.tokens)
        striker.join()
        if args.fault == "term":  # when the drained replica exited
            gone = f"omnidraft deploy: replica at port {fault['port']} exited"
            while not any(line.startswith(gone) for line in lines):
                time.sleep(0.1)
            fault["exited_after_s"] = round(time.monotonic() - fault.pop("began"), 2)
            fault["exit"] = next(line for line in lines if line.startswith(gone)).rsplit(" ", 1)[1]
        fault.pop("began", None)
        report = _report(first, second, counting.by_thread, args, fault)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    print(json.dumps(report, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


def _report(first: list, second: list, resumed: dict, args: argparse.Namespace, fault: dict) -> dict:
    done = [i for i, r in enumerate(second) if "ids" in r]
    hit = [i for i in done if resumed.get(second[i]["thread"], 0)]
    added = {i: second[i]["s"] - first[i]["s"] for i in done if "s" in first[i]}

    def spread(ids: list[int]) -> dict[str, float] | None:
        if not ids:
            return None
        gains = sorted(added[i] for i in ids if i in added)
        return {"p50_s": round(statistics.median(gains), 2), "max_s": round(gains[-1], 2)}

    return {
        "engine": args.engine,
        "target": args.target,
        "fault": args.fault,
        "sessions": args.sessions,
        "tokens": args.tokens,
        "completed": len(done),
        "errors": [r["error"] for r in second if "error" in r],
        "identical": sum(1 for i in done if "ids" in first[i] and second[i]["ids"] == first[i]["ids"]),
        "resumed_or_reopened": len(hit),
        "added_latency_all": spread(done),
        "added_latency_resumed": spread(hit),
        "first_pass_s": [round(r.get("s", -1), 2) for r in first],
        "fault_detail": fault,
    }


if __name__ == "__main__":
    main()
