"""adaptive/policy.py: the hysteresis fallback, and greedy identity with adaptive drafting on."""

from __future__ import annotations

import pytest

import omnidraft as od
from omnidraft.adaptive.policy import Hysteresis

from .conftest import target_greedy
from .fakes import OracleDrafter
from .test_session import PROMPTS


def test_grows_slowly_and_shrinks_at_once():
    p = Hysteresis(k_min=2, k_max=8)
    assert p.next_k(4, proposed=4, accepted=4) == 5
    assert p.next_k(8, proposed=8, accepted=8) == 8
    assert p.next_k(7, proposed=7, accepted=2) == 3
    assert p.next_k(7, proposed=7, accepted=0) == 2
    assert p.next_k(5, proposed=0, accepted=0) == 5
    with pytest.raises(ValueError, match="k_min <= k_max"):
        Hysteresis(k_min=5, k_max=3)


def test_greedy_identity_with_adaptive_drafting(tiny_drafter, tiny_target):
    pair = tiny_drafter.pair(tiny_target, k=3, adaptive=Hysteresis(k_min=1, k_max=10))
    for prompt in PROMPTS[:4]:
        assert pair.generate(prompt, max_new_tokens=24).token_ids == target_greedy(tiny_target, prompt, 24)


def test_draft_length_grows_under_full_acceptance(tiny_target):
    ref = target_greedy(tiny_target, PROMPTS[0], 60)
    config = od.DecodeConfig(k=2, strategy="ngram", adaptive=Hysteresis(k_min=2, k_max=9))
    out = od.Pairing(OracleDrafter(tiny_target, ref), tiny_target, config).generate(PROMPTS[0], max_new_tokens=60)
    assert out.token_ids == ref
    assert [r.drafted for r in out.rounds[:5]] == [2, 3, 4, 5, 6]
