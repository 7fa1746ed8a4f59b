"""A TCP proxy that delays every byte by half a round trip in each direction: the network between a
device and a server, for benchmarks on one machine.

    python -m omnidraft.bench.delay_proxy --listen 9000 --upstream 127.0.0.1:8000 --rtt-ms 50

Latency only: bytes are forwarded in the order and chunks they were read, each written `rtt / 2`
after it was read, with no bandwidth limit and no loss. Every connection gets its own upstream
connection, so a client's keep-alive connections (a stream and its proposals) each see the
delay. This module is not a server of its own: it knows nothing of HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time

__all__ = ["main", "serve"]

CHUNK = 1 << 16


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy `reader` to `writer`, each chunk written `delay` seconds after it was read."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while data := await reader.read(CHUNK):
            queue.put_nowait((time.monotonic() + delay, data))
        queue.put_nowait((time.monotonic() + delay, b""))

    reading = asyncio.ensure_future(read())
    try:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    finally:
        reading.cancel()
        with contextlib.suppress(Exception):
            writer.close()


async def serve(
    listen: int, upstream: tuple[str, int], rtt: float, ready: asyncio.Event | None = None
) -> None:
    """Accept on loopback port `listen`, forward to `upstream`, each way delayed by `rtt / 2`."""

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*upstream)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(
            _pump(client_r, server_w, rtt / 2), _pump(server_r, client_w, rtt / 2), return_exceptions=True
        )

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    if ready is not None:
        ready.set()
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m omnidraft.bench.delay_proxy", description=__doc__)
    p.add_argument("--listen", type=int, required=True, help="loopback port to accept on")
    p.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    p.add_argument("--rtt-ms", type=float, required=True, help="round-trip time added, ms (half each way)")
    args = p.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    if not host or not port.isdigit() or args.rtt_ms < 0:
        raise SystemExit(
            f"--upstream must be HOST:PORT and --rtt-ms >= 0, got {args.upstream!r}, {args.rtt_ms}"
        )
    print(
        f"delaying {args.listen} -> {args.upstream} by {args.rtt_ms} ms round trip",
        file=sys.stderr,
        flush=True,
    )
    asyncio.run(serve(args.listen, (host, int(port)), args.rtt_ms / 1000))


if __name__ == "__main__":
    main()
