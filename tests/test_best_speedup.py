"""Whether drafting can pay at all, decided before any request from a target's measured verify
costs (adaptive/policy.py `best_speedup`): where it cannot, the pairing decodes with the target alone
and never probes; where only free retrieved drafts can, it drafts no model tokens."""

from __future__ import annotations

import logging

import pytest

import omnidraft.runtime.backends
from omnidraft.adaptive.policy import best_speedup
from omnidraft.runtime import measured
from tests.conftest import target_greedy

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


class CostedTarget:
    """A target that reports verify costs, as LlamaCppTarget does (measured there)."""

    def __init__(self, inner, costs: dict[int, float], *, past: int | None = None) -> None:
        self._inner, self._costs, self._past = (
            inner,
            costs,
            past,
        )  # past `past` tokens verifying n costs n steps

    def verify_costs(self, context: int | None = None) -> dict[int, float]:
        if self._past is not None and context is not None and context > self._past:
            return {n: n * self._costs[1] for n in self._costs}
        return dict(self._costs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


LINEAR = {n: 0.02 * n for n in range(1, 9)}  # n tokens cost n steps: nothing can pay
CHEAP = {n: 0.02 * (1 + 0.1 * (n - 1)) for n in range(1, 9)}  # memory-bound: drafts pay


@pytest.fixture(autouse=True)
def drafter_cost(monkeypatch):
    monkeypatch.setattr(omnidraft.runtime.backends, "drafting_cost", lambda drafter: 0.005)


def test_the_best_speedup_of_linear_cheap_and_costly_drafts():
    linear = best_speedup(LINEAR, 0.0)
    assert linear.free < 1 and not linear.free_pays and not linear.model_pays
    cheap = best_speedup(CHEAP, 0.002)
    assert cheap.free_pays and cheap.model_pays and cheap.free > cheap.model
    costly = best_speedup(CHEAP, 0.05)  # a drafted token dearer than two decoding steps
    assert costly.free_pays and not costly.model_pays
    assert "decoding steps" in costly.reason() and "1.20x" in costly.reason()
    with pytest.raises(ValueError, match="one token"):
        best_speedup({2: 0.1}, 0.0)
    with pytest.raises(ValueError, match="acceptance"):
        best_speedup(CHEAP, 0.0, acceptance=1.0)


def test_where_drafting_cannot_pay_the_pairing_decodes_alone_and_says_why(tiny_drafter, tiny_target, caplog):
    target = CostedTarget(tiny_target, LINEAR)
    with caplog.at_level(logging.DEBUG, logger="omnidraft.pairing"):
        pairing = tiny_drafter.pair(target)
    assert not pairing.drafting and not pairing.speculating and pairing.speculator.chooser is None
    assert "drafting cannot pay" in caplog.text and "decoding steps" in caplog.text
    for _ in range(3):  # never a probe
        out = pairing.generate(PROMPT, max_new_tokens=24)
        assert out.token_ids == target_greedy(tiny_target, PROMPT, 24)
        assert sum(r.drafted + r.proposed for r in out.rounds) == 0
    assert out.stats.served == "alone" and out.stats.why.startswith("drafting cannot pay on this machine")
    assert "decoded by the target alone (drafting cannot pay" in str(out.stats)
    assert "tau" not in str(out.stats)  # no acceptance of 0 and tau of 1.0 to misread
    sampled = pairing.generate(
        PROMPT, max_new_tokens=8, temperature=0.8, seed=1
    )  # sampling: one token a round
    assert all(r.proposed == 0 for r in sampled.rounds)


def test_where_only_free_drafts_can_pay_no_model_token_is_drafted(tiny_drafter, tiny_target, monkeypatch):
    monkeypatch.setattr(omnidraft.runtime.backends, "drafting_cost", lambda drafter: 0.05)
    pairing = tiny_drafter.pair(CostedTarget(tiny_target, CHEAP))
    assert pairing.speculator.free_drafts and not pairing.speculator.model_drafts and pairing.drafting
    prompt = PROMPT + " " + PROMPT  # something to copy
    out = pairing.generate(prompt, max_new_tokens=24)
    assert out.token_ids == target_greedy(tiny_target, prompt, 24)
    assert sum(r.drafted for r in out.rounds) == 0


def test_where_drafting_can_pay_the_pairing_drafts(tiny_drafter, tiny_target):
    pairing = tiny_drafter.pair(CostedTarget(tiny_target, CHEAP))
    assert (
        pairing.speculator.best_speedup.model_pays
        and pairing.speculator.model_drafts
        and pairing.speculator.free_drafts
    )
    out = pairing.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == target_greedy(tiny_target, PROMPT, 24)
    assert sum(r.drafted for r in out.rounds) > 0


def test_a_first_request_drafts_no_model_token_whose_prompt_read_the_floor_cannot_cover(
    tiny_drafter, tiny_target, monkeypatch
):
    """The drafter's read of a prompt, known before any request (measured once a machine), counts
    in a first model draft's worst case: a read dearer than the request may lose drafts nothing
    from the drafter model, a cheap one drafts."""
    from omnidraft.runtime.backends import read_ms

    assert read_ms(tiny_drafter, tokens=24) > 0
    monkeypatch.setattr(omnidraft.runtime.backends, "reading_cost", lambda drafter: 0.05)
    pairing = tiny_drafter.pair(CostedTarget(tiny_target, CHEAP))
    assert pairing.speculator.floor.read == 0.05 and pairing.speculator.model_drafts
    out = pairing.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == target_greedy(tiny_target, PROMPT, 24)
    assert sum(r.drafted for r in out.rounds) == 0
    monkeypatch.setattr(omnidraft.runtime.backends, "reading_cost", lambda drafter: 1e-6)
    out = tiny_drafter.pair(CostedTarget(tiny_target, CHEAP)).generate(PROMPT, max_new_tokens=24)
    assert sum(r.drafted for r in out.rounds) > 0


def test_drafts_stop_where_the_context_makes_verifying_cost_a_step_a_token(tiny_drafter, tiny_target):
    """llama.cpp past its exact range verifies a token a call: from that context on, no draft."""
    past = len(tiny_target.tokenizer(PROMPT)["input_ids"]) + 6
    pairing = tiny_drafter.pair(CostedTarget(tiny_target, CHEAP, past=past))
    out = pairing.generate(PROMPT, max_new_tokens=32)
    assert out.token_ids == target_greedy(tiny_target, PROMPT, 32)
    assert any(r.drafted for r in out.rounds if r.context <= past)
    late = [r for r in out.rounds if r.context > past]
    assert late and all(r.drafted == 0 and r.proposed == 0 for r in late)


def test_a_fixed_draft_length_or_learning_skips_the_best_speedup_check(tiny_drafter, tiny_target):
    target = CostedTarget(tiny_target, LINEAR)
    assert tiny_drafter.pair(target, k=4).speculator.best_speedup is None
    assert tiny_drafter.pair(target, objective="compute").speculator.best_speedup is None


def test_machine_figures_are_measured_once_and_survive_a_corrupt_file(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return {"1": 0.5}

    assert measured.remembered("probe", "model|a", measure) == {"1": 0.5}
    assert measured.remembered("probe", "model|a", measure) == {"1": 0.5}
    assert len(calls) == 1
    (file,) = (tmp_path / "measured").glob("probe-*.json")
    file.write_text("{not json")
    assert measured.remembered("probe", "model|a", measure) == {"1": 0.5}
    assert len(calls) == 2


def test_a_pairing_drafts_through_the_faster_llama_cpp_copy_unless_it_needs_pytorch(
    tiny_drafter, tiny_target, monkeypatch
):
    """A PyTorch drafter loaded from a preset (`gguf_spec`) drafts through its llama.cpp copy where
    that is measured faster; learning, a user profile, a shortlisted head, an acceptance head or a
    slower copy keep it on PyTorch; `backend="torch"` (no gguf_spec) always does."""
    import omnidraft as od
    from omnidraft.adaptive.acceptance_head import HeadConfig
    from omnidraft.decode.config import DecodeConfig

    faster = od.TorchDrafter(tiny_drafter.model, tiny_drafter.tokenizer, "faster")
    costs = {id(faster): 0.005, id(tiny_drafter): 0.02}
    monkeypatch.setattr(omnidraft.runtime.backends, "_candidates", lambda spec: ["torch", "llama.cpp"])
    monkeypatch.setattr(omnidraft.runtime.backends, "drafting_cost", lambda d: costs[id(d)])
    monkeypatch.setattr(tiny_drafter, "llama_copy", lambda: faster)
    choose = omnidraft.runtime.backends.drafting_copy
    plain = DecodeConfig()
    assert choose(tiny_drafter, plain, learn=False, adapter=None, user=None) is tiny_drafter  # no gguf_spec
    monkeypatch.setattr(tiny_drafter, "gguf_spec", "smollm2-135m")
    assert choose(tiny_drafter, plain, learn=False, adapter=None, user=None) is faster
    assert tiny_drafter.pair(tiny_target).drafter is faster
    for config, learn, user in [
        (plain, True, None),
        (plain, False, "alice"),
        (DecodeConfig(head=HeadConfig()), False, None),
    ]:
        assert choose(tiny_drafter, config, learn=learn, adapter=None, user=user) is tiny_drafter
    costs[id(faster)] = 0.05
    assert choose(tiny_drafter, plain, learn=False, adapter=None, user=None) is tiny_drafter
