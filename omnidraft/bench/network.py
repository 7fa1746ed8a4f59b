"""`omnidraft bench --remote` on a serving engine (vLLM, OpenVINO, llama.cpp): devices drafting for
a server across a real round trip, beside the server decoding alone, the fastest engine alone and
a stock vLLM server (docs/remote.md).

The server (`omnidraft serve --engine E`) runs in a process of its own on the first CPU; the
devices run in this process on the second, each with its own drafter pairing and HTTP
connections; between them a proxy (delay_proxy.py, its own process) delays every byte by half the
round trip each way. Rows, each with the same prompts, greedy, one device per concurrent stream:
- server alone: each device streams `POST /v1/generate`, the server decoding the whole completion;
- device drafting: `pair.stream` through `RemoteTarget` (the `/speculate` stream and its proposals,
  verified in vLLM's engine step or the server's own step loop on an in-process engine);
- alone on X: each other engine here that runs these weights (targets/fastest.py `candidates`),
  `omnidraft serve --engine X` streamed as the server alone is: what a user could run instead. The
  fastest of these rows and the server alone, at the same round trip and load, is what every
  row's speedup (total and worst request) is measured against;
- stock vLLM (E = vllm): `python -m vllm.entrypoints.openai.api_server` on the same CPU with the
  same weights, streamed `/v1/completions`.
Per row: tokens/s over the wall time of all its requests, time to first token, the gaps between
tokens (p50, p95), the worst request, and on omnidraft's server its engine's seconds and steps per
committed token; every output is compared with the server decoding alone.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator

__all__ = [
    "ROWS",
    "NetworkRun",
    "Timed",
    "engine_counters",
    "free_port",
    "pinned",
    "run_network",
    "server_process",
    "wait_up",
]

ROWS = ("server alone", "device drafting", "stock vLLM", "alone on")  # the last: "alone on <engine>"
SERVER_CPU, DEVICE_CPU = 0, 1


@dataclass
class Timed:
    """One request: when it was sent, its token ids and when each arrived (perf_counter seconds)."""

    sent: float
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def add(self, tokens: list[int]) -> None:
        now = time.perf_counter()
        self.tokens += tokens
        self.times += [now] * len(tokens)


def free_port() -> int:
    """A TCP port on loopback that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(cpu: int) -> Callable[[], None]:
    """A child process's `preexec_fn` that pins it to `cpu`."""
    return lambda: os.sched_setaffinity(0, {cpu})


def wait_up(url: str, path: str, proc: subprocess.Popen, timeout: float = 900.0) -> None:
    """Return once `url + path` answers 200; raise if `proc` exits or `timeout` passes first."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with status {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


@contextmanager
def server_process(argv: list[str], cpu: int, url: str, health: str, log: str) -> Iterator[subprocess.Popen]:
    """A server process pinned to `cpu`, up once `url + health` answers; stopped on exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=pinned(cpu))
    try:
        wait_up(url, health, proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def _proxy(upstream_port: int, rtt_ms: float) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "omnidraft.bench.delay_proxy", "--listen", str(port)]
    argv += ["--upstream", f"127.0.0.1:{upstream_port}", "--rtt-ms", str(rtt_ms)]
    proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL, preexec_fn=pinned(DEVICE_CPU))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the delaying proxy did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def engine_counters(url: str) -> tuple[float, float]:
    """(engine steps, engine seconds) so far, from omnidraft's server's /metrics."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    values = dict(line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return float(values["omnidraft_engine_steps_total"]), float(values["omnidraft_engine_seconds_total"])


def _stream_lines(http: Any, path: str, body: dict[str, Any]) -> Iterator[str]:
    with http.stream("POST", path, json=body) as reply:
        if reply.status_code >= 400:
            reply.read()
            raise RuntimeError(f"{path}: HTTP {reply.status_code}: {reply.text[:300]}")
        yield from reply.iter_lines()


def _server_alone(http: Any, ids: list[int], n: int, sampling: dict[str, Any] | None = None) -> Timed:
    run = Timed(time.perf_counter())
    for line in _stream_lines(http, "/v1/generate", {"prompt_ids": ids, "max_tokens": n, **(sampling or {})}):
        if line.strip():
            run.add(json.loads(line)["tokens"])
    return run


def _stock(
    http: Any, ids: list[int], n: int, sampling: dict[str, Any] | None = None, model: str = "target"
) -> Timed:
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": n,
        "temperature": 0.0,
        "stream": True,
        **(sampling or {}),
    }
    body.update(logprobs=0, return_tokens_as_token_ids=True)
    run = Timed(time.perf_counter())
    for line in _stream_lines(http, "/v1/completions", body):
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[6:])["choices"][0]
            tokens = (choice.get("logprobs") or {}).get("tokens") or []
            run.add([int(t.removeprefix("token_id:")) for t in tokens])
    return run


def _device(pair: Any, prompt: str, n: int, sampling: dict[str, Any] | None = None) -> Timed:
    """`pair.stream`, timed per engine chunk (its RemoteTarget's sessions record them)."""
    run = Timed(time.perf_counter())
    pair.target.chunks = run
    for _ in pair.stream(prompt, max_new_tokens=n, **(sampling or {})):
        pass
    return run


def _timed_remote(url: str, tokenizer: Any) -> Any:
    """A RemoteTarget whose streamed chunks are recorded into its `chunks` (a Timed)."""
    from ..targets.remote import RemoteTarget

    class Recording(RemoteTarget):
        chunks: Timed | None = None

        def begin(self, prompt_ids: list[int]) -> Any:
            session = super().begin(prompt_ids)
            steps, decode = session.steps, session.decode

            def timed_steps(*args: Any, **kwargs: Any) -> Iterator[list[int]]:
                for tokens in steps(*args, **kwargs):
                    if self.chunks is not None:
                        self.chunks.add(tokens)
                    yield tokens

            def timed_decode(*args: Any, **kwargs: Any) -> Iterator[int]:
                for token in decode(*args, **kwargs):
                    if self.chunks is not None:
                        self.chunks.add([token])
                    yield token

            setattr(session, "steps", timed_steps)  # noqa: B010 - the bench's own recording wrapper
            setattr(session, "decode", timed_decode)  # noqa: B010
            return session

    return Recording(url, tokenizer=tokenizer, timeout=600)


def _concurrently(devices: int, jobs: list[Callable[[], Timed]]) -> tuple[list[Timed], float]:
    """`jobs` run by `devices` threads, each taking its share in order; (results, wall seconds)."""
    shares = [jobs[d::devices] for d in range(devices)]
    started = time.perf_counter()
    with ThreadPoolExecutor(devices) as pool:
        done = list(pool.map(lambda share: [job() for job in share], shares))
    wall = time.perf_counter() - started
    out: list[Timed | None] = [None] * len(jobs)
    for d, results in enumerate(done):
        for i, result in enumerate(results):
            out[d + i * devices] = result
    return [r for r in out if r is not None], wall


def summarize_row(runs: list[Timed], wall: float, reference: list[list[int]] | None) -> dict[str, Any]:
    """tok/s over the wall time, time to first token, inter-token gaps and identical outputs."""
    tokens = sum(len(r.tokens) for r in runs)
    gaps = [b - a for r in runs for a, b in zip(r.times, r.times[1:])]
    ttft = [r.times[0] - r.sent for r in runs if r.times]
    per = sorted(gaps) or [0.0]
    per_request = [(r.times[-1] - r.sent) / len(r.tokens) for r in runs if r.tokens] or [0.0]
    return {
        "requests": len(runs),
        "tokens": tokens,
        "tok_s": tokens / wall,
        "ttft_s": statistics.median(ttft) if ttft else None,
        "gap_p50_s": per[len(per) // 2],
        "gap_p95_s": per[min(len(per) - 1, int(0.95 * len(per)))],
        "worst_request_s_per_token": max(per_request),
        "request_s_per_token": per_request,
        "request_s_per_token_p50": statistics.median(per_request),
        "request_tokens": [len(r.tokens) for r in runs],
        "request_ttft_s": [r.times[0] - r.sent if r.times else None for r in runs],
        "identical": sum(r.tokens == ref for r, ref in zip(runs, reference)) if reference else None,
    }


@dataclass(frozen=True)
class NetworkRun:
    """What `run_network` measures: `prompts` of `max_new_tokens` each, from devices drafting with
    `drafter` for `target` on a server on `engine`, at each round trip of `rtts_ms` and each device
    count of `devices`; `others`: the other engines here streamed alone (the fastest such row, or
    the server alone, is the speedups' reference); `stock`: also a stock vLLM
    server's row (vLLM only); `log`: the servers' output; `server_args`: `omnidraft serve`'s engine
    flags; `sampling` (temperature, top_p, ...): every row samples instead of decoding greedily
    (outputs then differ by chance: identical is not counted)."""

    drafter: str
    target: str
    prompts: list[str]
    max_new_tokens: int
    rtts_ms: list[float]
    devices: list[int]
    stock: bool = True
    log: str = "bench_out/network-servers.log"
    server_args: tuple[str, ...] = ("--dtype", "float32")
    sampling: dict[str, Any] | None = None
    engine: str = "vllm"
    others: tuple[str, ...] = ()


def run_network(
    run: NetworkRun,
    *,
    progress: Callable[[str], object] = lambda _: None,
    done: Callable[[list[dict[str, Any]]], object] = lambda _: None,
) -> list[dict[str, Any]]:
    """Every row of ROWS at every round trip and device count (see the module docstring);
    `done` sees the rows so far after each one."""
    import torch

    from ..store.models import load_tokenizer

    os.makedirs(os.path.dirname(run.log) or ".", exist_ok=True)
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {DEVICE_CPU})  # the devices' core, for the run (then as it was)
    torch.set_num_threads(1)
    try:
        bench = _NetworkBench(run, load_tokenizer(run.target), progress, done)
        bench.omnidraft_rows()
        for other in run.others:
            bench.alone_rows(other)
        if run.stock and run.engine == "vllm":
            bench.stock_rows()
    finally:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
    results = bench.results
    base: dict[tuple[float, int], dict[str, Any]] = {}  # the fastest engine alone, by (RTT, devices)
    for r in results:
        if r["row"] == ROWS[0] or r["row"].startswith(ROWS[3]):
            key = (r["rtt_ms"], r["devices"])
            base[key] = max(base.get(key, r), r, key=lambda row: row["tok_s"])
    for r in results:
        ref = base[(r["rtt_ms"], r["devices"])]
        r["speedup"] = r["tok_s"] / ref["tok_s"]
        pairs = zip(ref["request_s_per_token"], r["request_s_per_token"])
        r["worst_request_speedup"] = min((a / b for a, b in pairs if b > 0), default=None)
        r["against"] = ref["row"] if ref["row"] != ROWS[0] else f"{ROWS[3]} {run.engine}"
    return results


class _NetworkBench:
    """One `run_network`: its servers, one after the other, and the rows measured so far."""

    def __init__(self, run: NetworkRun, tokenizer: Any, progress: Callable, done: Callable) -> None:
        self.run, self.tokenizer, self.progress, self.done = run, tokenizer, progress, done
        self.ids = [tokenizer(p)["input_ids"] for p in run.prompts]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.results: list[dict[str, Any]] = []
        self.references: dict[int, list[list[int]]] = {}  # greedy outputs of the server alone, by devices

    def add(self, rtt: float, n: int, row: str, jobs: list, counted: bool = True) -> None:
        """Run `jobs` `n` at a time and keep their row (with the engine's steps per token if `counted`)."""
        self.progress(f"RTT {rtt:g} ms, {n} devices: {row}")
        before = engine_counters(self.url) if counted else None
        runs, wall = _concurrently(n, jobs)
        if row == ROWS[0] and self.run.sampling is None:  # the greedy reference of the other rows
            self.references.setdefault(n, [r.tokens for r in runs])
        # (another engine's weights and numerics: its text is its own, not compared)
        summary = summarize_row(runs, wall, None if row.startswith(ROWS[3]) else self.references.get(n))
        if before is not None:  # the server's engine work per committed token
            after, tokens = engine_counters(self.url), max(1, sum(len(r.tokens) for r in runs))
            summary["engine_steps_per_token"] = (after[0] - before[0]) / tokens
            summary["engine_s_per_token"] = (after[1] - before[1]) / tokens
        self.results.append({"rtt_ms": rtt, "devices": n, "row": row, **summary})
        self.done(self.results)

    def _serve(self, engine: str) -> list[str]:
        run = self.run
        argv = [sys.executable, "-m", "omnidraft.cli", "serve", "--engine", engine, "--target", run.target]
        return argv + ["--port", str(self.port), "--no-auth", *(run.server_args if engine == "vllm" else ())]

    def alone_rows(self, engine: str) -> None:
        """`omnidraft serve --engine` on another engine here, streamed alone as the server is."""
        self._streamed(self._serve(engine), "/health", f"{ROWS[3]} {engine}", _server_alone)

    def _streamed(
        self, argv: list[str], health: str, row: str, stream: Callable[..., Timed], counted: bool = True
    ) -> None:
        """The rows `row` of a server started with `argv` (up once `health` answers), each request
        streamed alone by `stream(http, ids, max_tokens, sampling)`, at every round trip and load."""
        import httpx

        run = self.run
        with server_process(argv, SERVER_CPU, self.url, health, run.log):
            for rtt in run.rtts_ms:
                with _proxy(self.port, rtt) as near:
                    http = httpx.Client(base_url=near, timeout=600)
                    for i in self.ids:  # warm-up: every prompt read once (see `omnidraft_rows`)
                        stream(http, i, 8)
                    for n in run.devices:
                        jobs = [partial(stream, http, i, run.max_new_tokens, run.sampling) for i in self.ids]
                        self.add(rtt, n, row, jobs, counted)
                    http.close()

    def omnidraft_rows(self) -> None:
        """`omnidraft serve --engine E`: the server alone, then devices drafting for it."""
        import httpx

        import omnidraft as od

        run, ids = self.run, self.ids
        drafter = od.Drafter.load(run.drafter)
        with server_process(self._serve(run.engine), SERVER_CPU, self.url, "/health", run.log):
            for rtt in run.rtts_ms:
                with _proxy(self.port, rtt) as near:
                    http = httpx.Client(base_url=near, timeout=600)
                    # warm-up: every prompt read once, so no timed row is the first to read it (the
                    # engine's first pass over a shape costs more, and vLLM's rows after the first
                    # would read from its prefix cache what the first read cold)
                    for i in ids:
                        _server_alone(http, i, 8)
                    pairs = [
                        drafter.pair(_timed_remote(near, self.tokenizer)) for _ in range(max(run.devices))
                    ]
                    for pair in pairs:
                        _device(pair, run.prompts[0], 16)  # warm-up: connections, costs, the drafter's caches
                    for n in run.devices:
                        alone = [
                            partial(_server_alone, http, i, run.max_new_tokens, run.sampling) for i in ids
                        ]
                        self.add(rtt, n, ROWS[0], alone)
                        drafting = [
                            partial(_device, pairs[i % n], prompt, run.max_new_tokens, run.sampling)
                            for i, prompt in enumerate(run.prompts)
                        ]
                        self.add(rtt, n, ROWS[1], drafting)
                    http.close()
                    for pair in pairs:
                        pair.target.close()

    def stock_rows(self) -> None:
        """A stock vLLM server on the same CPU with the same weights, as VLLMTarget.load sets them."""
        from ..store.models import hf_directory

        model = hf_directory(self.run.target)
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        argv += ["--port", str(self.port), "--dtype", "float32", "--served-model-name", "target"]
        argv += ["--block-size", "32", "--kv-cache-memory-bytes", str(2 << 30)]
        self._streamed(argv, "/v1/models", ROWS[2], _stock, counted=False)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a table (tok/s and speedup over the fastest engine alone at the same RTT and load)."""
    head = (
        "| RTT ms | devices | row | tok/s | speedup | worst request | TTFT s | gap p50 / p95 ms | "
        "worst s/token | engine s/token | steps/token | identical |\n" + "|---" * 12 + "|\n"
    )

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        return format(r[key], fmt) if r.get(key) is not None else "-"

    return head + "".join(
        f"| {r['rtt_ms']:g} | {r['devices']} | {r['row']} | {r['tok_s']:.2f} | {r['speedup']:.2f}x | "
        f"{cell(r, 'worst_request_speedup', '.2f')}x | "
        f"{cell(r, 'ttft_s', '.2f')} | {1000 * r['gap_p50_s']:.0f} / {1000 * r['gap_p95_s']:.0f} | "
        f"{r['worst_request_s_per_token']:.3f} | {cell(r, 'engine_s_per_token', '.3f')} | "
        f"{cell(r, 'engine_steps_per_token', '.2f')} | "
        f"{'-' if r['identical'] is None else r['identical']}/{r['requests']} |\n"
        for r in rows
    )
