"""remote/budget.py: the draft budget a server under load gives each session (pure arithmetic)."""

from __future__ import annotations

import pytest

from omnidraft.remote.budget import draft_budget, step_cost

MEMORY_BOUND = {1: 0.020, 2: 0.0201, 4: 0.0202, 8: 0.0205}  # a GPU step: tokens are nearly free
COMPUTE_BOUND = {1: 0.111, 2: 0.171, 4: 0.171, 8: 0.169}  # this CPU's 0.5B on vLLM (docs/vllm.md)


def test_a_memory_bound_engine_takes_long_drafts_even_under_load():
    assert draft_budget(MEMORY_BOUND, 0.8, 1, 16) >= 4
    assert draft_budget(MEMORY_BOUND, 0.8, 16, 16) >= 2


def test_a_compute_bound_engine_under_load_takes_no_draft():
    assert draft_budget(COMPUTE_BOUND, 0.6, 16, 16, tail=16) == 0  # hand the sessions over to its decoding
    assert draft_budget(COMPUTE_BOUND, 0.6, 4, 16, tail=16) == 0


def test_the_recomputed_tail_can_make_drafting_lose_to_decoding_alone():
    assert (
        draft_budget(COMPUTE_BOUND, 0.6, 1, 16, tail=0)
        > 0
        == draft_budget(COMPUTE_BOUND, 0.6, 1, 16, tail=16)
    )


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="sessions >= 1"):
        draft_budget(MEMORY_BOUND, 0.5, 0, 4)
    with pytest.raises(ValueError, match="positive cost for one token"):
        step_cost({2: 0.1})
