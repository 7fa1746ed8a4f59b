"""asyncio front ends of a pairing: `await agenerate(pair, ...)`, `await achat(pair, ...)` and
`async for piece in astream(pair, ...)`. The work runs in worker threads (a pairing may be shared
by threads), so an event loop serving other requests is never blocked by drafting, verification
or a remote target's HTTP round trips."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator

__all__ = ["achat", "agenerate", "astream"]

_END = object()


async def agenerate(pair: Any, prompt: str | list[str], max_new_tokens: int = 128, **options: Any) -> Any:
    """`pair.generate(...)` without blocking the event loop."""
    return await asyncio.to_thread(pair.generate, prompt, max_new_tokens, **options)


async def achat(pair: Any, messages: list[dict[str, str]], max_new_tokens: int = 128, **options: Any) -> Any:
    """`pair.chat(...)` without blocking the event loop."""
    return await asyncio.to_thread(pair.chat, messages, max_new_tokens, **options)


async def astream(pair: Any, prompt: str, max_new_tokens: int = 128, **options: Any) -> AsyncIterator[str]:
    """The text pieces of `pair.stream(...)` as they are committed. Stopping early (leaving the
    loop) stops the generation after its current round."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    stop = threading.Event()

    def work() -> None:
        try:
            for piece in pair.stream(prompt, max_new_tokens, **options):
                loop.call_soon_threadsafe(queue.put_nowait, piece)
                if stop.is_set():
                    break
            loop.call_soon_threadsafe(queue.put_nowait, _END)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's task
            loop.call_soon_threadsafe(queue.put_nowait, exc)

    worker = loop.run_in_executor(None, work)
    try:
        while (item := await queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        await worker
