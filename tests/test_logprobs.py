"""`logprobs=N`: each generated token's log-probability under the target and its top N
alternatives, equal to what the target's own forward over the whole output gives."""

from __future__ import annotations

import pytest
import torch

PROMPT = "Question: A train travels 60 miles in 2 hours."


@pytest.fixture(scope="module")
def pairing(tiny_drafter, tiny_target):
    return tiny_drafter.pair(tiny_target, k=4)


def _reference(target, prompt: str, out: list[int]) -> torch.Tensor:
    """log-softmax rows of the target over the prompt and the output, one per generated token."""
    ids = target.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        logits = target.model(torch.tensor([ids + out])).logits[0]
    return torch.log_softmax(logits.float(), -1)[len(ids) - 1 : len(ids) - 1 + len(out)]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 5}])
def test_logprobs_are_the_targets_own(pairing, tiny_target, sampling):
    out = pairing.generate(PROMPT, 20, logprobs=3, **sampling)
    assert out.logprobs is not None and [t.token for t in out.logprobs] == out.token_ids
    rows = _reference(tiny_target, PROMPT, out.token_ids)
    for row, entry in zip(rows, out.logprobs, strict=True):
        assert entry.logprob == pytest.approx(float(row[entry.token]), abs=1e-4)
        best = row.topk(3)
        assert list(entry.top) == best.indices.tolist()
        assert list(entry.top.values()) == pytest.approx(best.values.tolist(), abs=1e-4)
    if not sampling:  # greedy: every token is the target's most likely one
        assert all(entry.token == next(iter(entry.top)) for entry in out.logprobs)


def test_no_logprobs_unless_asked_and_bad_values_are_named(pairing):
    assert pairing.generate(PROMPT, 5).logprobs is None
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(ValueError, match="logprobs must be an integer in"):
            pairing.generate(PROMPT, 5, logprobs=bad)
