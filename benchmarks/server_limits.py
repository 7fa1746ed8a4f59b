"""The verification server's limits, measured on a live server in a process of its own on the first
CPU, the clients on the second (docs/remote.md, "Long prompts and clients that leave"):

    python -m benchmarks.server_limits long-prompt --engine torch --prompt 16384
    python -m benchmarks.server_limits disconnect --engine vllm

`long-prompt`: one session's first verify prefills `--prompt` tokens while another session
verifies one token at a time and a third streams; the long session's second verify must answer,
and the report gives the longest the others waited for a reply or a streamed token.
`disconnect`: each route is sent a request that would run for minutes, its client leaves once it
is running, and a counter of the server's work says when it stopped: vLLM's engine steps (from
/metrics), else the server process's CPU time (`work_per_s_before`: the counter's growth in the
second before the client left, which shows the request ran: steps, or CPU seconds, per second).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from functools import partial
from typing import Any, Callable

TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
ENDLESS = "# the first 2,000 lines of a table of squares\n" + "".join(
    f"{i} * {i} = {i * i}\n" for i in range(1, 6)
)
SHORT = "Question: Tom has 3 apples and buys 5 more. How many apples does he have now? Answer:"
SERVER_CPU, CLIENT_CPU = 0, 1


def _serve(args: argparse.Namespace, extra: list[str]) -> Any:
    """A context manager: `omnidraft serve` for `args.engine`, pinned to the server CPU."""
    from omnidraft.bench.network import free_port, server_process

    port = free_port()
    argv = [sys.executable, "-m", "omnidraft.cli", "serve", "--engine", args.engine]
    argv += ["--target", args.target, "--port", str(port), "--no-auth", "--dtype", "float32", *extra]
    url = f"http://127.0.0.1:{port}"
    return url, server_process(argv, SERVER_CPU, url, "/health", args.log)


def _stream_gaps(
    http: Any, path: str, body: dict[str, Any], gaps: list[float], stop: threading.Event
) -> None:
    """Read a streamed reply line by line, recording the seconds between lines, until `stop`."""
    with http.stream("POST", path, json=body) as reply:
        if reply.status_code != 200:
            reply.read()
            raise RuntimeError(f"{path}: HTTP {reply.status_code}: {reply.text[:200]}")
        last = time.perf_counter()
        for _ in reply.iter_lines():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            if stop.is_set():
                return


def long_prompt(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from omnidraft.store.models import load_tokenizer

    tokenizer = load_tokenizer(args.target)
    long_ids = (tokenizer(TEXT)["input_ids"] * args.prompt)[: args.prompt]
    short = tokenizer(SHORT)["input_ids"]
    extra = ["--max-model-len", str(args.prompt + 1024)] if args.engine == "vllm" else []
    url, server = _serve(args, extra)
    verify_waits: list[float] = []
    stream_gaps: list[float] = []
    report: dict[str, Any] = {"engine": args.engine, "prompt_tokens": args.prompt}
    with server, httpx.Client(base_url=url, timeout=3600) as a, httpx.Client(base_url=url, timeout=3600) as b:
        c = httpx.Client(base_url=url, timeout=3600)
        sid_b = b.post("/v1/sessions", json={"prompt_ids": short}).json()["session"]
        committed = b.post(
            f"/v1/sessions/{sid_b}/verify", json={"committed": len(short), "proposal": []}
        ).json()["committed"]
        endless = tokenizer(ENDLESS)["input_ids"]
        sid_c = c.post("/v1/sessions", json={"prompt_ids": endless}).json()["session"]
        route = "speculate" if args.engine == "vllm" else "generate"
        stop, done = threading.Event(), threading.Event()
        streamer = threading.Thread(
            target=_stream_gaps,
            args=(
                c,
                f"/v1/sessions/{sid_c}/{route}",
                {"committed": len(endless), "max_tokens": 4096},
                stream_gaps,
                stop,
            ),
        )
        streamer.start()
        time.sleep(2.0)
        stream_gaps.clear()  # the stream's own prefill is not a wait

        def prefill() -> None:
            sid = a.post("/v1/sessions", json={"prompt_ids": long_ids}).json()["session"]
            started = time.perf_counter()
            first = a.post(f"/v1/sessions/{sid}/verify", json={"committed": len(long_ids), "proposal": []})
            report["first_verify"] = {"status": first.status_code, "seconds": time.perf_counter() - started}
            done.set()
            time.sleep(1.0)
            after = first.json().get("committed", len(long_ids) + 1) if first.status_code == 200 else 0
            second = a.post(f"/v1/sessions/{sid}/verify", json={"committed": after, "proposal": []})
            report["second_verify_status"] = second.status_code

        thread = threading.Thread(target=prefill)
        thread.start()
        while not done.is_set():
            started = time.perf_counter()
            reply = b.post(f"/v1/sessions/{sid_b}/verify", json={"committed": committed, "proposal": []})
            verify_waits.append(time.perf_counter() - started)
            if reply.status_code != 200:
                report["other_verify_failed"] = reply.status_code
                break
            committed = reply.json()["committed"]
        thread.join()
        stop.set()
        streamer.join(timeout=120)
        c.close()
    report["other_verify"] = _spread(verify_waits)
    report["other_stream_gap"] = _spread(stream_gaps)
    return report


def _spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values) or [float("nan")]
    return {"n": len(values), "p50_s": ordered[len(ordered) // 2], "max_s": ordered[-1]}


def _cpu_seconds(proc: Any) -> float:
    """CPU seconds so far of `proc` and every process under it."""
    import psutil

    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _engine_steps(url: str) -> float:
    """The vLLM engine's steps so far (the server's /metrics)."""
    from omnidraft.bench.network import engine_counters

    return engine_counters(url)[0]


def _stopped_after(work: Callable[[], float], floor: float, left: float, watch: float = 6.0) -> float:
    """Seconds from `left` (perf_counter) to the end of the last 50 ms tick after it in which the
    server's `work` counter grew by more than `floor`, watched for `watch` seconds."""
    tick, last_busy, before = 0.05, left, work()
    while time.perf_counter() < left + watch:
        time.sleep(tick)
        done, now = work(), time.perf_counter()
        if done - before > floor:
            last_busy = now
        before = done
    return last_busy - left


def _raw_request(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=600)
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def disconnect(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import psutil

    from omnidraft.store.models import load_tokenizer

    tokenizer = load_tokenizer(args.target)
    ids = tokenizer(ENDLESS)["input_ids"]
    long_ids = (tokenizer(TEXT)["input_ids"] * 4096)[:4096]
    n = 4096
    url, server = _serve(args, ["--max-model-len", "8192"] if args.engine == "vllm" else [])
    results: dict[str, Any] = {"engine": args.engine}
    with server as proc_handle, httpx.Client(base_url=url, timeout=600) as http:
        proc = psutil.Process(proc_handle.pid)
        # what says the server works: vLLM's engine steps (its process keeps a core busy even idle),
        # else the server's CPU time (over a third of a core in a tick)
        work, floor = (
            (partial(_engine_steps, url), 0.0)
            if args.engine == "vllm"
            else (partial(_cpu_seconds, proc), 0.05 / 3)
        )

        def session(prompt: list[int], verify: bool = True) -> tuple[str, int]:
            sid = http.post("/v1/sessions", json={"prompt_ids": prompt}).json()["session"]
            if not verify:
                return sid, len(prompt)
            reply = http.post(f"/v1/sessions/{sid}/verify", json={"committed": len(prompt), "proposal": []})
            return sid, int(reply.json()["committed"])

        def completions(stream: bool) -> tuple[str, dict[str, Any]]:
            return "/v1/completions", {"prompt": ENDLESS, "max_tokens": n, "temperature": 0, "stream": stream}

        def chat(stream: bool) -> tuple[str, dict[str, Any]]:
            messages = [{"role": "user", "content": "Continue this table for 2,000 lines:\n" + ENDLESS}]
            return "/v1/chat/completions", {
                "messages": messages,
                "max_tokens": n,
                "temperature": 0,
                "stream": stream,
            }

        def prompt_generate() -> tuple[str, dict[str, Any]]:
            return "/v1/generate", {"prompt_ids": ids, "max_tokens": n}

        def session_route(route: str) -> Callable[[], tuple[str, dict[str, Any]]]:
            def make() -> tuple[str, dict[str, Any]]:
                sid, committed = session(ids)
                return f"/v1/sessions/{sid}/{route}", {"committed": committed, "max_tokens": n}

            return make

        def prefill_verify() -> tuple[str, dict[str, Any]]:
            sid, committed = session(long_ids, verify=False)
            return f"/v1/sessions/{sid}/verify", {"committed": committed, "proposal": []}

        routes: dict[str, Callable[[], tuple[str, dict[str, Any]]]] = {
            "completions": lambda: completions(False),
            "completions stream": lambda: completions(True),
            "chat": lambda: chat(False),
            "chat stream": lambda: chat(True),
            "generate": prompt_generate,
            "session generate": session_route("generate"),
            "session verify (4,096-token prefill)": prefill_verify,
        }
        if args.engine == "vllm":
            routes["session speculate"] = session_route("speculate")
        http.post("/v1/completions", json={"prompt": SHORT, "max_tokens": 4, "temperature": 0})  # warm-up
        for name, make in routes.items():
            for _ in range(args.repeat):
                path, body = make()
                _stopped_after(work, floor, time.perf_counter(), watch=1.0)  # settled
                s = _raw_request(url, path, body)
                time.sleep(args.run_for - 1.0)
                before = work()
                time.sleep(1.0)
                rate = work() - before  # the work counter's growth in the last second with its client
                s.close()
                left = time.perf_counter()
                stopped = round(_stopped_after(work, floor, left), 2)
                results.setdefault(name, []).append(
                    {"stopped_s": stopped, "work_per_s_before": round(rate, 2)}
                )
                print(
                    f"{name}: {rate:.2f} work/s before, stopped {stopped} s after its client left",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def main() -> None:
    import os

    p = argparse.ArgumentParser(prog="python -m benchmarks.server_limits")
    p.add_argument("what", choices=["long-prompt", "disconnect"])
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--prompt", type=int, default=16384, help="long-prompt: the long session's prompt tokens")
    p.add_argument(
        "--run-for",
        type=float,
        default=3.0,
        help="disconnect: seconds a request runs before its client leaves",
    )
    p.add_argument("--repeat", type=int, default=3, help="disconnect: trials per route")
    p.add_argument("--log", default="bench_out/server-limits.log")
    p.add_argument("--json", default=None, help="write the report here too")
    args = p.parse_args()
    os.makedirs("bench_out", exist_ok=True)
    os.sched_setaffinity(0, {CLIENT_CPU})
    report = long_prompt(args) if args.what == "long-prompt" else disconnect(args)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
