"""A device's side of a speculate stream over a network (targets/remote_stream.py), the server's lookup
fallback (server/lookup.py), the budget that re-measures after it fell to 0 (server/budget.py),
a proposal bounded by the committed length, and the delaying proxy the network bench uses."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest

from omnidraft.errors import RemoteRequestError
from omnidraft.server.budget import RecentAcceptance
from omnidraft.server.device_proposals import DeviceProposals
from omnidraft.server.lookup import PromptLookup
from omnidraft.targets.remote_stream import ChunkReader, DraftAhead, ProposalSender
from omnidraft.wire import GenerateChunk


class FakeProposals:
    """A drafter that always drafts the next integers: `next` starts a round after the ids,
    `extend` drafts on; `calls` records what was asked."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.calls: list[tuple] = []
        self.stop_after = stop_after
        self._proposal: list[int] = []

    def next(self, ids, limit, remaining, *, k=None):
        self.calls.append(("next", len(ids), k))
        self._proposal = [ids[-1] + 1 + i for i in range(min(k, limit))]
        return list(self._proposal)

    def extend(self, k, limit):
        if self.stop_after is not None and len(self._proposal) >= self.stop_after:
            return None
        self.calls.append(("extend", k, limit))
        base = self._proposal[-1]
        self._proposal += [base + 1 + i for i in range(min(k, limit - len(self._proposal)))]
        return list(self._proposal)

    def resume(self):
        self.calls.append(("resume",))


def test_the_device_drafts_ahead_and_starts_over_only_where_the_server_left_the_draft():
    source = FakeProposals()
    ahead = DraftAhead(source, step=3)
    ids = [1, 2, 3]
    assert ahead.next_proposal(ids, budget=2, remaining=50) == [4, 5, 6]  # a new round: 3 tokens
    grown = []
    while (more := ahead.next_proposal(ids, budget=2, remaining=50)) is not None:
        grown.append(more)
    assert grown[-1] == list(range(4, 4 + 3 * 2 + 2))  # drafted on to 3 budget + 2 past the committed ids
    # the server accepted 4, 5 and emitted 6: the proposal still continues, only what is left is sent
    more = ahead.next_proposal([1, 2, 3, 4, 5, 6], budget=2, remaining=47)
    assert more is not None and more[0] == 7 and ("resume",) in source.calls
    assert [c[0] for c in source.calls].count("next") == 1
    # the server emitted 9 instead of 7: a new round after the committed ids
    assert ahead.next_proposal([1, 2, 3, 4, 5, 6, 9], budget=2, remaining=46) == [10, 11, 12]
    assert source.calls[-1] == ("next", 7, 3)
    assert ahead.next_proposal([1, 2, 3, 4], budget=0, remaining=10) is None  # the server takes none
    assert ahead.next_proposal([1, 2, 3, 4], budget=4, remaining=1) is None  # nothing left to draft


def test_a_draft_the_drafter_stopped_is_not_drafted_on_until_the_server_moves():
    source = FakeProposals(stop_after=3)
    ahead = DraftAhead(source, step=3)
    assert ahead.next_proposal([1], budget=4, remaining=50) == [2, 3, 4]
    assert ahead.next_proposal([1], budget=4, remaining=50) is None  # stopped: wait for the server


def test_the_sender_posts_the_newest_proposal_and_never_blocks_the_caller():
    posted, gate = [], threading.Event()

    def post(message):
        gate.wait(5)
        posted.append((message.at, message.proposal))

    sender = ProposalSender(post)
    started = time.perf_counter()
    for at in range(3, 10):
        sender.offer(at, [at])
    assert time.perf_counter() - started < 0.5  # the offers did not wait for a post
    gate.set()
    deadline = time.monotonic() + 5
    while (not posted or posted[-1][0] != 9) and time.monotonic() < deadline:
        time.sleep(0.01)
    sender.close()
    assert posted[-1] == (9, [9]) and len(posted) <= 3  # stale ones were dropped, the newest sent
    assert sender.rtt_s is not None


def test_a_409_is_ignored_and_another_refusal_ends_the_sender():
    sender = ProposalSender(lambda m: (_ for _ in ()).throw(RemoteRequestError("gone", 409)))
    sender.offer(3, [1])
    time.sleep(0.1)
    assert sender.error is None
    sender.close()
    sender = ProposalSender(lambda m: (_ for _ in ()).throw(RemoteRequestError("bad", 422)))
    sender.offer(3, [1])
    sender._thread.join(2)
    assert isinstance(sender.error, RemoteRequestError)


def test_the_reader_hands_over_chunks_without_blocking_and_says_when_more_arrived():
    release = threading.Event()

    def lines():
        yield GenerateChunk(tokens=[5], committed=4).model_dump_json()
        yield ""
        yield GenerateChunk(tokens=[6], committed=5).model_dump_json()
        release.wait(5)
        yield GenerateChunk(tokens=[7], committed=6, done=True).model_dump_json()

    reader = ChunkReader(lines())
    first = reader.take(block=True)
    deadline = time.monotonic() + 5
    while not reader.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.tokens == [5] and reader.pending
    assert reader.take(block=True).tokens == [6] and reader.take(block=False) is None
    release.set()
    assert reader.take(block=True).done
    with pytest.raises(EOFError):
        reader.take(block=True)


def test_the_lookup_proposes_what_followed_the_context_and_backs_off_where_it_misses():
    look = PromptLookup(n=2, floor=0.5, retry_every=4)
    ids = [1, 2, 3, 4, 9, 1, 2]
    assert look.propose(ids, 3) == [3, 4, 9]
    ids += [3, 4]
    assert look.propose(ids, 2) == [9, 1]
    assert PromptLookup(n=2).propose([1, 2, 3], 3) == []
    for _ in range(3):
        look.observe(4, 0)  # it keeps missing here
    asked = [look.propose(ids, 3) for _ in range(8)]
    assert sum(bool(a) for a in asked) == 2  # tried again every 4th step only


def test_a_budget_driven_to_zero_is_measured_again():
    seen = RecentAcceptance(hold_s=3.0, probe_s=1.0, warm=4)
    for _ in range(4):
        seen.observe(4, 0)
    assert seen.value == 0.0
    assert seen.budget(0, 5, now=0.0) == 0 and seen.budget(0, 5, now=2.9) == 0
    assert seen.budget(0, 5, now=3.0) == 5 and seen.budget(0, 5, now=3.9) == 5  # a probe window
    assert seen.budget(0, 5, now=4.1) == 0
    assert seen.budget(3, 5, now=4.2) == 3  # acceptance recovered: the measured budget again


def test_a_proposal_for_text_not_yet_committed_is_refused():
    source = DeviceProposals(3, 8, {0}, lambda: 4, lambda: 0.0)
    with pytest.raises(ValueError, match="at most the committed 3 tokens, got at=1000000000"):
        source.offer(10**9, [5])
    source.offer(3, [5, 6])
    assert source.next([1, 2, 3], 8, 8) == [5, 6]


def _echo_server() -> tuple[int, threading.Event]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    stop = threading.Event()

    def serve():
        conn, _ = sock.accept()
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data)
        sock.close()

    threading.Thread(target=serve, daemon=True).start()
    return sock.getsockname()[1], stop


def test_the_proxy_delays_every_byte_by_half_the_round_trip_each_way():
    upstream, _ = _echo_server()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with delaying(port, upstream, 0.2):
        with socket.create_connection(("127.0.0.1", port)) as c:
            for message in (b"ping", b"pong"):
                started = time.perf_counter()
                c.sendall(message)
                got = b""
                while len(got) < 4:
                    got += c.recv(16)
                assert got == message and 0.19 <= time.perf_counter() - started < 0.6


@contextlib.contextmanager
def delaying(port: int, upstream: int, rtt: float):
    """The delaying proxy on `port` in front of `upstream`, on an event loop of its own thread."""
    from omnidraft.bench.delay_proxy import serve

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    ready = threading.Event()

    async def run():
        up = asyncio.Event()
        task = asyncio.ensure_future(serve(port, ("127.0.0.1", upstream), rtt, up))
        await up.wait()
        ready.set()
        await task

    async def shutdown():
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(run(), loop)
    assert ready.wait(5)
    try:
        yield
    finally:
        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
