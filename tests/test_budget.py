"""server/budget.py: the draft budget a server under load gives each session (pure arithmetic)."""

from __future__ import annotations

import pytest

from omnidraft.server.budget import DraftGate, draft_budget, step_seconds

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


def test_a_batch_that_turns_compute_bound_takes_short_drafts_or_none():
    """In-engine verification (no tail): one sequence's drafted tokens are nearly free, but steps
    over many rows pay for every token (this CPU's 0.5B on vLLM): the budget reads both."""
    one = {1: 0.139, 4: 0.146, 8: 0.16}  # one sequence, drafts verified in the step
    batched = {**one, 16: 0.24, 64: 0.62, 128: 1.0}  # 16 rows of 1, 4 and 8 tokens
    assert draft_budget(one, 0.5, 1, 16) == draft_budget(batched, 0.5, 1, 16) > 0  # one session: draft
    assert draft_budget(one, 0.5, 16, 16) > 0  # one sequence's costs alone would draft under load
    assert draft_budget(batched, 0.5, 16, 16) == 0  # the batch's say no
    assert step_seconds(batched, 32) == pytest.approx(0.24 + 0.38 / 3)
    assert step_seconds(batched, 256) == pytest.approx(1.0 + (1.0 - 0.139) / 127 * 128)  # the steeper line


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="sessions >= 1"):
        draft_budget(MEMORY_BOUND, 0.5, 0, 4)
    with pytest.raises(ValueError, match="positive cost for one token"):
        step_seconds({2: 0.1}, 4)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_window(gate: DraftGate, clock: Clock, load: int, rate_on: float, rate_off: float) -> bool:
    """One window of the gate at `load`: tokens committed at the rate of its mode; its mode."""
    on = gate.allow(load, True)
    for _ in range(8):  # eighths: exact in binary, so the window ends on its last tick
        clock.now += gate.window_s / 8
        gate.count(round((rate_on if on else rate_off) * gate.window_s / 8))
    return on


def test_the_gate_learns_both_modes_then_keeps_the_faster_and_explores_the_other():
    clock = Clock()
    gate = DraftGate(window_s=1.0, explore=5, clock=clock)
    modes = [run_window(gate, clock, 16, rate_on=48, rate_off=56) for _ in range(22)]
    assert modes[:2] == [True, False]  # learnt: drafting first, then none
    # the faster (off); drafting tried after five windows, then (it confirmed off) after ten
    assert [i for i, on in enumerate(modes) if on][1:] == [6, 16] and modes[-1] is False
    assert gate.rate(16, False) == pytest.approx(56) and gate.rate(16, True) == pytest.approx(48)
    far = DraftGate(window_s=1.0, explore=5, clock=clock)
    modes = [run_window(far, clock, 16, rate_on=88, rate_off=56) for _ in range(22)]
    assert modes.count(False) == 1 + 1  # learnt once, then explored once in twenty windows (1.5x apart)


def test_the_gate_learns_nothing_from_a_changing_load_a_small_one_or_a_budget_of_zero():
    clock = Clock()
    gate = DraftGate(window_s=1.0, clock=clock)
    for load in (4, 5, 6, 7):  # the load moved before each window ended
        gate.allow(load, True)
        gate.count(30)
        clock.now += 0.5
    assert gate.rates == {}
    assert all(gate.allow(2, True) for _ in range(3))  # below min_load the budget stands
    for _ in range(3):
        assert gate.allow(8, False)  # the budget wanted no draft: nothing to measure
        gate.count(10)
        clock.now += 1.0
    assert gate.rates == {}
    with pytest.raises(ValueError, match="explore"):
        DraftGate(explore=1)


def test_a_load_the_gate_has_not_compared_follows_the_nearest_one_it_has():
    clock = Clock()
    gate = DraftGate(window_s=1.0, explore=5, clock=clock)
    assert [run_window(gate, clock, 16, rate_on=30, rate_off=60) for _ in range(3)] == [True, False, False]
    modes = [run_window(gate, clock, n, rate_on=30, rate_off=60) for n in (15, 15, 14, 14, 13, 13, 12, 12)]
    assert modes.count(True) <= 1  # no load relearns drafting first; one window may explore it
    # a load far from every compared one learns for itself: drafting first, then none
    assert [run_window(gate, clock, 4, rate_on=50, rate_off=30) for _ in range(3)][:2] == [True, False]
