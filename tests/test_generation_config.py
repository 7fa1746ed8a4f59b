"""`generation_config=`: a transformers.GenerationConfig (or the target's own, on request) sets a
request's sampling, length and stop strings as HF would read them; fields a pairing cannot
reproduce are refused by name."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from .conftest import target_greedy

PROMPT = "Question: Tom has 3 apples and buys 5 more."


@pytest.fixture(scope="module")
def pairing(tiny_drafter, tiny_target):
    return tiny_drafter.pair(tiny_target, k=4)


def test_greedy_config_gives_the_targets_greedy_output_and_its_length(pairing, tiny_target):
    out = pairing.generate(PROMPT, generation_config=GenerationConfig(do_sample=False, max_new_tokens=9))
    assert out.token_ids == target_greedy(tiny_target, PROMPT, 9)
    # an explicit length wins over the config's
    assert (
        len(pairing.generate(PROMPT, 5, generation_config=GenerationConfig(max_new_tokens=9)).token_ids) == 5
    )


def test_sampling_config_is_the_same_rule_as_the_keywords(pairing):
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12)
    by_config = pairing.generate(PROMPT, seed=3, generation_config=config)
    by_keywords = pairing.generate(PROMPT, 12, seed=3, temperature=0.7, top_k=20, top_p=0.9)
    assert by_config.token_ids == by_keywords.token_ids
    # a keyword given with the config overrides that field
    hotter = pairing.generate(PROMPT, seed=3, generation_config=config, temperature=1.5)
    assert (
        hotter.token_ids
        == pairing.generate(PROMPT, 12, seed=3, temperature=1.5, top_k=20, top_p=0.9).token_ids
    )


def test_the_targets_own_config_only_on_request(pairing, tiny_target):
    own = tiny_target.model.generation_config
    tiny_target.model.generation_config = GenerationConfig(do_sample=False, max_new_tokens=6)
    try:
        assert len(pairing.generate(PROMPT, generation_config="target").token_ids) == 6
        # not read unless asked for: the default length
        assert pairing.generate(PROMPT).token_ids == target_greedy(tiny_target, PROMPT, 128)
    finally:
        tiny_target.model.generation_config = own


def test_unsupported_fields_and_wrong_types_are_named(pairing):
    with pytest.raises(ValueError, match="generation_config.num_beams=4 is not supported"):
        pairing.generate(PROMPT, generation_config=GenerationConfig(num_beams=4))
    with pytest.raises(ValueError, match="repetition_penalty"):
        pairing.generate(PROMPT, generation_config=GenerationConfig(repetition_penalty=1.3))
    with pytest.raises(TypeError, match="transformers.GenerationConfig or 'target'"):
        pairing.generate(PROMPT, generation_config={"do_sample": False})
