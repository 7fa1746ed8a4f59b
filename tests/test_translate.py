"""translate/: token bytes, byte codec, direct map, n-gram cache, translator (eq. 1-2, re-sync)."""

from __future__ import annotations

import json

import pytest
import torch

from omnidraft.errors import CorruptFileError, IncompatibleError
from omnidraft.translate.codec import ByteCodec
from omnidraft.translate.ngram_cache import NgramCache, NgramCacheConfig
from omnidraft.translate.token_bytes import build_token_bytes
from omnidraft.translate.translator import Source, Translator
from omnidraft.translate.vocab_map import build_vocab_map

SAMPLES = [
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.",
    "def f(x):\n\tif x:\n        return {'a': [1, 2]}  # café\n\n\n",
    "   leading and trailing spaces   ",
    "unicode: 日本語のテキスト, emoji 🦜🔥, Ünïcödé, ‰ ∑ √",
    "literal special text <|endoftext|> stays text",
    "\r\n\t \u00a0mixed\u2003whitespace\n",
]


@pytest.fixture(scope="module")
def draft_codec(draft_tokenizer):
    return ByteCodec(draft_tokenizer, build_token_bytes(draft_tokenizer))


@pytest.fixture(scope="module")
def target_codec(target_tokenizer):
    return ByteCodec(target_tokenizer, build_token_bytes(target_tokenizer))


def test_every_token_decodes_to_its_bytes(draft_tokenizer, draft_codec):
    tb = draft_codec.token_bytes
    assert tb.scheme == "byte_level" and tb.missing_bytes == []
    for i, data in enumerate(tb.table):
        if data is None:
            assert i in tb.special
            continue
        text = draft_tokenizer.decode([i])
        if text != "\ufffd":  # a lone token ending mid-character decodes to the replacement char
            assert text.encode() == data, i


@pytest.mark.parametrize("text", SAMPLES)
def test_codec_round_trips_exact_bytes(draft_codec, target_codec, text):
    for codec in (draft_codec, target_codec):
        ids = codec.encode(text.encode())
        assert codec.token_bytes.join(ids) == text.encode()
        assert codec.token_bytes.special.keys().isdisjoint(ids)  # no BOS, no special parsed from text


def test_codec_spells_invalid_utf8_with_byte_tokens(draft_codec):
    data = "ab日".encode()[:-1] + b"\xff" + "c".encode()
    assert draft_codec.token_bytes.join(draft_codec.encode(data)) == data


def test_vocab_map_is_byte_equality_and_specials_by_role(
    draft_tokenizer, target_tokenizer, draft_codec, target_codec
):
    vmap = build_vocab_map(
        draft_codec.token_bytes, target_codec.token_bytes, draft_tokenizer, target_tokenizer
    )
    for i in range(len(vmap.d2t)):
        j = int(vmap.d2t[i])
        if j >= 0 and i not in draft_codec.token_bytes.special:
            assert draft_codec.token_bytes.table[i] == target_codec.token_bytes.table[j]
    eos_d, eos_t = draft_tokenizer.eos_token_id, target_tokenizer.eos_token_id
    assert vmap.d2t[eos_d] == eos_t and vmap.t2d[eos_t] == eos_d
    assert 256 <= vmap.shared <= 400 and "shared" in vmap.summary()


# ----- n-gram cache -------------------------------------------------------------------------
def test_cache_never_exceeds_entry_and_byte_bounds():
    cache = NgramCache(NgramCacheConfig(max_entries=50, max_bytes=4000))
    for i in range(2000):
        cache.add((i, i + 1, i % 7), i)
        assert len(cache) <= 50 and cache.nbytes <= 4000
    assert cache.evictions > 0


def test_lfu_keeps_frequent_entries_under_pressure():
    cache = NgramCache(NgramCacheConfig(max_entries=20, policy="lfu"))
    hot = [(1, k) for k in range(10)]
    for key in hot:
        cache.add(key, 7)
        for _ in range(5):
            cache.use(key)
    for i in range(500):
        cache.add((2, i), 9)
    assert all(key in cache for key in hot)
    lru = NgramCache(NgramCacheConfig(max_entries=20, policy="lru"))
    for key in hot:
        lru.add(key, 7)
    for i in range(500):
        lru.add((2, i), 9)
    assert not any(key in lru for key in hot)


def _shifting_working_set(policy: str) -> NgramCache:
    """10 keys used often early, then a new working set of 15 keys seen every round."""
    cache = NgramCache(NgramCacheConfig(max_entries=20, policy=policy))
    for key in [(1, k) for k in range(10)]:
        cache.add(key, 7)
        for _ in range(5):
            cache.use(key)
    for _ in range(30):
        for k in range(15):
            cache.add((3, k), 9)
    return cache


def test_lfu_with_dynamic_aging_lets_a_new_working_set_in():
    """Plain LFU keeps the stale early favourites for good, so only part of the new set fits;
    LFU-DA's rising age level (Arlitt et al. 2000) sinks them below the keys now in use."""
    old, new = [(1, k) for k in range(10)], [(3, k) for k in range(15)]
    lfu, aged = _shifting_working_set("lfu"), _shifting_working_set("lfu-da")
    assert all(key in lfu for key in old) and not all(key in lfu for key in new)
    assert all(key in aged for key in new) and aged.evictions > 0 and len(aged) == 20


@pytest.mark.parametrize("policy", ["lfu", "lfu-da", "lru"])
def test_reading_the_cache_counts_no_use(policy):
    """peek and items (what a save reads) must not change which entry is evicted next."""
    cache = NgramCache(NgramCacheConfig(max_entries=2, policy=policy))
    cache.add((1, 2), 10)
    cache.add((2, 3), 11)
    cache.use((2, 3))
    assert cache.peek((1, 2)) == 10 and sorted(cache.items()) == [((1, 2), 10), ((2, 3), 11)]
    cache.add((3, 4), 12)
    assert (1, 2) not in cache and (2, 3) in cache and cache.evictions == 1


def test_a_cache_of_no_entries_keeps_nothing():
    cache = NgramCache(NgramCacheConfig(max_entries=0))
    cache.add((1, 2), 3)
    assert len(cache) == 0 and (1, 2) not in cache and cache.evictions == 0


def test_cache_save_load_round_trip(tmp_path):
    cache = NgramCache(NgramCacheConfig(max_entries=100), fingerprint="d:t")
    for i in range(30):
        cache.add((i, i + 1), 100 + i)
    cache.save(tmp_path / "c.json")
    back = NgramCache.load(tmp_path / "c.json", fingerprint="d:t")
    assert sorted(back.items()) == sorted(cache.items()) and back.config == cache.config


def test_truncated_or_foreign_cache_is_refused_and_previous_file_survives(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    cache = NgramCache(fingerprint="d:t")
    cache.add((1, 2), 3)
    cache.save(path)
    good = path.read_bytes()
    (tmp_path / "trunc.json").write_bytes(good[: len(good) // 2])
    with pytest.raises(CorruptFileError, match="truncated"):
        NgramCache.load(tmp_path / "trunc.json")
    (tmp_path / "foreign.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CorruptFileError, match="not an omnidraft n-gram cache"):
        NgramCache.load(tmp_path / "foreign.json")
    with pytest.raises(IncompatibleError, match="another drafter/target pairing"):
        NgramCache.load(path, fingerprint="x:y")
    import omnidraft.store.atomic as atomic

    def crash(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "replace", crash)
    cache.add((4, 5), 6)
    with pytest.raises(KeyboardInterrupt):
        cache.save(path)
    assert path.read_bytes() == good and list(tmp_path.glob(".c.json.*")) == []


@pytest.mark.parametrize(
    "bad", [dict(policy="fifo"), dict(max_entries=-1), dict(max_bytes=0), dict(max_len=1)]
)
def test_cache_config_names_bad_values(bad):
    with pytest.raises(ValueError, match=list(bad)[0]):
        NgramCacheConfig(**bad)


# ----- translator ---------------------------------------------------------------------------
def _translator(draft_tokenizer, target_tokenizer, draft_codec, target_codec, strategy):
    vmap = build_vocab_map(
        draft_codec.token_bytes, target_codec.token_bytes, draft_tokenizer, target_tokenizer
    )
    return Translator(draft_codec, target_codec, vmap, NgramCache(), strategy=strategy)


@pytest.mark.parametrize("strategy", ["text", "ngram"])
def test_translation_spells_the_draft_bytes(
    draft_tokenizer, target_tokenizer, draft_codec, target_codec, strategy
):
    tr = _translator(draft_tokenizer, target_tokenizer, draft_codec, target_codec, strategy)
    for text in SAMPLES:
        draft = draft_codec.encode(text.encode())
        proposal = tr.translate(draft)
        assert target_codec.token_bytes.join(proposal.ids.tolist()) == draft_codec.token_bytes.join(draft)


def test_learned_ngrams_merge_drafter_runs(draft_tokenizer, target_tokenizer, draft_codec, target_codec):
    tr = _translator(draft_tokenizer, target_tokenizer, draft_codec, target_codec, "ngram")
    text = " Natalia sold clips altogether"
    draft, target = draft_codec.encode(text.encode()), target_codec.encode(text.encode())
    assert len(target) < len(draft), "the bigger vocabulary should merge some drafter tokens"
    before = tr.translate(draft)
    assert before.from_cache == 0
    assert tr.learn(draft, target) > 0
    after = tr.translate(draft)
    assert after.ids.tolist() == target and after.from_cache > 0
    assert all(s in (Source.DIRECT, Source.NGRAM) for s in after.sources)


def test_draft_probs_follow_eq1_and_eq2(draft_tokenizer, target_tokenizer, draft_codec, target_codec):
    tr = _translator(draft_tokenizer, target_tokenizer, draft_codec, target_codec, "ngram")
    text = " clips"
    draft, target = draft_codec.encode(text.encode()), target_codec.encode(text.encode())
    tr.learn(draft, target)
    proposal = tr.translate(draft, only="aligned")
    q = torch.softmax(torch.randn(len(draft), len(draft_codec.token_bytes)), -1)
    rows = tr.draft_probs(proposal, draft, q)
    (a, b) = proposal.spans[0]
    prod = q[torch.arange(a, b), torch.tensor(draft[a:b])].prod()
    assert torch.allclose(rows[0, proposal.ids[0]], prod)  # eq. 1
    prefix = tr.map.d2t[draft[a]]
    if prefix >= 0:  # eq. 2: the prefix sub-token keeps q(d_a) - prod q(d_j)
        assert torch.allclose(rows[0, prefix], (q[a, draft[a]] - prod).clamp_min(0))


def test_resync_keeps_matching_prefix_and_encodes_only_the_tail(
    draft_tokenizer, target_tokenizer, draft_codec, target_codec
):
    tr = _translator(draft_tokenizer, target_tokenizer, draft_codec, target_codec, "text")
    draft = draft_codec.encode(b" sold 48 clips")
    committed = draft_codec.token_bytes.join(draft[:2]) + b" apples"
    keep, tail = tr.resync(draft, committed)
    assert keep == 2 and draft_codec.token_bytes.join(draft[:keep] + tail) == committed


def test_direct_translation_depends_on_nothing_but_each_token(
    draft_tokenizer, target_tokenizer, draft_codec, target_codec
):
    """`exact` sampling: token i of the proposal is d2t[d_i], whatever follows it."""
    tr = _translator(draft_tokenizer, target_tokenizer, draft_codec, target_codec, "text")
    draft = draft_codec.encode(b" Natalia sold clips")
    tr.learn(draft, target_codec.encode(b" Natalia sold clips"))
    proposal = tr.translate(draft, only="direct")
    assert proposal.ids.tolist() == [int(tr.map.d2t[d]) for d in draft]
    assert all(s == Source.DIRECT for s in proposal.sources)
    with pytest.raises(ValueError, match="only"):
        tr.translate(draft, only="sometimes")


def test_healing_candidates_match_a_naive_scan_of_both_vocabularies(draft_codec, target_codec):
    from omnidraft.translate.healing import Healer

    d_table, t_table = draft_codec.token_bytes.table, target_codec.token_bytes.table
    healer = Healer(draft_codec.token_bytes, target_codec.token_bytes)
    some = [i for i, d in enumerate(d_table) if d and any(o and o != d and o.startswith(d) for o in d_table)][
        :40
    ]
    for token in some + [draft_codec.encode(b" ")[0], draft_codec.encode(b"\n")[0]]:
        held = d_table[token]
        for last in (None, held, b"\n", b" the"):
            naive = torch.tensor(
                [
                    bool(d)
                    and d.startswith(held)
                    and (
                        len(d) == len(held)
                        or last is None
                        or not any(t and t.startswith(last + d[len(held) : len(held) + 1]) for t in t_table)
                    )
                    for d in d_table
                ]
            )
            got = healer.candidates(token, last)
            if not any(len(d_table[i]) > len(held) for i in naive.nonzero().flatten().tolist()):
                assert got is None, (held, last)
            else:
                assert torch.equal(got, naive), (held, last)
    assert (
        healer.candidates(next(i for i, d in enumerate(d_table) if d is None), None) is None
    )  # a special token


@pytest.mark.parametrize("text", [" the answer is 48/2 = 24 clips", " and then:\n    return x\n"])
def test_a_healed_draft_proposes_only_the_bytes_after_the_held_ones(
    draft_tokenizer, target_tokenizer, draft_codec, target_codec, text
):
    tr = _translator(draft_tokenizer, target_tokenizer, draft_codec, target_codec, "text")
    draft = draft_codec.encode(text.encode())
    held = len(draft_codec.token_bytes.table[draft[0]]) - 1  # all but the first token's last byte committed
    assert held >= 1, "pick a text whose first drafter token has several bytes"
    proposal = tr.translate(draft, skip=held)
    assert target_codec.token_bytes.join(proposal.ids.tolist()) == text.encode()[held:]
    assert (
        proposal.spans[0] is None or proposal.spans[0][0] >= 1
    )  # the first token does not line up with the draft's start
    with pytest.raises(ValueError, match="only='any'"):
        tr.translate(draft, skip=1, only="direct")


@pytest.mark.parametrize("policy", ["lfu", "lfu-da", "lru"])
def test_a_reloaded_cache_evicts_what_the_saved_one_would_have(policy, tmp_path):
    """Use counts, priorities, the aging level and recency survive a save: after a reload the same
    traffic evicts the same entries (a list of entries alone would restart every count at one)."""
    cache = NgramCache(NgramCacheConfig(max_entries=12, policy=policy), fingerprint="d:t")
    for i in range(20):  # evictions under way, so LFU-DA's age has risen
        cache.add((1, i), i)
        for _ in range(i % 4 if (1, i) in cache else 0):  # (plain LFU may evict a newcomer at once)
            cache.use((1, i))
    cache.save(tmp_path / "c.json")
    back = NgramCache.load(tmp_path / "c.json", fingerprint="d:t")
    assert back.items() == cache.items() and back.stats() == cache.stats()
    for i in range(6):
        for c in (cache, back):
            c.add((2, i), 50 + i)
            if i % 2 and (2, i) in c:
                c.use((2, i))
    assert back.items() == cache.items() and back.evictions == cache.evictions


def test_a_version_1_cache_file_still_loads_and_a_malformed_entry_is_refused(tmp_path):
    old = {
        "format": "omnidraft.ngram_cache",
        "version": 1,
        "fingerprint": "d:t",
        "stats": {},
        "config": {"max_entries": 10, "max_bytes": 4096, "policy": "lfu", "max_len": 8},
        "entries": [[[1, 2], 5], [[3, 4], 6]],
    }
    (tmp_path / "v1.json").write_text(json.dumps(old))
    assert sorted(NgramCache.load(tmp_path / "v1.json").items()) == [((1, 2), 5), ((3, 4), 6)]
    (tmp_path / "bad.json").write_text(json.dumps({**old, "version": 2, "entries": [[[1, 2], "x"]]}))
    with pytest.raises(CorruptFileError, match="malformed n-gram cache entry"):
        NgramCache.load(tmp_path / "bad.json")
