"""Retrieval drafts in the pairing loop (tiny models): lossless in every mode, sources recorded,
no drafter forward in retrieval-only rounds, the user's datastore kept in the profile."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import omnidraft as od
from omnidraft.errors import IncompatibleError
from omnidraft.retrieve import Datastore, RetrievalConfig
from omnidraft.retrieve.retriever import NO_READ, ReadDeferral

from .conftest import assert_first_tokens_follow, gsm8k_texts, target_greedy, tiny_llama, train_bpe

COPY = [
    "The cat sat on the mat. The dog sat on the log. The cat sat on the",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return",
    gsm8k_texts("test", 1)[0][:120] * 2,
]


@pytest.mark.parametrize("drafts", ["hybrid", "retrieval", "model"])
@pytest.mark.parametrize("k", [None, 3])
def test_greedy_output_is_the_targets_own_whatever_drafts(tiny_drafter, tiny_target, drafts, k):
    # "compute": every request speculates, so retrieved drafts run whatever a tiny model's costs
    # say (the latency objective's floor may stand aside on them: tests/test_floor.py)
    pair = tiny_drafter.pair(tiny_target, k=k, drafts=drafts, objective="compute")
    retrieved = 0
    for prompt in COPY:
        out = pair.generate(prompt, max_new_tokens=40)
        assert out.token_ids == target_greedy(tiny_target, prompt, 40), prompt
        retrieved += sum(r.retrieved_accepted for r in out.rounds)
        assert all(r.retrieved <= r.proposed and r.retrieved_accepted <= r.retrieved for r in out.rounds)
        if drafts == "model":
            assert all(r.retrieved == 0 for r in out.rounds)
        if drafts == "retrieval":
            assert all(r.drafted == 0 for r in out.rounds)
    if drafts != "model":
        assert retrieved > 0  # a tiny random model repeats itself: its own output is there to copy
        assert out.stats.acceptance_by_source is not None


class _NoForward:
    """A drafter whose sessions must never draft."""

    def __init__(self, drafter):
        self.inner = drafter
        for name in ("name", "tokenizer", "token_bytes", "codec"):
            setattr(self, name, getattr(drafter, name))

    def begin(self, ids):
        session = self.inner.begin(ids)
        session.propose = lambda *a, **k: pytest.fail("retrieval-only drafts called the drafter")
        return session


def test_retrieval_only_never_runs_the_drafter(tiny_drafter, tiny_target):
    pair = od.Pairing(_NoForward(tiny_drafter), tiny_target, od.DecodeConfig(drafts="retrieval"))
    for prompt in COPY:
        assert pair.generate(prompt, max_new_tokens=30).token_ids == target_greedy(tiny_target, prompt, 30)


def test_the_drafters_read_is_deferred_until_the_rounds_without_it_have_lost_what_it_costs():
    deferral = ReadDeferral()
    rates = {0: 10.0, 4: 20.0}  # the target alone: 0.1 s a token; drafting: 0.05
    assert not deferral.begin(100).defer(rates, 0)  # nothing measured yet: draft as ever
    deferral.per_token = 0.001  # reading 100 tokens: 0.1 s
    read = deferral.begin(100)
    assert not read.defer({}, 0)  # the cost policy has no rates yet
    assert read.defer(rates, 0)
    read.settle(
        True, committed=1, seconds=None, drafted=0, draft_s=0.0, step=0.01, produced=0
    )  # the prefill round
    assert read.regret == 0
    for _ in range(2):  # two plain rounds lose 0.05 s each: the read is paid for after them
        assert read.defer(rates, 0)
        read.settle(True, committed=1, seconds=0.1, drafted=0, draft_s=0.0, step=0.01, produced=0)
    assert read.regret == pytest.approx(0.1) and not read.defer(rates, 0)
    again = deferral.begin(100)
    assert again.defer(rates, 0)
    again.settle(
        True, committed=5, seconds=0.1, drafted=0, draft_s=0.0, step=0.01, produced=0
    )  # a copy beat the model
    assert again.regret == 0 and again.defer(rates, 20)  # no credit below zero; the read grows with the text
    again.settle(
        True, committed=2, seconds=0.2, drafted=0, draft_s=0.0, step=0.01, produced=20
    )  # a poor copy loses too
    assert again.regret == pytest.approx(0.1)
    again.settle(
        False, committed=4, seconds=0.5, drafted=4, draft_s=0.44, step=0.01, produced=20
    )  # 120 tokens read
    assert deferral.per_token == pytest.approx(
        0.7 * 0.001 + 0.3 * 0.4 / 120
    )  # slower than measured: slowly up
    cheap = deferral.begin(100)
    cheap.settle(False, committed=4, seconds=0.2, drafted=4, draft_s=0.14, step=0.01, produced=0)
    assert deferral.per_token == pytest.approx(0.001)  # faster: at once
    assert again.unread == 0 and not again.defer(rates, 30)  # read once: drafts as the policy says
    slow = deferral.begin(100)  # drafting slower than the target alone: a plain round loses nothing
    for _ in range(50):
        assert slow.defer({0: 10.0, 4: 5.0}, 0)
        slow.settle(True, committed=1, seconds=0.1, drafted=0, draft_s=0.0, step=0.01, produced=0)
    assert not NO_READ.defer(rates, 0)


class _CountingDrafter(_NoForward):
    def begin(self, ids):
        session = self.inner.begin(ids)
        propose = session.propose

        def counted(*a, **k):
            self.proposals += 1
            return propose(*a, **k)

        session.propose = counted
        return session


def test_a_request_whose_read_is_deferred_never_drafts_and_stays_identical(tiny_drafter, tiny_target):
    drafter = _CountingDrafter(tiny_drafter)
    drafter.proposals = 0
    config = od.DecodeConfig(drafts="hybrid", retrieval=RetrievalConfig(defer_read=True), objective="compute")
    pair = od.Pairing(drafter, tiny_target, config)
    for prompt in COPY:  # the costs and the read are measured
        pair.generate(prompt, max_new_tokens=30)
    assert pair.speculator.retriever.deferral.per_token is not None and drafter.proposals > 0
    assert 0 in pair.policy.last_rates
    pair.speculator.retriever.deferral.per_token = 1e9  # a read no plain round can make up for
    drafter.proposals = 0
    for prompt in COPY:
        assert pair.generate(prompt, max_new_tokens=30).token_ids == target_greedy(tiny_target, prompt, 30)
    assert drafter.proposals == 0
    pair.speculator.retriever.deferral.per_token = 0.0  # a free read: drafted as before
    for prompt in COPY:
        assert pair.generate(prompt, max_new_tokens=30).token_ids == target_greedy(tiny_target, prompt, 30)
    assert drafter.proposals > 0
    assert (
        tiny_drafter.pair(tiny_target, drafts="hybrid").speculator.retriever.deferral is not None
    )  # on by default
    at_once = RetrievalConfig(defer_read=False)
    assert (
        tiny_drafter.pair(tiny_target, drafts="hybrid", retrieval=at_once).speculator.retriever.deferral
        is None
    )


def test_a_bad_drafts_value_is_refused():
    with pytest.raises(ValueError, match="drafts must be one of"):
        od.DecodeConfig(drafts="retrieved")
    with pytest.raises(ValueError, match="max_len"):
        RetrievalConfig(max_len=0)


@pytest.mark.parametrize("mode", ["match", "exact"])
@pytest.mark.parametrize("drafts", ["retrieval", "hybrid"])
def test_sampling_with_retrieved_drafts_keeps_the_target_distribution(mode, drafts):
    """First token over 1,200 generations from a prompt whose end is found earlier in it, so the
    first round proposes a retrieved continuation; chi-square against the target's softmax."""
    tok_d, tok_t = train_bpe(300, gsm8k_texts(n=300)), train_bpe(330, gsm8k_texts(n=300))
    target = od.LocalTarget(tiny_llama(len(tok_t), seed=5, logit_scale=8.0), tok_t, "t")
    drafter = od.TorchDrafter(tiny_llama(len(tok_d), seed=5, logit_scale=8.0), tok_d, "d")
    pair = drafter.pair(
        target, k=3, mode=mode, temperature=1.0, drafts=drafts, retrieval=RetrievalConfig(min_match=2)
    )
    gen = torch.Generator().manual_seed(13)
    prompt = "Question: how many apples are there? Question: how many"
    n, counts, retrieved_first = 1200, Counter(), 0
    for _ in range(n):
        out = pair.generate(prompt, max_new_tokens=2, generator=gen)
        counts[out.token_ids[0]] += 1
        retrieved_first += out.rounds[0].retrieved > 0
    assert retrieved_first > n // 2
    assert_first_tokens_follow(target, prompt, counts)


def test_the_users_past_outputs_are_drafts_and_live_in_the_profile(tiny_drafter, tiny_target, tmp_path):
    store = od.ProfileStore(tmp_path)
    pair = tiny_drafter.pair(tiny_target, user="ann", store=store, drafts="retrieval", objective="compute")
    first = pair.generate(COPY[0], max_new_tokens=30)
    assert list(pair.speculator.retriever.history.docs) == [first.token_ids]
    pair.save()
    again = tiny_drafter.pair(tiny_target, user="ann", store=store, drafts="retrieval", objective="compute")
    assert list(again.speculator.retriever.history.docs) == [first.token_ids]
    # the same request again: its whole output is in the user's history now
    second = again.generate(COPY[0], max_new_tokens=30)
    assert second.token_ids == first.token_ids
    assert sum(r.retrieved_accepted for r in second.rounds) > sum(r.retrieved_accepted for r in first.rounds)
    # no user, no history: nothing is remembered between requests
    assert tiny_drafter.pair(tiny_target, drafts="retrieval").speculator.retriever.history is None


def test_a_datastore_of_another_tokenizer_is_refused(tiny_drafter, tiny_target, tmp_path):
    store = od.ProfileStore(tmp_path)
    pair = tiny_drafter.pair(tiny_target, user="bo", store=store)
    pair.speculator.retriever.history = Datastore(fingerprint="another")
    pair.speculator.retriever.history.add([1, 2, 3])
    pair.save()
    with pytest.raises(IncompatibleError, match="another target tokenizer"):
        tiny_drafter.pair(tiny_target, user="bo", store=store)


def test_relaxed_verification_is_its_own_lossy_mode(tiny_drafter, tiny_target):
    """It cannot be switched on by accident: only mode="relaxed-lossy" relaxes, never with model
    drafts only, and every lossless mode stays identical to the target's greedy output."""
    assert not od.DecodeConfig().lossy and od.DecodeConfig(mode="relaxed-lossy").lossy
    assert od.DecodeConfig(mode="relaxed-lossy").rule == od.Rule()  # the target's rule stays greedy
    with pytest.raises(ValueError, match="relaxes retrieved drafts only"):
        od.DecodeConfig(mode="relaxed-lossy", drafts="model")
    with pytest.raises(ValueError, match="relaxed_top_r"):
        od.DecodeConfig(mode="relaxed-lossy", relaxed_top_r=1)
    with pytest.raises(ValueError, match="verification mode"):
        od.DecodeConfig(mode="relaxed")
    pair = tiny_drafter.pair(tiny_target, mode="relaxed-lossy")
    for prompt in COPY:
        out = pair.generate(prompt, max_new_tokens=30)
        assert len(out.token_ids) == 30


def test_relaxed_rule_accepts_a_near_miss_copy_only_when_the_target_carries_it_on():
    from omnidraft.decode.verify import greedy, relaxed

    logits = torch.full((4, 10), -5.0)
    logits[0, 1], logits[0, 2] = 3.0, 2.9  # position 0: argmax 1, proposal 2 is second
    logits[1, 3] = 3.0  # after it the target continues with 3, as proposed
    logits[2, 7] = 3.0
    logits[3, 0] = 3.0
    proposal = torch.tensor([2, 3, 4])
    retrieved = torch.tensor([True, True, True])
    assert greedy(logits, proposal).accepted == 0
    v = relaxed(logits, proposal, retrieved, top_r=2)
    assert (v.accepted, v.token) == (2, 7)  # 2 (near miss, carried on), 3 (argmax); 4 is not in the top 2
    assert (
        relaxed(logits, proposal, torch.tensor([False, True, True]), top_r=2).accepted == 0
    )  # a model token: strict
    assert relaxed(logits, proposal, retrieved, top_r=1).accepted == 0
    off = logits.clone()
    off[1, 3], off[1, 5] = -5.0, 3.0  # the target does not carry the copy on: rejected
    assert relaxed(off, proposal, retrieved, top_r=2).accepted == 0


def test_rouge_l():
    from omnidraft.bench.runner import rouge_l

    assert rouge_l([1, 2, 3], [1, 2, 3]) == 1.0
    assert rouge_l([1, 2, 3, 4], [1, 3, 4, 5]) == pytest.approx(0.75)
    assert rouge_l([], [1]) == 0.0


def test_relaxed_verification_refuses_a_remote_target(tiny_drafter):
    class Remote(od.TargetBase):  # declares nothing: not in process
        name, tokenizer, token_bytes, codec, eos_ids = "remote", None, None, None, frozenset()

        def begin(self, ids):
            raise AssertionError("never begun")

    with pytest.raises(ValueError, match="needs an in-process target"):
        od.Pairing(tiny_drafter, Remote(), od.DecodeConfig(mode="relaxed-lossy"))
