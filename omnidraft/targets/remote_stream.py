"""A device's side of a speculate stream, built for a network between device and server.

The server streams committed tokens; the device drafts after them and posts proposals, which the
server's engine verifies in its own step (server/device_proposals.py). Over a real round trip three things
keep the device's drafts useful:
- the stream is read by a thread of its own (`ChunkReader`), so tokens are committed as they
  arrive and the device drafts once after the newest of them, never after each of a backlog;
- proposals go out on their own connection from a thread of their own (`ProposalSender`), newest
  first and never waited for: reading the stream never waits a round trip;
- each proposal drafts ahead of what the device has heard (`draft_ahead`): the server's step in
  flight is assumed accepted, so a proposal that arrives a step late still continues the text, and
  the server takes whatever part of it continues the committed tokens then.
What is committed is always the server's own decoding: a late, wrong or lost proposal costs speed only.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator, Protocol

from ..adaptive.policy import ema
from ..decode.verify import accepted_prefix
from ..errors import RemoteRequestError, StreamCutError, TargetError, TargetUnavailableError
from ..wire import MAX_PROPOSAL, GenerateChunk, ProposalRequest, SpeculateRequest
from .remote_http import refused

__all__ = ["ChunkReader", "DraftAhead", "ProposalSender", "speculate", "stream_ended"]

FIRST_BUDGET = 4  # the draft budget a device assumes while a speculate stream's prompt is prefilled

_DONE = object()


class DraftAhead:
    """The device's proposal while it streams, drafted ahead of what it has heard.

    After the committed ids change in a way the proposal did not foresee (or at the start), a new
    round drafts `step` tokens after them (`source.next`); while the committed ids keep following
    the proposal, the same draft is drafted on, `step` tokens at a time (`source.extend`), until
    it reaches 3 budget + 2 tokens past the committed ones: enough for the server's step in flight
    and the one after it to each accept a whole budget and emit one token, and for the step after
    those to find `budget` more (a round trip up to about two steps). So a proposal the server
    receives a step or two late still continues the text, and when a step accepts what it
    verified, the next step's draft is at the server already. `next_proposal`
    says what to send now, or None when there is nothing new (then wait for the server)."""

    def __init__(self, source: Any, step: int = 3) -> None:
        if step < 1:
            raise ValueError(f"draft step must be >= 1, got {step}")
        self.source, self.step = source, step
        self.at = 0  # the committed length the proposal was drafted after
        self.proposal: list[int] = []
        self._heard = 0  # the committed length at the last call

    def _remainder(self, ids: list[int]) -> list[int] | None:
        """What of the proposal is left after `ids`, None where `ids` left it."""
        done = len(ids) - self.at
        if not self.proposal or done < 0 or accepted_prefix(self.proposal, ids[self.at :]) < done:
            return None
        return self.proposal[done:]

    def next_proposal(self, ids: list[int], budget: int, remaining: int) -> list[int] | None:
        """The proposal to send after the committed `ids` now (target ids drafted after them; the
        server may take `budget` a step; `remaining` tokens may still be generated), or None."""
        ahead = min(3 * budget + 2, remaining - 1, MAX_PROPOSAL)
        if budget <= 0 or ahead <= 0:
            return None
        left = self._remainder(ids)
        heard, self._heard = self._heard, len(ids)
        if not left:  # a new round: the server's tokens left the proposal, or used it up
            first = min(self.step, ahead)
            self.proposal = self.source.next(list(ids), ahead, remaining, k=first)
            self.at = len(ids)
            return list(self.proposal) or None
        if len(left) >= ahead:
            return None
        if len(ids) > heard:  # the server committed part of it since: draft on past an uncertain token
            self.source.resume()
        done = len(ids) - self.at
        longer = self.source.extend(self.step, done + ahead)
        if longer is None or len(longer) <= len(self.proposal):
            return None
        self.proposal = longer
        return longer[done:]


class ProposalSender:
    """Posts a streaming session's proposals from a thread of its own, newest only: a proposal not
    yet sent when a newer one comes is dropped (the newer one continues the text further). `post`
    sends one (a 409, the stream ended meanwhile, is ignored); `rtt_s` is the measured time of a
    post (the round trip plus the server's handling)."""

    def __init__(self, post: Callable[[ProposalRequest], Any]) -> None:
        self.post = post
        self.rtt_s: float | None = None
        self.error: BaseException | None = None
        self._slot: ProposalRequest | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="omnidraft-proposals", daemon=True)
        self._thread.start()

    def offer(self, at: int, proposal: list[int]) -> None:
        with self._cond:
            self._slot = ProposalRequest(at=at, proposal=proposal)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._slot is None and not self._closed:
                    self._cond.wait()
                if self._closed or self._slot is None:
                    return
                message, self._slot = self._slot, None
            started = time.perf_counter()
            try:
                self.post(message)
            except RemoteRequestError as exc:
                if exc.status != 409:  # 409: the stream ended meanwhile (its last chunk says so)
                    self.error = exc
                    return
            except TargetError as exc:  # the server is unreachable: the stream will say so too
                self.error = exc
                return
            self.rtt_s = ema(self.rtt_s, time.perf_counter() - started, 0.7)


class ChunkReader:
    """The NDJSON chunks of a stream's `lines` (an iterator that blocks), read by a thread of its
    own into a queue, taken with `take`. `step_s`: the measured time between chunks (the
    server's step, as the device sees it)."""

    def __init__(self, lines: Iterator[str]) -> None:
        self.step_s: float | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._lines = lines
        self._thread = threading.Thread(target=self._run, name="omnidraft-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = None
        try:
            for line in self._lines:
                if not line.strip():
                    continue
                chunk = GenerateChunk.model_validate_json(line)
                now = time.perf_counter()
                if last is not None and chunk.tokens:
                    self.step_s = ema(self.step_s, now - last, 0.7)
                last = now
                self._queue.put(chunk)
        except BaseException as exc:  # noqa: BLE001 - raised again on the reading side
            self._queue.put(exc)
        finally:
            self._queue.put(_DONE)

    def take(self, block: bool) -> GenerateChunk | None:
        """The next chunk; None where none has arrived yet and `block` is False. Raises the read's
        error, or EOFError once the stream has ended."""
        try:
            item = self._queue.get(block=block)
        except queue.Empty:
            return None
        if item is _DONE:
            self._queue.put(_DONE)
            raise EOFError("the stream ended")
        if isinstance(item, BaseException):
            raise item
        return item

    @property
    def pending(self) -> bool:
        """Whether another chunk has arrived already (no point drafting before reading it)."""
        return not self._queue.empty()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class Replica(Protocol):
    """Where a session's requests go now: the server's address and the client holding its
    connections (a RemoteTarget's current replica)."""

    @property
    def url(self) -> str: ...

    @property
    def http(self) -> Any:  # an httpx.Client
        ...


class StreamedSession(Protocol):
    """What the speculate stream reads of a RemoteTarget session: its target's replica, its
    committed ids, its headers and calls, opening it on the server, committing a chunk."""

    @property
    def owner(self) -> Replica: ...

    ids: list[int]

    def headers(self) -> dict[str, str]: ...

    def call(self, method: str, path: str, message: Any = None) -> Any: ...

    def _open(self) -> str: ...

    def commit(self, chunk: GenerateChunk) -> None: ...


def stream_ended(chunk: GenerateChunk) -> None:
    """A stream's last chunk: a cut one (its session closed on the server) raises, so that the
    request ends as an error whose `partial` holds what was committed, not as a finished one."""
    if chunk.cancelled:
        raise StreamCutError(
            f"the server cut the stream after {chunk.committed} committed tokens (its session was "
            "closed): continue with pair.generate(..., after=error.partial.token_ids)"
        )


def speculate(
    session: StreamedSession,
    max_tokens: int,
    source: Any,
    drafter_ids: list[int] | None,
    sampling: dict[str, Any],
) -> Iterator[list[int]]:
    """The speculate stream of `session` (a RemoteTarget's): a thread reads the committed chunks,
    the device drafts ahead once after the newest of them, a thread posts each proposal."""
    import contextlib

    import httpx

    owner, sid, start = session.owner, session._open(), len(session.ids)
    source.open(list(session.ids), drafter_ids)
    path = f"/v1/sessions/{sid}/speculate"
    content = SpeculateRequest(committed=start, max_tokens=max_tokens, **sampling).model_dump_json()
    headers = session.headers()
    with contextlib.ExitStack() as stack:
        try:
            reply = stack.enter_context(owner.http.stream("POST", path, content=content, headers=headers))
        except httpx.TransportError as exc:
            raise TargetUnavailableError(f"{owner.url}{path}: {type(exc).__name__}: {exc}") from exc
        if reply.status_code >= 400:
            reply.read()
            raise refused(owner.url, path, reply)
        sender = ProposalSender(lambda m: session.call("POST", f"/v1/sessions/{sid}/proposal", m))
        stack.callback(sender.close)
        reader = ChunkReader(reply.iter_lines())
        stack.callback(reader.join, 5.0)
        stack.callback(reply.close)  # (callbacks run last first: the reader's read ends with it)
        yield from _follow(session, reader, sender, DraftAhead(source), max_tokens, start)


def _follow(
    session: StreamedSession,
    reader: ChunkReader,
    sender: ProposalSender,
    ahead: DraftAhead,
    max_tokens: int,
    start: int,
) -> Iterator[list[int]]:
    """Commit the stream's chunks as they come; between them, while there is something worth
    drafting, draft ahead and hand each proposal to the sender."""
    import httpx

    budget, idle = FIRST_BUDGET, False  # until the first chunk says the server's budget
    while True:
        try:
            chunk = reader.take(block=idle)
        except httpx.TransportError as exc:
            raise TargetUnavailableError(f"the stream broke ({type(exc).__name__}: {exc})") from exc
        except EOFError:
            raise TargetUnavailableError("the stream ended before its last chunk") from None
        if chunk is not None:
            session.commit(chunk)
            budget = MAX_PROPOSAL if chunk.budget is None else chunk.budget
            if chunk.tokens:
                yield chunk.tokens
            if chunk.done:
                stream_ended(chunk)
                return
            idle = False
            if reader.pending:
                continue
        remaining = max_tokens - (len(session.ids) - start)
        proposal = ahead.next_proposal(list(session.ids), budget, remaining)
        if proposal is None:
            idle = True
        else:
            sender.offer(len(session.ids), proposal)
