"""DeviceProposals, the server's side of a streaming device session, without an engine: what the
device is told, which of its proposals the engine takes, how long the engine waits for one, and
the stream's check that the ids told early agree with the engine's output."""

from __future__ import annotations

import threading
import time

import pytest

from omnidraft.server.device_proposals import DeviceProposals, follow_engine

PROMPT = [1, 2, 3]


def proposals(
    budget: int = 4, wait: float = 0.0, max_tokens: int = 6, seen: list | None = None
) -> DeviceProposals:
    return DeviceProposals(
        len(PROMPT),
        max_tokens,
        {0},
        lambda: budget,
        lambda: wait,
        (lambda p, a: seen.append((p, a))) if seen is not None else (lambda p, a: None),
    )


def test_the_device_hears_the_generated_ids_cut_after_an_eos_and_at_max_tokens():
    r = proposals(max_tokens=4)
    r.prepare(PROMPT + [7])
    r.prepare(PROMPT + [7])  # nothing new: nothing told
    r.prepare(PROMPT + [7, 8, 0, 9])  # an EOS: what follows it in the row is not the output
    told = [r.events.get_nowait() for _ in range(r.events.qsize())]
    assert told == [[7], [7, 8, 0]]
    r = proposals(max_tokens=2)
    r.prepare(PROMPT + [7, 8, 9])
    assert r.events.get_nowait() == [7, 8]


def test_the_engine_takes_the_newest_proposal_that_continues_the_committed_ids():
    seen: list = []
    r = proposals(budget=2, seen=seen)
    r.offer(3, [7, 8, 9])
    assert r.next(PROMPT, 8, 6) == [7, 8]  # cut to the budget
    assert r.next(PROMPT + [7], 8, 5) == [8, 9]  # the same proposal's tail, one token on
    assert seen == [(2, 1)]  # the first draft: [7] of [7, 8] was committed before the next ask
    assert r.next(PROMPT + [7, 5], 8, 4) == []  # the engine chose 5: the proposal no longer continues
    r.offer(2, [4])  # older than the one held: ignored
    r.offer(5, [6, 6])
    assert r.next(PROMPT + [7, 5], 8, 4) == [6, 6]


def test_no_draft_when_the_budget_is_zero_and_no_wait_for_a_device_that_does_not_answer():
    r = proposals(budget=0, wait=5.0)
    r.offer(3, [7, 8])
    assert r.next(PROMPT, 8, 6) == []
    r = proposals(wait=0.05)
    began = time.monotonic()
    assert r.next(PROMPT, 8, 6) == [] and r.next(PROMPT + [7], 8, 5) == []  # two misses
    assert r.next(PROMPT + [7, 8], 8, 4) == []  # not waited for after two misses
    assert 0.09 < time.monotonic() - began < 0.5 and r.waited >= 0.09


def test_the_engine_waits_for_the_devices_proposal_after_the_ids_it_was_told():
    r = proposals(wait=5.0)
    threading.Timer(0.05, r.offer, (4, [8, 9])).start()
    began = time.monotonic()
    assert r.next(PROMPT + [7], 8, 5) == [8, 9]
    assert time.monotonic() - began < 2.0
    threading.Timer(0.05, r.offer, (6, [])).start()  # the device declines: the wait ends at once
    began = time.monotonic()
    assert r.next(PROMPT + [7, 8, 9], 8, 3) == []
    assert time.monotonic() - began < 2.0


class Output:
    """What `Stream.take` reads of a vLLM output: here, just its new ids."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens


class Session:
    """A session whose engine outputs the given lists, telling `source` the ids first (as vLLM's
    proposer does) or, where `early` says, other ids."""

    def __init__(self, outputs: list[list[int]], early: list[list[int]] | None = None) -> None:
        self.outputs, self.early, self.aborted = outputs, early, False
        self.handle, self.ended = self, False
        self.error: BaseException | None = None

    def start(self, max_tokens: int, source: DeviceProposals, *, outputs, rule=None):
        generated: list[int] = []
        for i, tokens in enumerate(self.outputs):  # the whole run, queued at once
            source.prepare(PROMPT + (self.early[i] if self.early else generated + tokens))
            generated += tokens
            outputs.put(Output(tokens))
        outputs.put(None)
        return self

    def take(self, out: Output) -> list[int]:
        return out.tokens

    def end(self, done: bool) -> None:
        self.aborted, self.ended = not done, True


def test_the_stream_yields_each_step_once_and_refuses_ids_the_engine_did_not_output():
    session = Session([[7], [8, 9], [0]])
    assert list(follow_engine(session, proposals())) == [[7], [7, 8, 9], [7, 8, 9, 0]]
    assert session.ended and not session.aborted
    bad = Session([[7], [8]], early=[[7], [7, 5]])
    with pytest.raises(RuntimeError, match="disagree"):
        list(follow_engine(bad, proposals()))
    assert bad.aborted  # the request is stopped, not left running


def test_while_the_budget_takes_no_draft_the_stream_reads_the_engine_alone():
    r = proposals(budget=0)
    session = Session([[7], [8, 9]], early=[[1], [1, 1]])  # told nothing: these never arrive
    assert list(follow_engine(session, r)) == [[7], [7, 8, 9]]
    assert not session.aborted
