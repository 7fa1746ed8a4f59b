"""Recorded target traces replay the engine exactly (tokens and acceptance), with drafter forwards only."""

from __future__ import annotations

import pytest
import torch

from omnidraft.distill.trace_store import ReplayTarget, load_traces, record, record_many, save_traces
from omnidraft.errors import CorruptFileError, IncompatibleError

from .conftest import gsm8k_texts

PROMPTS = [t[:70] for t in gsm8k_texts("test", 3)]


def test_replay_gives_the_live_tokens_and_acceptance(tiny_drafter, tiny_target, tmp_path):
    traces = [record(tiny_target, p, 30, k=8) for p in PROMPTS]
    path = tmp_path / "traces.safetensors"
    save_traces(path, traces, tiny_target.token_bytes.fingerprint)
    replay = ReplayTarget.like(tiny_target, load_traces(path, tiny_target.token_bytes.fingerprint))
    for prompt in PROMPTS:
        live = tiny_drafter.pair(tiny_target, k=4).generate(prompt, max_new_tokens=30)
        again = tiny_drafter.pair(replay, k=4).generate(prompt, max_new_tokens=30)
        assert again.token_ids == live.token_ids
        assert [(r.proposed, r.accepted) for r in again.rounds] == [
            (r.proposed, r.accepted) for r in live.rounds
        ]


def test_topk_rows_are_the_targets_distribution(tiny_target):
    t = record(tiny_target, PROMPTS[0], 5, k=4)
    assert t.topk_ids.shape == (5, 4) and torch.all(t.topk_logp <= 0)
    assert t.topk_ids[:, 0].tolist() == t.continuation  # greedy: the top-1 is what was generated


def test_foreign_or_corrupt_trace_files_are_refused(tiny_target, tmp_path):
    path = tmp_path / "t.safetensors"
    save_traces(path, [record(tiny_target, PROMPTS[0], 3, k=2)], "abc")
    with pytest.raises(IncompatibleError, match="recorded for target tokenizer"):
        load_traces(path, "xyz")
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CorruptFileError, match="not a readable omnidraft trace file"):
        load_traces(path)


def test_batched_recording_matches_one_prompt_at_a_time(tiny_target):
    prompts = [
        t[: 40 + 15 * i] for i, t in enumerate(gsm8k_texts("test", 5))
    ]  # unequal lengths: left padding
    single = [record(tiny_target, p, 12, k=4) for p in prompts]
    batched = record_many(tiny_target, prompts, 12, k=4, batch_size=3)
    for a, b in zip(single, batched):
        assert a.prompt_ids == b.prompt_ids and a.continuation == b.continuation
        assert torch.equal(a.topk_ids, b.topk_ids) and torch.allclose(a.topk_logp, b.topk_logp, atol=1e-3)


def test_replayed_verdicts_carry_the_recorded_rows(tiny_drafter, tiny_target):
    trace = record(tiny_target, PROMPTS[1], 10, k=4)
    session = ReplayTarget.like(tiny_target, [trace]).begin(trace.prompt_ids)
    from omnidraft.target import Rule

    verdict = session.verify(torch.tensor(trace.continuation[:3]), Rule(), topk=2)
    assert verdict.accepted == 3 and torch.equal(verdict.topk[0], trace.topk_ids[:4, :2])
    with pytest.raises(ValueError, match="top-4"):
        session.verify(torch.tensor([1]), Rule(), topk=8)
