"""The retrieval index: suffix automaton and matcher against naive search, the datastore's bounds."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnidraft.errors import CorruptFileError, IncompatibleError
from omnidraft.retrieve import (
    Candidate,
    ContextIndex,
    Datastore,
    Matcher,
    RetrievalConfig,
    RetrievalStats,
    SuffixAutomaton,
)


def naive_match(text: list[int], stream: list[int]) -> int:
    """Length of the longest suffix of `stream` that occurs in `text`."""
    for n in range(len(stream), 0, -1):
        s = stream[-n:]
        if any(text[i : i + n] == s for i in range(len(text) - n + 1)):
            return n
    return 0


def first_end(text: list[int], pattern: list[int]) -> int:
    n = len(pattern)
    return next(i + n for i in range(len(text) - n + 1) if text[i : i + n] == pattern)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.integers(0, 4), max_size=30))
def test_matcher_agrees_with_naive_search(text, stream):
    sam = SuffixAutomaton(text)
    m = Matcher()
    for i, token in enumerate(stream):
        m = m.advance(sam, token)
        assert m.length == naive_match(text, stream[: i + 1])
        if m.length:
            pattern = stream[i + 1 - m.length : i + 1]
            assert m.end(sam) == first_end(text, pattern)
            assert m.continuation(sam, 5) == text[m.end(sam) : m.end(sam) + 5]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=80))
def test_self_index_matches_earlier_occurrences(stream):
    """A request's own index: after each token, the longest suffix found *before* that token."""
    index = ContextIndex([])
    for i, token in enumerate(stream):
        index.commit([token])
        assert index.here.length == naive_match(stream[:i], stream[: i + 1])
        cands = index.candidates(4)
        if index.here.length:
            end = first_end(stream[:i], stream[i + 1 - index.here.length : i + 1])
            assert cands[0].ids == stream[: i + 1][end : end + 4]


def test_automaton_is_linear_on_real_token_streams():
    from omnidraft.bench.datasets import load_references

    rng = random.Random(0)
    streams = [[ord(c) for c in a] for _, a in load_references("humaneval", 20)]
    streams.append([rng.randrange(50) for _ in range(5000)])
    for tokens in streams:
        sam = SuffixAutomaton(tokens)
        n = len(tokens)
        assert sam.states <= max(2 * n - 1, 1)
        assert sam.transitions <= max(3 * n - 4, n)
        for _ in range(30):  # and it finds what is there
            a = rng.randrange(n)
            assert sam.occurs(tokens[a : a + rng.randrange(1, 12)])


def test_ahead_matches_a_draft_without_committing_it():
    index = ContextIndex([1, 2, 3, 4, 5, 9, 1, 2])
    assert index.candidates(3)[0] == Candidate([3, 4, 5], "context", 2)
    assert index.candidates(2, ahead=[3])[0] == Candidate([4, 5], "context", 3)
    assert index.here.length == 2  # unchanged


def test_datastore_never_exceeds_its_cap_and_round_trips():
    store = Datastore(50, fingerprint="fp")
    rng = random.Random(1)
    for _ in range(40):
        store.add([rng.randrange(20) for _ in range(rng.randrange(1, 30))])
        assert len(store) <= 50 and sum(map(len, store.docs)) == len(store)
        assert len(store.sam) == len(store) + len(store.docs) - 1  # documents and separators
    again = Datastore.from_doc(store.to_doc(), where="t", fingerprint="fp")
    assert list(again.docs) == list(store.docs)
    with pytest.raises(IncompatibleError, match="another target tokenizer"):
        Datastore.from_doc(store.to_doc(), where="t", fingerprint="other")
    with pytest.raises(CorruptFileError, match="not an omnidraft datastore"):
        Datastore.from_doc({"docs": []}, where="t", fingerprint="fp")
    with pytest.raises(ValueError, match="cap"):
        Datastore(0)


def test_history_continuations_stop_at_a_document_end():
    store = Datastore(100)
    store.add([7, 8, 9])
    store.add([1, 2, 3, 4])
    index = ContextIndex([5, 7, 8], store)
    (hist,) = [c for c in index.candidates(5) if c.source == "history"]
    assert hist == Candidate([9], "history", 2)


def test_stats_rank_candidates_by_their_history():
    stats = RetrievalStats(RetrievalConfig(min_match=2))
    a, b = Candidate([1] * 8, "context", 5), Candidate([2] * 8, "history", 5)
    for _ in range(10):
        stats.observe("context", 5, 8, 0)
        stats.observe("history", 5, 8, 8)

    class Cost:
        other = 0.0

        def verify_cost(self, m):
            return 1.0 + 0.1 * m

    cand, m, _ = stats.best([a, b], Cost())
    assert cand is b and m == 8
    assert stats.best([Candidate([1], "context", 1)], None) is None  # under min_match, no costs: no retrieval


def test_a_kind_of_match_that_failed_is_probed_again_and_fresh_requests_forgive():
    stats = RetrievalStats(RetrievalConfig(probe_every=3))
    c = Candidate([1] * 8, "context", 5)
    for _ in range(6):
        stats.observe("context", 5, 8, 0)
    low = stats.acceptance("context", 5)[0]
    assert low < 0.3
    assert [stats.turned_down(c) for _ in range(3)] == [False, False, True]
    stats.observe("context", 5, 8, 8)
    assert not stats.turned_down(c)  # a trial resets the wait
    stats.refresh()
    assert stats.acceptance("context", 5)[0] > stats.acceptance("context", 5)[0] * 0 + low


def test_beside_model_drafts_a_short_match_is_left_to_the_model():
    """Measured costs favour retrieving a one-token match, yet with model drafts beside it the
    round drafts with the model (which a source may extend); retrieval alone, or a round the
    model does not draft, takes the match."""
    from omnidraft.retrieve.retriever import Retriever

    class Cost:
        other, verify = 0.0, {1: 1.0, 2: 1.0}

        def verify_cost(self, m):
            return 1.0

    config = RetrievalConfig(min_match=3)
    index = ContextIndex([1, 2, 9, 1, 2, 7, 5, 1])  # the context ends in 1: match of one token
    assert Retriever(config).plan(index, Cost(), {1: 0.1}, limit=8) is None
    for used in (
        Retriever(config, model=False).plan(index, Cost(), {}, limit=8),
        Retriever(config).plan(index, Cost(), {0: 0.1, 1: 0.1}, limit=8, drafting=False),
    ):  # a round without a model draft
        assert used is not None and used.candidate.match == 1


def test_without_a_model_draft_this_round_a_retrieved_draft_competes_with_the_target_alone():
    """A match whose rate falls short of the model's best draft but beats a plain round is used
    when the round has no model draft (the drafter's read deferred, or no draft paying)."""
    from omnidraft.retrieve.retriever import Retriever

    class Cost:
        other, verify = 0.0, {1: 1.0, 2: 1.0}

        def verify_cost(self, m):
            return 1.0

    index = ContextIndex([1, 2, 3, 4, 9, 1, 2, 3, 4])  # a four-token match
    rates = {0: 1.0, 6: 100.0}  # the model's best draft is far faster than any retrieval here
    retriever = Retriever(RetrievalConfig(min_match=3))
    assert retriever.plan(index, Cost(), rates, limit=8) is None
    used = retriever.plan(index, Cost(), rates, limit=8, drafting=False)
    assert used is not None and used.candidate.match == 4
