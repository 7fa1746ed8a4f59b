"""A verification server's sessions, the fair model lock, and giving a session's engine resources back."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..wire import VerifyReply, VerifyRequest

if TYPE_CHECKING:
    from ..target import TargetSession

__all__ = ["FairLock", "Session", "ended", "release_session", "serving", "tenant_salt"]

_SECRET = secrets.token_bytes(16)  # this process's own: a tenant's salt no client can guess


def tenant_salt(key: int) -> str:
    """The prefix-cache salt of the sessions of API key number `key`: theirs alone."""
    return hmac.new(_SECRET, f"key {key}".encode(), hashlib.sha256).hexdigest()[:32]


@dataclass
class Session:
    """One device's session on the server: the target session and what guards it."""

    inner: TargetSession
    used: float
    key: int = 0  # which API key opened it: only that key may use it
    last: tuple[VerifyRequest, VerifyReply] | None = None  # the request applied last and its reply
    lock: threading.Lock = field(default_factory=threading.Lock)  # one request of this session at a time
    verified: bool = False  # a session that never verifies expires after `fresh_ttl_s`, not `ttl_s`
    streaming: bool = False  # a generate stream is running: other requests are refused until it ends
    source: Any = None  # a speculate stream's DeviceProposals, which takes the device's proposals
    busy: int = 0  # requests being served now (a prefill, a verify): a session in use never expires
    cancelled: threading.Event = field(default_factory=threading.Event)  # deleted: its stream stops

    def __post_init__(self) -> None:
        # one key's sessions share prompt prefixes in the engine's cache; two keys never do
        share = getattr(self.inner, "share_prefix_cache", None)
        if share is not None:
            share(tenant_salt(self.key))

    def cancel(self) -> None:
        """The session was deleted: a stream it runs stops at its next token."""
        self.cancelled.set()
        if self.source is not None:
            self.source.cancel()

    @property
    def in_use(self) -> bool:
        """Whether a request or a stream is being served for this session now."""
        return self.busy > 0 or self.streaming


class FairLock:
    """A lock granted in the order it was asked for: a session feeding a long prompt chunk by chunk
    queues behind the verifies that arrived meanwhile instead of taking the lock straight back."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self._held = False

    def __enter__(self) -> None:
        me = object()
        with self._cond:
            self._queue.append(me)
            while self._held or self._queue[0] is not me:
                self._cond.wait()
            self._queue.popleft()
            self._held = True

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()


def release_session(session: Session | None) -> None:
    """Give a dropped session's engine resources back (a llama.cpp slot; nothing on vLLM)."""
    if session is not None:
        session.inner.close()


@contextlib.contextmanager
def serving(session: Session, table_lock: threading.RLock) -> Iterator[None]:
    """While a request of `session` is served (its prefill included, however long), the session
    counts as in use and never expires (`table_lock`: the lock its expiry sweep holds)."""
    with table_lock:
        session.busy += 1
    try:
        yield
    finally:
        with table_lock:
            session.busy -= 1


def ended(stream: Iterator[bytes], end: Callable[[], None]) -> Iterator[bytes]:
    """`stream` with `end` called when it is garbage-collected, should it never run to its own end
    (a client that left before the first chunk was read): its hold and its session are freed."""
    weakref.finalize(stream, end)
    return stream
