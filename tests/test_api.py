"""The user API beyond generate(): seeds, batches, chat, and one pairing shared by threads."""

from __future__ import annotations

import threading

import pytest
import torch

import omnidraft as od

from .conftest import chi_square_p, target_greedy
from .test_pairing import PROMPTS

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_an_integer_seed_reproduces_a_sampled_generation(tiny_drafter, tiny_target):
    """match sampling keyed by (seed, position): the same output whatever the draft lengths."""
    pair = tiny_drafter.pair(tiny_target, mode="match", temperature=1.0)
    first = pair.generate(PROMPTS[0], max_new_tokens=16, seed=7).token_ids
    assert pair.generate(PROMPTS[0], max_new_tokens=16, seed=7).token_ids == first
    for k in (1, 4):
        assert (
            tiny_drafter.pair(tiny_target, mode="match", temperature=1.0, k=k)
            .generate(PROMPTS[0], max_new_tokens=16, seed=7)
            .token_ids
            == first
        )
    assert pair.generate(PROMPTS[0], max_new_tokens=16, seed=8).token_ids != first
    with pytest.raises(ValueError, match="seed or generator"):
        pair.generate(PROMPTS[0], seed=1, generator=torch.Generator())
    with pytest.raises(ValueError, match="seed must be an integer"):
        pair.generate(PROMPTS[0], seed=-1)
    with pytest.raises(ValueError, match="seed must be an integer"):
        pair.generate(PROMPTS[0], seed=2**64)


def test_a_list_of_prompts_gives_a_list_of_generations(tiny_drafter, tiny_target):
    pair = tiny_drafter.pair(tiny_target)
    outs = pair.generate(PROMPTS[:3], max_new_tokens=12)
    assert [o.token_ids for o in outs] == [target_greedy(tiny_target, p, 12) for p in PROMPTS[:3]]


def test_threads_can_share_one_pairing(tiny_drafter, tiny_target):
    pair = od.pair(tiny_drafter, tiny_target)
    prompts = PROMPTS * 2
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = pair.generate(prompts[i], max_new_tokens=20).token_ids
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(results[i] == target_greedy(tiny_target, p, 20) for i, p in enumerate(prompts))


def test_chat_renders_the_targets_template_once(tiny_drafter, tiny_target, monkeypatch):
    pair = tiny_drafter.pair(tiny_target)
    with pytest.raises(ValueError, match="has no chat template"):
        pair.chat([{"role": "user", "content": "hi"}])
    monkeypatch.setattr(tiny_target.tokenizer, "chat_template", CHATML, raising=False)
    with pytest.raises(ValueError, match="messages must be"):
        pair.chat([{"role": "user"}])
    messages = [{"role": "user", "content": "How many apples?"}]
    text = pair.render_chat(messages)
    assert text.endswith("<|im_start|>assistant\n")
    out = pair.chat(messages, max_new_tokens=16)
    ids = tiny_target.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    ref = tiny_target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=sorted(tiny_target.eos_ids),
        pad_token_id=0,
    )[0, ids.shape[1] :].tolist()
    assert out.token_ids == ref


def test_a_chat_answer_ends_where_the_template_ends_an_assistants_turn(
    tiny_drafter, tiny_target, monkeypatch
):
    """Any chat model: the turn's end ("<|im_end|>" here) stops a chat where no EOS token writes it,
    beside the caller's own stops; a template that writes none adds nothing."""
    from omnidraft.decode.chat import chat_stops, turn_end

    monkeypatch.setattr(tiny_target.tokenizer, "chat_template", CHATML, raising=False)
    assert turn_end(tiny_target.tokenizer) == "<|im_end|>"
    assert chat_stops(tiny_target, ()) == ["<|im_end|>"] and chat_stops(tiny_target, "\n\n") == [
        "\n\n",
        "<|im_end|>",
    ]
    bare = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    monkeypatch.setattr(tiny_target.tokenizer, "chat_template", bare, raising=False)
    assert turn_end(tiny_target.tokenizer) is None and chat_stops(tiny_target, ("x",)) == ("x",)


def test_pair_takes_a_config_or_overrides_not_both(tiny_drafter, tiny_target):
    with pytest.raises(ValueError, match="not both"):
        od.pair(tiny_drafter, tiny_target, od.DecodeConfig(), k=3)
    assert od.pair(tiny_drafter, tiny_target, k=3).config.k == 3


def test_probability_filters():
    from omnidraft.decode.verify import probabilities

    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))
    assert torch.allclose(probabilities(logits, 1.0), torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))
    assert torch.allclose(probabilities(logits, 1.0, top_k=2), torch.tensor([[2 / 3, 1 / 3, 0, 0, 0]]))
    assert torch.allclose(probabilities(logits, 1.0, top_p=0.7), torch.tensor([[2 / 3, 1 / 3, 0, 0, 0]]))
    assert torch.allclose(
        probabilities(logits, 1.0, top_p=0.8), torch.tensor([[0.5, 0.25, 0.15, 0, 0]]) / 0.9
    )
    assert torch.allclose(probabilities(logits, 1.0, min_p=0.4), torch.tensor([[0.5, 0.25, 0, 0, 0]]) / 0.75)
    with pytest.raises(ValueError, match="top_p"):
        od.Rule(mode="match", temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        od.DecodeConfig(top_k=-1)


@pytest.mark.parametrize("mode", ["match", "exact", "per-call"])
def test_filtered_sampling_reproduces_the_filtered_target_distribution(mode):
    """First token over 1,200 generations against the target's softmax with top-k 8 and top-p 0.9
    applied; chi-square as in test_pairing. "per-call": a greedy pairing sampling for one call."""
    from omnidraft.decode.verify import probabilities

    from .conftest import gsm8k_texts, tiny_llama, train_bpe

    tok_d, tok_t = train_bpe(300, gsm8k_texts(n=300)), train_bpe(330, gsm8k_texts(n=300))
    target = od.LocalTarget(tiny_llama(len(tok_t), seed=5, logit_scale=4.0), tok_t, "t")
    drafter = od.TorchDrafter(tiny_llama(len(tok_d), seed=5, logit_scale=4.0), tok_d, "d")
    if mode == "per-call":
        pair, call = drafter.pair(target, k=3), {"temperature": 1.0, "top_k": 8, "top_p": 0.9}
    else:
        pair, call = drafter.pair(target, k=3, mode=mode, temperature=1.0, top_k=8, top_p=0.9), {}
    gen = torch.Generator().manual_seed(17)
    prompt = "Question: how many"
    n = 1200
    counts = {}
    for _ in range(n):
        t = pair.generate(prompt, max_new_tokens=2, generator=gen, **call).token_ids[0]
        counts[t] = counts.get(t, 0) + 1
    ids = tok_t(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        p = probabilities(target.model(ids).logits[0, -1], 1.0, top_k=8, top_p=0.9)
    assert set(counts) <= set(torch.nonzero(p).flatten().tolist())  # nothing outside the filtered support
    big = [t for t in range(len(p)) if p[t] * n >= 5]
    observed = [counts.get(t, 0) for t in big] + [n - sum(counts.get(t, 0) for t in big)]
    expected = [float(p[t]) * n for t in big] + [n - sum(float(p[t]) * n for t in big)]
    if expected[-1] < 1e-6:  # the filtered support is all in the big bins: no pooled bin
        observed, expected = observed[:-1], expected[:-1]
    assert len(big) >= 3
    assert chi_square_p(observed, expected) > 1e-3


def test_asyncio_front_ends(tiny_drafter, tiny_target):
    import asyncio

    from omnidraft.aio import agenerate, astream

    pair = tiny_drafter.pair(tiny_target)

    async def main():
        outs = await asyncio.gather(*(agenerate(pair, p, 12) for p in PROMPTS[:3]))
        pieces = [piece async for piece in astream(pair, PROMPTS[0], 12)]
        return outs, "".join(pieces)

    outs, text = asyncio.run(main())
    assert [o.token_ids for o in outs] == [target_greedy(tiny_target, p, 12) for p in PROMPTS[:3]]
    assert text == outs[0].text


def test_a_temperature_alone_pairs_for_lossless_match_sampling(tiny_drafter, tiny_target):
    pair = od.pair(tiny_drafter, tiny_target, temperature=0.8)
    assert pair.config.mode == "match" and pair.config.rule.temperature == 0.8
    out = pair.generate("Question: Tom has", max_new_tokens=8, seed=3)
    assert out.token_ids == pair.generate("Question: Tom has", max_new_tokens=8, seed=3).token_ids


def test_every_error_class_is_public_and_a_misnamed_length_is_named(tiny_drafter, tiny_target):
    import omnidraft.errors

    for name in omnidraft.errors.__all__:
        assert getattr(od, name) is getattr(omnidraft.errors, name)
    with pytest.raises(TypeError, match="max_new_tokens"):
        tiny_drafter.pair(tiny_target, k=2).generate("x", max_tokens=8)
