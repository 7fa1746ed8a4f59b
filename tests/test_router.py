"""`omnidraft deploy` (issue "Past one server"): two `omnidraft serve` replicas of a tiny model behind
HAProxy. A replica killed with -9 mid-run, or drained with SIGTERM, fails no request: each device
re-opens its session from its committed ids on the replica the router sends it to, and every output
is the target's own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

import omnidraft as od
from omnidraft.bench.network import free_port
from omnidraft.cli.deploy import haproxy_config
from omnidraft.target import Rule
from omnidraft.wire import ROUTE_HEADER

from .conftest import target_greedy
from .test_cli_runs import models, own_cache  # noqa: F401 - fixtures
from .test_remote import PROMPTS


class Deployed:
    """`omnidraft deploy` running: its router's URL, the replicas' ports and pids, what it printed."""

    def __init__(self, target_dir: str, cache: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMNIDRAFT_CACHE": cache}
        command = [
            sys.executable,
            "-m",
            "omnidraft.cli",
            "deploy",
            "--replicas",
            "2",
            "--port",
            str(self.port),
        ]
        serve = ["--", "--target", target_dir, "--engine", "torch", "--no-auth"]
        self.process = subprocess.Popen(command + serve, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.wait_ready(2)
        except BaseException:
            self.process.kill()  # (its replicas drain when it dies: deploy.py)
            raise

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip())

    def pids(self) -> dict[int, int]:
        """The replicas now running: port -> pid (the newest start of each port)."""
        out = {}
        for line in self.lines:
            if line.startswith("omnidraft deploy: replica pid "):
                pid, url = line.split()[4], line.split()[-1]
                out[int(url.rsplit(":", 1)[1])] = int(pid)
        return out

    def ready(self, port: int) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, replicas: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ports = self.pids()
            if len(ports) == replicas and all(self.ready(p) for p in ports) and self.ready(self.port):
                time.sleep(1.0)  # the router's health checks see them up
                return
            assert self.process.poll() is None, "\n".join(self.lines[-30:])
            time.sleep(0.2)
        raise AssertionError("the replicas never became ready:\n" + "\n".join(self.lines[-30:]))

    def holding(self) -> int:
        """The port of a replica that holds a session now."""
        for port in self.pids():
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json().get("sessions"):
                return port
        raise AssertionError("no replica holds a session")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=90)


@pytest.fixture
def deployed(models, tmp_path_factory):  # noqa: F811 - the fixture imported above
    running = Deployed(models["target"], str(tmp_path_factory.getbasetemp() / "cli-cache"))
    try:
        yield running
    finally:
        assert running.stop() == 0, "\n".join(running.lines[-30:])


@pytest.fixture
def reference(models):  # noqa: F811
    target = od.LocalTarget.load(models["target"])
    return target, {p: target_greedy(target, p, 40) for p in PROMPTS}


def test_the_router_config_hashes_sessions_and_checks_readiness():
    text = haproxy_config("0.0.0.0", 8000, [8001, 8002])
    assert f"balance hdr({ROUTE_HEADER})" in text and "hash-type consistent" in text
    assert "option httpchk GET /ready" in text and "retry-on conn-failure" in text
    assert "server replica2 127.0.0.1:8002 check" in text


def _pairings_through(url: str, drafter, want: dict, strike) -> None:
    """8 pairings (verify rounds and streams decoding alone), three requests each, with `strike()`
    called 0.3 s in: no request fails and every output is the target's own."""
    prompts, results, errors = PROMPTS * 2, {}, []

    def run(i: int, prompt: str) -> None:
        try:
            remote = od.RemoteTarget(url, retries=3)
            objective = "compute" if i % 2 else "latency"  # verify rounds, or streams decoding alone
            for _ in range(3):
                out = drafter.pair(remote, k=2, objective=objective).generate(prompt, max_new_tokens=40)
                results.setdefault(i, []).append(out.token_ids)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(f"{i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    strike()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(results) == len(prompts) and all(outs == [want[prompts[i]]] * 3 for i, outs in results.items())


def test_a_replica_killed_mid_stream_fails_no_request(deployed, reference, tiny_drafter, caplog):
    target, want = reference
    caplog.set_level("INFO", logger="omnidraft")
    # a stream cut by the kill: it continues on the other replica from the committed ids
    remote = od.RemoteTarget(deployed.url, retries=3)
    ids = target.tokenizer(PROMPTS[0])["input_ids"]
    session = remote.begin(ids)
    session.verify(torch.tensor([], dtype=torch.long), Rule())  # opens the session (one token)
    victim = deployed.pids()[deployed.holding()]  # asked first: the stream would end while it asks
    stream, got = session.decode(299), [session.ids[-1]]
    got.append(next(stream))
    os.kill(victim, signal.SIGKILL)
    got += list(stream)
    assert got == target_greedy(target, PROMPTS[0], 300)
    assert "the stream broke after" in caplog.text  # (it did not end before the kill)
    session.close()
    # pairings running while a replica dies
    deployed.wait_ready(2)
    _pairings_through(
        deployed.url,
        tiny_drafter,
        want,
        lambda: os.kill(next(iter(deployed.pids().values())), signal.SIGKILL),
    )


def test_a_drained_replica_fails_no_request_and_exits_0(deployed, reference, tiny_drafter):
    _, want = reference
    port, pid = next(iter(deployed.pids().items()))
    began = []

    def drain() -> None:
        began.append(time.monotonic())
        os.kill(pid, signal.SIGTERM)

    _pairings_through(deployed.url, tiny_drafter, want, drain)
    deadline = time.monotonic() + 40
    while f"omnidraft deploy: replica at port {port} exited (0)" not in deployed.lines:
        assert time.monotonic() < deadline, "\n".join(deployed.lines[-30:])
        time.sleep(0.1)
    assert time.monotonic() - began[0] < 35  # its drain deadline (GRACE_S), and a margin
