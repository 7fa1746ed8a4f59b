"""The floor (omnidraft/adaptive/floor.py): a request is never slower than its target alone beyond the
share `explore`, whatever its drafts do. Simulated requests on declared cost curves (no clock), and
the round loop's path when the floor stands aside, on tiny in-test models."""

from __future__ import annotations

import time

import pytest

import omnidraft as od
from omnidraft.adaptive.costs import CostModel
from omnidraft.adaptive.floor import Floor, FloorKnobs, Ledger

from .conftest import gsm8k_texts, target_greedy
from .fakes import OracleDrafter

STEP = 0.024  # seconds a token alone, llama.cpp-like
COMPUTE_BOUND = {m: STEP * (1 + 0.9 * (m - 1)) for m in range(1, 10)}  # verifying m costs ~m steps
FLAT = {m: STEP * (1 + 0.05 * (m - 1)) for m in range(1, 10)}  # verifying m costs ~one step


def simulate(
    curve: dict[int, float], accept: float, n: int = 128, draft: float = 0.2 * STEP, ends: int | None = None
):
    """One request of at most `n` tokens under the floor (a reply that ends, by its EOS, after `ends`
    of them: the floor cannot know that beforehand): each round drafts 4 tokens (at `draft` seconds
    each) of which the first `accept` share is accepted; where the floor stands aside, the target
    decodes `aside` tokens at STEP. Returns (seconds, seconds alone, rounds that drafted)."""
    cost = CostModel(verify=curve)
    cost.observe(4, 4 * draft, 5, curve[5])
    ledger = Floor().begin(STEP)
    produced, seconds, drafted = 0, 0.0, 0
    n_out = n if ends is None else ends
    while produced < n_out:
        remaining = n - produced
        k, m = ledger.cap(cost, 4, min(4, remaining - 1), remaining)
        if ledger.aside or m == 0:
            got = min(Floor().knobs.aside, remaining, n_out - produced)
            ledger.alone(got, got * STEP)
            produced, seconds = produced + got, seconds + got * STEP
            continue
        took = k * draft + cost.verify_cost(m + 1)
        committed = min(remaining, 1 + int(accept * m), n_out - produced)
        ledger.book(committed, took, True)
        produced, seconds, drafted = produced + committed, seconds + took, drafted + 1
    return seconds, n_out * STEP, drafted


@pytest.mark.parametrize("accept", [0.0, 0.25, 0.5])
def test_drafts_that_lose_cost_at_most_the_exploring_share(accept):
    seconds, alone, drafted = simulate(COMPUTE_BOUND, accept)
    assert seconds <= alone * (1 + FloorKnobs().explore) + 1e-9
    assert drafted <= 3  # it stood aside as soon as the balance was spent


@pytest.mark.parametrize("ends", [3, 16, 21, 40])
def test_a_reply_that_ends_early_loses_at_most_the_share_of_its_own_time(ends):
    """The allowance is counted over the tokens produced so far, not over `max_new_tokens`: a reply
    whose EOS comes early loses no more than `explore` of its own time alone (of `horizon` tokens,
    for one shorter than that)."""
    knobs = FloorKnobs()
    assert knobs.horizon <= 16  # (counted over 128 tokens, a 21-token reply read 0.84x)
    seconds, alone, _ = simulate(COMPUTE_BOUND, 0.0, ends=ends)
    assert seconds <= alone + knobs.explore * STEP * max(ends, knobs.horizon) + 1e-9


def test_the_targets_read_of_the_prompt_counts_in_the_allowance():
    """Where the session times its read of the prompt, that read is part of the request's time alone,
    so a long prompt lets the first rounds explore more."""
    ledger = Floor().begin(STEP)
    bare = ledger.allowance(100)
    ledger.prefill = 40 * STEP
    assert ledger.allowance(100) == pytest.approx(bare + FloorKnobs().explore * 40 * STEP)


def test_drafts_that_pay_are_not_capped():
    seconds, alone, drafted = simulate(FLAT, 1.0)
    assert drafted == 128 // 5 + 1 and seconds < 0.45 * alone


def test_a_losing_request_halves_the_next_ones_allowance_a_paying_one_restores_it():
    """...and one that drafted nothing doubles it back: a few losing requests in a row must not
    end drafting for every later request (the allowance would cover no draft, so no request would
    draft and pay to restore it)."""
    floor = Floor()
    lost = floor.begin(STEP)
    lost.book(1, 3 * STEP, True)
    floor.end(lost)
    assert floor.scale == 0.5 and floor.begin(STEP).explore == pytest.approx(FloorKnobs().explore / 2)
    for _ in range(10):
        floor.end(lost)
    assert floor.scale == FloorKnobs().least
    idle = floor.begin(STEP)
    idle.book(1, STEP, False)
    floor.end(idle)
    assert floor.scale == 2 * FloorKnobs().least
    for _ in range(10):
        floor.end(idle)
    assert floor.scale == 1.0
    floor.end(lost)
    paid = floor.begin(STEP)
    paid.book(5, 1.2 * STEP, True)
    floor.end(paid)
    assert floor.scale == 1.0


def test_the_step_measured_decoding_alone_is_kept_for_the_next_request():
    floor = Floor()
    ledger = floor.begin(STEP)
    ledger.alone(16, 16 * 0.03)
    ledger.seen(STEP)  # the cost model's estimate does not override what decoding alone measured
    floor.end(ledger)
    assert ledger.step == pytest.approx(0.03) and floor.begin(STEP).step == pytest.approx(0.03)


def test_a_round_in_a_slow_stretch_is_booked_against_the_least_recent_step():
    """docs/openvino.md: a request's stretches alone measured its step at 57 to 95 ms; booked against
    the last one, rounds in a slow stretch booked gains a quieter step would not have given. The
    least of the last `recent` (3) stretches is booked; a step that stays up (a longer context)
    is taken once it has for as many stretches."""
    ledger = Floor().begin(0.057)
    ledger.alone(16, 16 * 0.057)
    ledger.alone(16, 16 * 0.095)
    assert ledger.step == pytest.approx(0.057)
    ledger.book(2, 0.150, True)  # two tokens in 150 ms: a loss against 57 ms a token, not a gain
    assert ledger.saved == pytest.approx(2 * 0.057 - 0.150) and ledger.drafted < 0
    ledger.alone(16, 16 * 0.095)
    ledger.alone(16, 16 * 0.095)
    assert ledger.step == pytest.approx(0.095)


def test_a_model_draft_that_must_first_read_the_prompt_waits_retrieved_tokens_do_not():
    """The drafter's read of tokens it has not seen (a long prompt) counts in a model draft's worst
    case; a retrieved proposal needs no drafter forward, so the balance still covers it."""
    floor, cost = Floor(), CostModel(verify=FLAT)
    cost.observe(4, 4 * 0.2 * STEP, 5, FLAT[5])
    first = floor.begin(STEP, unread=250)
    floor.read_prompt(first, 250, 250 * 0.5 * STEP)  # read at half a step a token, charged
    assert first.saved == pytest.approx(-125 * STEP) and floor.read == pytest.approx(0.5 * STEP)
    second = floor.begin(STEP, unread=250)
    assert second.cap(cost, 4, 4, 128) == (0, 4) and not second.aside  # retrieved tokens only
    second.book(3, 0.5 * STEP, True, drafted=False)  # retrieved tokens that paid
    assert second.unread == 253
    second.unread = 2  # caught up but two tokens
    assert second.cap(cost, 4, 4, 128) == (4, 4)


def test_without_a_measured_step_nothing_is_capped():
    ledger = Ledger(FloorKnobs(), 0.02, None)
    assert ledger.cap(CostModel(verify=COMPUTE_BOUND), 6, 6, 100) == (6, 6) and not ledger.aside


@pytest.mark.parametrize(
    "knobs",
    [dict(explore=1.0), dict(explore=-0.1), dict(horizon=0), dict(aside=0), dict(least=0.0), dict(recent=0)],
)
def test_bad_knobs_are_refused_naming_the_field(knobs):
    with pytest.raises(ValueError, match=next(iter(knobs))):
        FloorKnobs(**knobs)


class _Aside(Ledger):
    """A ledger whose balance never covers a draft after the first round."""

    def cap(self, costs, k, limit, remaining):
        self.aside = limit > 0
        return (0, 0) if self.aside else (k, limit)


def test_standing_aside_decodes_stretches_alone_and_keeps_the_targets_output(
    tiny_drafter, tiny_target, monkeypatch
):
    prompt = gsm8k_texts("test", 1)[0][:80]
    ref = target_greedy(tiny_target, prompt, 40)
    pair = od.Pairing(
        OracleDrafter(tiny_target, ref), tiny_target, od.DecodeConfig(k=5, strategy="ngram", drafts="model")
    )
    monkeypatch.setattr(
        pair.speculator.floor, "begin", lambda step, unread=0: _Aside(FloorKnobs(aside=8), 0.02, STEP)
    )
    out = pair.generate(prompt, max_new_tokens=40)
    assert out.token_ids == ref
    assert [r.proposed for r in out.rounds] == [0] * 40  # decoded alone, one record a token
    again = pair.generate(prompt, max_new_tokens=40)  # the proposer followed the text decoded alone
    assert again.token_ids == ref


class _SlowPrompt:
    """A target session whose first call reads the prompt slowly (`read` seconds more), timing that
    read apart as `prefill_s` where `timed`, as an OpenVINO session does, or not at all."""

    def __init__(self, inner, read: float, timed: bool) -> None:
        self.inner, self.read, self.timed, self.first = inner, read, timed, True
        self.prefill_s = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _reading(self, call):
        if not self.first:
            return call()
        started, self.first = time.perf_counter(), False
        time.sleep(self.read)
        out = call()
        if self.timed:
            self.prefill_s = time.perf_counter() - started
        return out

    def verify(self, *args, **kwargs):
        return self._reading(lambda: self.inner.verify(*args, **kwargs))

    def decode(self, max_tokens):
        tokens = self.inner.decode(max_tokens)
        yield self._reading(lambda: next(tokens))
        yield from tokens


@pytest.mark.parametrize("timed", [False, True])
def test_the_prompts_read_is_never_taken_for_the_targets_step(tiny_drafter, tiny_target, monkeypatch, timed):
    """A request whose first stretch decodes alone from the prompt (no step known yet, or a server
    that takes no draft) measures the step without the prompt's read (it made a 627-token summary's
    step 105 ms where it was 27, and the floor then let every later request's drafts lose); where
    the session times its read apart, the first stretch's other tokens measure it."""
    prompt = gsm8k_texts("test", 1)[0][:80]
    ref = target_greedy(tiny_target, prompt, 40)
    pair = od.Pairing(
        OracleDrafter(tiny_target, ref), tiny_target, od.DecodeConfig(k=5, strategy="ngram", drafts="model")
    )
    ledgers = []

    def begin(step, unread=0):
        ledgers.append(_Aside(FloorKnobs(), 0.02, None))  # (no step yet: the first round decodes)
        return ledgers[-1]

    monkeypatch.setattr(pair.speculator.floor, "begin", begin)
    opened = tiny_target.begin
    monkeypatch.setattr(tiny_target, "begin", lambda ids: _SlowPrompt(opened(ids), 0.6, timed))
    assert pair.generate(prompt, max_new_tokens=40).token_ids == ref  # (stretches of 16)
    ledger = ledgers[-1]
    assert ledger.measured and ledger.step < 0.6 / 16  # measured by a later stretch, or the first's rest
    assert (ledger.prefill >= 0.6) == timed  # the timed read counts in the request's time alone


def test_a_first_round_under_the_floor_proposes_nothing_and_is_booked_where_timed(
    tiny_drafter, tiny_target, monkeypatch
):
    """The first round's read of the prompt gives its first token whatever it proposes, so a
    rejected first proposal loses its whole verify (on OpenVINO a summary's first proposal of 7
    retrieved tokens cost 1.7 steps for nothing, and then the allowance was spent): under the floor
    it proposes nothing, later rounds do. Where the session times its read apart, the rest of that
    round is booked (no token); where it does not, the first booking is the second round's."""
    prompt = gsm8k_texts("test", 1)[0][:80]
    ref = target_greedy(tiny_target, prompt, 8)
    booked: list[tuple[int, bool]] = []
    book = Ledger.book
    monkeypatch.setattr(
        Ledger, "book", lambda self, c, s, p, **kw: booked.append((c, p)) or book(self, c, s, p, **kw)
    )
    opened, firsts = tiny_target.begin, []
    for timed, step in ((False, STEP), (True, STEP), (True, None)):
        pair = od.Pairing(
            OracleDrafter(tiny_target, ref),
            tiny_target,
            od.DecodeConfig(k=4, strategy="ngram", drafts="model"),
        )
        monkeypatch.setattr(
            pair.speculator.floor, "begin", lambda _, unread=0, step=step: Ledger(FloorKnobs(), 0.5, step)
        )
        monkeypatch.setattr(
            tiny_target, "begin", lambda ids, timed=timed: _SlowPrompt(opened(ids), 0.0, timed)
        )
        booked.clear()
        out = pair.generate(prompt, max_new_tokens=8)
        assert out.token_ids == ref
        firsts.append((out.rounds[0].proposed, any(r.proposed for r in out.rounds[1:]), booked[:1]))
    assert firsts[0][:2] == (0, True) and firsts[0][2][0][0] >= 1  # untimed: the second round's
    assert firsts[1][:2] == (0, True) and firsts[1][2] == [(0, False)]  # timed: the first round's
    assert firsts[2][0] > 0  # no step known: no floor yet, the first round proposes


def test_a_stretch_alone_after_a_proposal_books_its_first_steps_excess_to_the_drafts():
    """After a round that proposed, the engine's first one-token step costs more (a longer shape
    verified, a trimmed state: ~6 ms on OpenVINO): that excess is the drafts' cost; the step is
    measured from the stretch's other tokens. After a round that proposed nothing, no charge."""
    ledger = Floor().begin(STEP)
    ledger.book(1, 2 * STEP, True)
    before = ledger.saved
    ledger.alone(16, 0.030 + 15 * STEP, first=0.030)
    assert ledger.step == pytest.approx(STEP)
    assert ledger.saved == pytest.approx(before - (0.030 - STEP)) and ledger.drafted == pytest.approx(
        ledger.saved
    )
    again = ledger.saved
    ledger.alone(16, 0.030 + 15 * STEP, first=0.030)  # (the last round proposed nothing)
    assert ledger.saved == pytest.approx(again)
