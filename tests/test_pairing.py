"""The Algorithm-1 loop on tiny in-test models: greedy identity, sampling distribution, limits, errors."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import omnidraft as od
from omnidraft.translate.token_bytes import build_token_bytes

from .conftest import chi_square_p, gsm8k_texts, target_greedy, tiny_gemma3, tiny_llama, train_bpe
from .fakes import OracleDrafter

PROMPTS = [t[:80] for t in gsm8k_texts("test", 6)] + ["def add(a, b):\n    return", "x"]


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("strategy", ["text", "ngram"])
def test_greedy_output_is_the_targets_own(tiny_drafter, tiny_target, k, strategy):
    pair = tiny_drafter.pair(tiny_target, k=k, strategy=strategy)
    for prompt in PROMPTS:
        out = pair.generate(prompt, max_new_tokens=24)
        assert out.token_ids == target_greedy(tiny_target, prompt, 24), prompt
        assert out.text == tiny_target.token_bytes.join(out.token_ids).decode(errors="replace")


def test_oracle_drafter_is_accepted_in_full(tiny_drafter, tiny_target):
    prompt = PROMPTS[0]
    ref = target_greedy(tiny_target, prompt, 40)
    oracle = OracleDrafter(tiny_target, ref)
    out = od.Pairing(oracle, tiny_target, od.DecodeConfig(k=5, strategy="ngram", drafts="model")).generate(
        prompt, max_new_tokens=40
    )
    assert out.token_ids == ref
    assert out.stats.acceptance_rate == 1.0 and out.stats.tau == pytest.approx(40 / 7)
    assert out.stats.served == "speculate" and out.stats.adapter_steps is None  # no learning
    line = str(out.stats)
    assert "\n" not in line and line.startswith("40 tokens in ") and "tok/s)" in line
    assert "acceptance 100%, tau 5.71 tokens per target forward over 7 rounds" in line


def test_forced_rejection_gives_partial_acceptance_and_same_output(tiny_drafter, tiny_target):
    prompt = PROMPTS[1]
    ref = target_greedy(tiny_target, prompt, 40)
    oracle = OracleDrafter(tiny_target, ref, wrong_at=2)
    out = od.Pairing(oracle, tiny_target, od.DecodeConfig(k=5, strategy="ngram", drafts="model")).generate(
        prompt, max_new_tokens=40
    )
    assert out.token_ids == ref
    assert [r.accepted for r in out.rounds] == [2] * (len(out.rounds) - 1) + [out.rounds[-1].accepted]


def test_max_new_tokens_stop_strings_and_streaming(tiny_drafter, tiny_target):
    pair = tiny_drafter.pair(tiny_target, k=4)
    for n in (1, 2, 7):
        assert len(pair.generate(PROMPTS[2], max_new_tokens=n).token_ids) == n
    pieces = list(pair.stream(PROMPTS[2], max_new_tokens=30))
    assert "".join(pieces) == pair.last.text
    full = pair.last.text
    stop = full[5:8]
    cut = pair.generate(PROMPTS[2], max_new_tokens=30, stop=(stop,))
    assert cut.finish_reason == "stop" and cut.text == full[: full.find(stop)]


def test_round_records_add_up(tiny_drafter, tiny_target):
    out = tiny_drafter.pair(tiny_target, k=3).generate(PROMPTS[3], max_new_tokens=20)
    assert sum(r.emitted for r in out.rounds) == len(out.token_ids) == out.stats.new_tokens
    assert all(r.accepted <= r.proposed and r.emitted == r.accepted + 1 for r in out.rounds[:-1])
    assert out.stats.mean_accepted_length == pytest.approx(20 / len(out.rounds))


def test_pairings_of_one_tokenizer_pair_share_their_read_only_tables(
    tiny_drafter, tiny_target, draft_tokenizer
):
    """A second `pair()` with a target reuses the vocabulary map and healer (~0.4 s to build on a
    262k vocabulary) instead of rebuilding them; another tokenizer gets its own."""
    a, b = tiny_drafter.pair(tiny_target), tiny_drafter.pair(tiny_target, k=3)
    assert (
        a.speculator.translator.map is b.speculator.translator.map
        and a.speculator.healer is b.speculator.healer is not None
    )
    assert tiny_drafter.pair(tiny_target, heal=False).speculator.healer is None
    same_vocabulary = od.LocalTarget(tiny_llama(len(draft_tokenizer), seed=9), draft_tokenizer, "echo")
    other = tiny_drafter.pair(same_vocabulary)
    assert other.speculator.translator.map is not a.speculator.translator.map and bool(
        (other.speculator.translator.map.d2t >= 0).all()
    )
    assert other.generate(PROMPTS[0], max_new_tokens=8).token_ids == target_greedy(
        same_vocabulary, PROMPTS[0], 8
    )


def _sample_pair(mode: str, n: int):
    tok_d, tok_t = train_bpe(300, gsm8k_texts(n=300)), train_bpe(330, gsm8k_texts(n=300))
    target = od.LocalTarget(tiny_llama(len(tok_t), seed=5, logit_scale=8.0), tok_t, "t")
    drafter = od.TorchDrafter(tiny_llama(len(tok_d), seed=5, logit_scale=8.0), tok_d, "d")
    pair = drafter.pair(target, k=3, mode=mode, temperature=1.0)
    gen = torch.Generator().manual_seed(11)
    prompt = "Question: how many"
    firsts = Counter(pair.generate(prompt, max_new_tokens=2, generator=gen).token_ids[0] for _ in range(n))
    ids = tok_t(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        p = torch.softmax(target.model(ids).logits[0, -1].float(), -1)
    return firsts, p, pair


@pytest.mark.parametrize("mode", ["match", "exact"])
def test_sampling_modes_reproduce_the_target_distribution_end_to_end(mode):
    """First generated token over 1,500 generations vs the target's softmax: chi-square over the
    tokens with expected count >= 5 plus one pooled bin. At alpha = 0.001 a correct engine fails by
    chance once in 1,000 seeds (the seed is fixed, so the run is deterministic)."""
    counts, p, pair = _sample_pair(mode, 1500)
    n = sum(counts.values())
    big = [t for t in range(len(p)) if p[t] * n >= 5]
    observed = [counts[t] for t in big] + [n - sum(counts[t] for t in big)]
    expected = [float(p[t]) * n for t in big] + [n - sum(float(p[t]) * n for t in big)]
    assert len(big) >= 5
    assert chi_square_p(observed, expected) > 1e-3
    assert pair.last.stats.rounds >= 1


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda p: p.generate("", max_new_tokens=4), "prompt must be a non-empty string"),
        (lambda p: p.generate("hi", max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
        (lambda p: p.generate("hi", max_new_tokens=-3), "got -3"),
        (lambda p: p.generate("hi", stop=""), "stop must be a non-empty string or a list"),
        (lambda p: p.generate("hi", stop=3), "stop must be a non-empty string or a list"),
    ],
)
def test_bad_requests_name_the_value(tiny_drafter, tiny_target, call, match):
    with pytest.raises(ValueError, match=match):
        call(tiny_drafter.pair(tiny_target))


def test_stop_is_a_string_or_a_list_of_them(tiny_drafter, tiny_target):
    pair = tiny_drafter.pair(tiny_target, k=3)
    full = pair.generate("Question: Tom has 3 apples", max_new_tokens=24).text
    cut = full[len(full) // 2 : len(full) // 2 + 2]
    for stop in (cut, [cut], (cut, "\x00never")):
        out = pair.generate("Question: Tom has 3 apples", max_new_tokens=24, stop=stop)
        assert out.text == full[: full.find(cut)] and out.finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(k=0), "draft length k must be None .chosen from measured costs. or an integer >= 1, got 0"),
        (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
        (dict(mode="beam"), "verification mode must be one of"),
        (dict(mode="match"), "sampling modes need temperature > 0"),
        (dict(strategy="magic"), "strategy must be 'text' or 'ngram'"),
    ],
)
def test_bad_config_names_the_value(tiny_drafter, tiny_target, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_drafter.pair(tiny_target, **kwargs)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown preset 'qwen9-70b'.*smollm2-135m"):
        od.LocalTarget.load("qwen9-70b")


def test_target_without_byte_coverage_is_refused(texts):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["[UNK]", *"abcdefghijklmnopqrstuvwxyz "])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    with pytest.raises(ValueError, match="lacks byte coverage"):
        od.LocalTarget(tiny_llama(len(hf), seed=0), hf, "wordlevel")
    assert build_token_bytes(hf).missing_bytes


def test_bookkeeping_never_touches_the_whole_context(tiny_drafter, tiny_target, monkeypatch):
    """Translate and re-sync see only the draft and the newly committed bytes: the largest input
    either codec encodes stays bounded by a few tokens, however long the context grows."""
    pair = tiny_drafter.pair(tiny_target, k=4)
    seen: list[int] = []
    for codec in (pair.speculator.translator.draft, pair.speculator.translator.target):
        original = codec.encode
        monkeypatch.setattr(codec, "encode", lambda data, _f=original: (seen.append(len(data)), _f(data))[1])
    long_prompt = " ".join(gsm8k_texts("test", 4))
    out = pair.generate(long_prompt, max_new_tokens=60)
    longest_token = max(len(b or b"") for b in tiny_target.token_bytes.table)
    assert len(long_prompt) > 1000 and seen
    assert max(seen) <= (4 + 1) * max(
        longest_token, max(len(b or b"") for b in tiny_drafter.token_bytes.table)
    )
    assert out.stats.rounds == len(out.rounds)


def test_omnidraft_sampling_mode_runs_with_ngram_merges(tiny_drafter, tiny_target):
    """The approximate mode (eq. 1-2 rows): runs, respects limits, same seed gives the same text."""

    def run() -> list[int]:  # a fresh pairing each time: the n-gram cache learns as it goes
        pair = tiny_drafter.pair(tiny_target, k=4, mode="omnidraft", temperature=0.8, strategy="ngram")
        return pair.generate(
            PROMPTS[0], max_new_tokens=16, generator=torch.Generator().manual_seed(3)
        ).token_ids

    runs = [run(), run()]
    assert runs[0] == runs[1] and len(runs[0]) == 16


def test_a_stop_string_spanning_two_rounds_is_never_streamed(tiny_drafter, tiny_target):
    """Text is held back by len(stop) - 1 characters, so no part of a stop string is ever yielded."""
    pair = tiny_drafter.pair(tiny_target, k=2)
    full = pair.generate(PROMPTS[4], max_new_tokens=30)
    ends, total = [], 0
    for r in full.rounds:  # text length at the end of each round
        total += r.emitted
        ends.append(len(tiny_target.token_bytes.join(full.token_ids[:total]).decode(errors="replace")))
    first = next(e for e in ends if 2 <= e < len(full.text) - 3)
    stop = full.text[first - 1 : first + 2]  # begins in one round, ends in the next
    cut = full.text.find(stop)
    pieces = list(pair.stream(PROMPTS[4], max_new_tokens=30, stop=(stop,)))
    assert "".join(pieces) == full.text[:cut] == pair.last.text and pair.last.finish_reason == "stop"


def test_a_healing_drafter_replaces_its_last_token_only_when_it_prefers_a_longer_one(tiny_drafter):
    table = tiny_drafter.token_bytes.table
    ids = tiny_drafter.codec.encode(b"She has 3 apples and ")  # ends with " ", which longer tokens extend
    held = table[ids[-1]]
    longer = torch.tensor([bool(d) and d.startswith(held) and d != held for d in table])
    assert longer.any()
    plain = tiny_drafter.begin(ids).propose(4, stop_confidence=0)
    kept = tiny_drafter.begin(ids).propose(
        4, stop_confidence=0, heal=torch.tensor([i == ids[-1] for i in range(len(table))])
    )
    assert not kept.healed and kept.ids == plain.ids  # the drafter keeps its token: the usual draft
    session = tiny_drafter.begin(ids)
    healed = session.propose(4, stop_confidence=0, heal=longer)  # only longer tokens allowed: it must replace
    assert healed.healed and table[healed.ids[0]].startswith(held) and table[healed.ids[0]] != held
    session.commit(1, [])
    assert session.ids == ids[:-1] + healed.ids[:1]


class _SpyDrafter:
    """Wraps a drafter; records, at every propose, the drafter's context, the draft and whether it healed."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.tokenizer, self.token_bytes, self.codec, self.name = (
            inner.tokenizer,
            inner.token_bytes,
            inner.codec,
            "spy",
        )

    def begin(self, ids):
        session, calls = self.inner.begin(ids), self.calls

        class Session:
            def propose(self, k, **kw):
                context = list(session.ids)
                draft = session.propose(k, **kw)
                calls.append((context, draft))
                return draft

            def commit(self, keep, tail):
                session.commit(keep, tail)

        return Session()


@pytest.mark.parametrize("prompt", [p + " " for p in PROMPTS[:3]] + ["def add(a, b):\n    return "])
def test_healed_drafts_keep_greedy_output_and_the_drafter_context_spells_the_committed_text(
    tiny_drafter, tiny_target, prompt
):
    spy = _SpyDrafter(tiny_drafter)
    pair = od.Pairing(spy, tiny_target, od.DecodeConfig(k=4, drafts="model"))
    table = tiny_drafter.token_bytes.table
    # every longer token may replace the last one (no filter by the target's last token): heals often
    pair.speculator.healer.candidates = lambda token, last: torch.tensor(
        [bool(d) and bool(table[token]) and d.startswith(table[token]) for d in table]
    )
    out = pair.generate(prompt, max_new_tokens=30)
    assert out.token_ids == target_greedy(tiny_target, prompt, 30)
    committed, done = prompt.encode(), 0
    for (context, draft), record in zip(spy.calls, out.rounds):
        assert (
            tiny_drafter.token_bytes.join(context) == committed
        )  # context spells exactly what was committed
        if draft.healed:
            assert table[draft.ids[0]].startswith(table[context[-1]])
        committed += tiny_target.token_bytes.join(out.token_ids[done : done + record.emitted])
        done += record.emitted
    assert any(draft.healed for _, draft in spy.calls)


def test_healing_acts_only_where_it_is_lossless():
    assert od.DecodeConfig().healing and od.DecodeConfig(mode="match", temperature=0.7).healing
    assert not od.DecodeConfig(strategy="ngram").healing
    assert not od.DecodeConfig(mode="exact", temperature=0.7).healing
    assert not od.DecodeConfig(heal=False).healing


def test_a_sliding_window_drafter_crops_back_past_its_window():
    """Gemma 3's sliding-window layers: a draft rejected after the window filled is cropped back
    (token healing re-feeds too), and the logits stay a full forward's."""
    from omnidraft.runtime.causal_runner import CausalRunner

    torch.manual_seed(0)
    model = tiny_gemma3(4)
    ids = torch.randint(0, 64, (20,)).tolist()
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([ids])).logits[0]
    runner = CausalRunner(model, ids[:12])
    runner.forward()
    runner.crop(6)  # back past the window of 4
    runner.extend(ids[6:20])
    torch.testing.assert_close(runner.forward(keep=3), full[-3:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        runner.forward(keep=5), full[-5:], atol=1e-4, rtol=1e-4
    )  # re-feeds cached tokens
