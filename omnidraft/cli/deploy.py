"""`omnidraft deploy`: N `omnidraft serve` replicas behind HAProxy, from one command.

    omnidraft deploy --replicas 2 --port 8000 -- qwen2.5-coder-0.5b --engine vllm --api-key-file keys

Everything after `--` is each replica's `omnidraft serve` arguments (each gets its own port: 8001,
8002, ...). The router is HAProxy (Debian's `haproxy` package; docs/deploy.md says why), with the
configuration `haproxy_config` writes: a session's requests hash on the device's routing key
(`ROUTE_HEADER`, consistent hashing), so they reach the replica holding its KV cache; /ready is the
health check, so a draining replica gets no new work; a connection refused by a dead replica is
sent to another. A replica that exits (killed, or drained by SIGTERM: a rolling restart) is started
again (unless `--no-restart`); SIGTERM or Ctrl-C on `omnidraft deploy` drains every replica, then
stops the router.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..wire import ROUTE_HEADER

__all__ = ["deploy", "deploy_args", "haproxy_config"]

CHECK_MS = 500  # how often the router asks each replica's /ready


def deploy_args(sub: Any) -> None:
    d = sub.add_parser("deploy", help="N `omnidraft serve` replicas behind HAProxy (docs/deploy.md)")
    d.add_argument("--replicas", type=int, default=2)
    d.add_argument("--host", default="127.0.0.1", help="where the router listens")
    d.add_argument("--port", type=int, default=8000, help="the router's port; replicas take the next ones")
    d.add_argument("--no-restart", action="store_true", help="leave a replica that exits down")
    d.add_argument(
        "serve", nargs=argparse.REMAINDER, help="-- then each replica's `omnidraft serve` arguments"
    )


def haproxy_config(host: str, port: int, replicas: list[int], check_ms: int = CHECK_MS) -> str:
    """HAProxy's configuration: the router on host:port, the replicas on 127.0.0.1 at `replicas`."""
    servers = "\n".join(f"    server replica{i} 127.0.0.1:{p} check" for i, p in enumerate(replicas, start=1))
    return f"""global
    maxconn 4096

defaults
    mode http
    timeout connect 2s
    timeout client 600s
    timeout server 600s
    timeout http-keep-alive 30s
    # a request whose replica refused the connection (dead) or closed it unanswered goes to another
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response

frontend omnidraft
    bind {host}:{port}
    default_backend replicas

backend replicas
    # a session's requests carry the device's routing key: hashed, they reach the replica holding
    # its KV cache; requests without one (OpenAI clients) go round robin
    balance hdr({ROUTE_HEADER})
    hash-type consistent
    option httpchk GET /ready
    http-check expect status 200
    # (weight 100: more points each on the hash ring, so keys spread evenly over few replicas)
    default-server inter {check_ms}ms fall 1 rise 1 weight 100
{servers}
"""


def _drain_when_orphaned() -> None:
    """In a replica's child process, before it runs: SIGTERM (a drain) when its parent dies (Linux's
    PR_SET_PDEATHSIG), so a killed `omnidraft deploy` leaves no replica behind."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def deploy(args: argparse.Namespace) -> None:
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        raise SystemExit(
            "omnidraft deploy: the router is HAProxy, not installed here: apt-get install haproxy "
            "(Debian, Ubuntu), or your distribution's package"
        )
    serve = args.serve[1:] if args.serve[:1] == ["--"] else args.serve
    if not serve or args.replicas < 1:
        raise SystemExit("omnidraft deploy: give --replicas N >= 1, then -- and the serve arguments")
    ports = [args.port + i for i in range(1, args.replicas + 1)]
    home = Path(tempfile.mkdtemp(prefix="omnidraft-deploy-"))
    config = home / "haproxy.cfg"
    config.write_text(haproxy_config(args.host, args.port, ports))

    def start(port: int) -> subprocess.Popen:
        command = [
            sys.executable,
            "-m",
            "omnidraft.cli",
            "serve",
            *serve,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        # its own session: Ctrl-C here drains it rather than killing it; and should deploy die, it drains
        replica = subprocess.Popen(command, start_new_session=True, preexec_fn=_drain_when_orphaned)
        print(
            f"omnidraft deploy: replica pid {replica.pid} at http://127.0.0.1:{port}",
            file=sys.stderr,
            flush=True,
        )
        return replica

    replicas = {port: start(port) for port in ports}
    router = subprocess.Popen([haproxy, "-db", "-f", str(config)], start_new_session=True)
    print(
        f"omnidraft deploy: {len(ports)} replicas behind HAProxy (pid {router.pid}) at "
        f"http://{args.host}:{args.port}; its configuration: {config}",
        file=sys.stderr,
        flush=True,
    )
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    while not stopping and router.poll() is None:
        for port, replica in list(replicas.items()):
            if replica.poll() is not None:  # killed, or drained: started again (unless --no-restart)
                print(
                    f"omnidraft deploy: replica at port {port} exited ({replica.returncode})", file=sys.stderr
                )
                if args.no_restart:
                    del replicas[port]
                else:
                    replicas[port] = start(port)
        time.sleep(0.2)
    for replica in replicas.values():  # drain them all (server/drain.py), then stop the router
        replica.send_signal(signal.SIGTERM)
    # (a replica still loading when signalled ends by the signal: it had nothing to drain)
    codes = [replica.wait() for replica in replicas.values()]
    router.send_signal(signal.SIGUSR1)  # HAProxy's soft stop
    router.wait(timeout=10)
    if any(code not in (0, -signal.SIGTERM) for code in codes):
        raise SystemExit(f"omnidraft deploy: replicas exited with {codes}")
