"""Shortlisted drafter heads (static / EvoSpec / DynaSpec): logits on the support equal the full
head's, greedy output stays the target's, `exact` sampling keeps the target's distribution."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import omnidraft as od
from omnidraft.runtime.int8 import quantize_int8
from omnidraft.shortlist.shortlisted_head import ShortlistHead, install
from omnidraft.shortlist.supports import Dyna, Evo, Static

from .conftest import assert_first_tokens_follow, gsm8k_texts, target_greedy, tiny_llama, train_bpe

PROMPTS = ["Question: Tom has 3 apples and buys 5 more.", "def add(a, b):\n    return"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))


def _policies(head, vocab: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    core = torch.randperm(vocab, generator=g)[: vocab // 3]
    clusters = list(torch.randperm(vocab, generator=g).chunk(8))
    router = torch.nn.Linear(head.in_features, 8)
    evo = Evo(head, core, capacity=16)
    evo.begin(torch.randperm(vocab, generator=g)[:40].tolist())
    return {
        "static": Static(head, core),
        "evo": evo,
        "dyna": Dyna(head, core[:10], clusters, router, budget=(3, 2)),
    }


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_shortlisted_logits_equal_the_full_heads_on_the_support(draft_tokenizer, precision):
    model = tiny_llama(len(draft_tokenizer), seed=3, logit_scale=30.0)
    if precision == "int8":
        model = quantize_int8(model)
    head = model.get_output_embeddings()
    x = torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(1))
    full = head(x)
    for name, policy in _policies(head, len(draft_tokenizer)).items():
        short = ShortlistHead(head, len(draft_tokenizer), policy)(x)
        support = torch.isfinite(short[0, -1])
        assert 0 < int(support.sum()) < len(draft_tokenizer), name
        diff = float((short[..., support] - full[..., support]).abs().max())
        # int8: the same int8 rows and scales, integer accumulation: bit for bit. fp32: the same rows, but a
        # GEMM over fewer rows may sum in another order (measured up to 1.2e-7 here)
        assert diff == 0.0 if precision == "int8" else diff <= 1e-6, (name, diff)


@pytest.mark.parametrize("kind", ["static", "evo", "dyna"])
def test_greedy_output_stays_the_targets_with_every_policy(draft_tokenizer, tiny_target, kind):
    drafter = od.TorchDrafter(
        tiny_llama(len(draft_tokenizer), seed=2, logit_scale=30.0), draft_tokenizer, "tiny-drafter"
    )
    drafter.use_shortlist(kind, size=120, clusters=8, budget=(3, 2))
    assert isinstance(drafter.model.get_output_embeddings(), ShortlistHead)
    pair = drafter.pair(tiny_target, k=4)
    for prompt in PROMPTS:
        assert pair.generate(prompt, max_new_tokens=24).token_ids == target_greedy(tiny_target, prompt, 24)
    assert max(drafter.head.support_sizes) < len(draft_tokenizer)
    drafter.use_shortlist(None)
    assert not isinstance(drafter.model.get_output_embeddings(), ShortlistHead)


def test_exact_sampling_keeps_the_targets_distribution_with_a_shortlist():
    """As test_pairing's chi-square test, with a drafter that drafts from a third of its vocabulary."""
    tok_d, tok_t = train_bpe(300, gsm8k_texts(n=300)), train_bpe(330, gsm8k_texts(n=300))
    target = od.LocalTarget(tiny_llama(len(tok_t), seed=5, logit_scale=8.0), tok_t, "t")
    drafter = od.TorchDrafter(tiny_llama(len(tok_d), seed=5, logit_scale=8.0), tok_d, "d")
    install(drafter.model, Static(drafter.model.get_output_embeddings(), torch.arange(0, len(tok_d), 3)))
    pair = drafter.pair(target, k=3, mode="exact", temperature=1.0)
    gen = torch.Generator().manual_seed(11)
    prompt = "Question: how many"
    n = 1500
    counts = Counter(pair.generate(prompt, max_new_tokens=2, generator=gen).token_ids[0] for _ in range(n))
    assert_first_tokens_follow(target, prompt, counts)


def test_the_evo_buffer_recalls_the_context_and_stays_bounded():
    head = torch.nn.Linear(8, 100)
    evo = Evo(head, torch.arange(10), capacity=5)
    evo.begin([1, 2, 50, 50, 60])  # 1, 2 are core
    assert set(evo.counts) == {50, 60}
    evo.observe([70, 71, 72, 73, 74, 50])
    assert len(evo.counts) == 5 and 50 in evo.counts  # the most frequent stays
    ids = torch.cat([b.ids for b in evo.blocks(torch.zeros(1, 8), 0)])
    assert set(ids.tolist()) == set(range(10)) | set(evo.counts)


def test_the_evo_buffer_keeps_the_users_history_behind_the_running_request():
    """Across requests the buffer keeps what earlier ones used (aged), but a new request's context
    always gets in: a full buffer of older, more frequent tokens does not lock it out."""
    head = torch.nn.Linear(8, 100)
    evo = Evo(head, torch.arange(10), capacity=4)
    evo.begin([50] * 8 + [51] * 8 + [52] * 4 + [53] * 4)  # an earlier request, frequent tokens
    evo.begin([60, 61])  # the next one: its context enters ahead of the history
    assert {60, 61} <= set(evo.counts) and len(evo.counts) == 4 and {50, 51} <= set(evo.counts)
    assert evo.counts[50] == 4  # aged: halved once
    evo.observe([62, 63, 64])  # the running request outranks every older token, the newest first
    assert set(evo.counts) == {61, 62, 63, 64}
    aging = Evo(head, torch.arange(10), capacity=2)
    aging.begin([70] * 4 + [71])
    seen = []
    for _ in range(3):  # requests that never use 70 again age it, 4 -> 2 -> 1 -> 0.5 ...
        aging.begin([])
        seen.append(aging.counts.get(70))
    assert seen == [2, 1, 0.5] and 71 in aging.counts  # ... and nothing leaves a buffer with room
    aging.begin([72])
    aging.observe([73])  # ... until it is full: the least used aged token leaves first
    assert set(aging.counts) == {72, 73}
    aging.begin([74])
    assert set(aging.counts) == {73, 74}


def test_a_bad_shortlist_kind_names_the_choices(tiny_drafter):
    with pytest.raises(ValueError, match="shortlist must be one of"):
        tiny_drafter.use_shortlist("tiny")


def test_shortlist_files_are_versioned_and_refused_when_they_do_not_fit(
    tiny_drafter, target_tokenizer, tmp_path
):
    """A shortlist kept beside the drafter is read back; one for another tokenizer, of another
    format or with a router of another width is refused with the reason; a bad cached one is rebuilt."""
    import io

    from omnidraft.shortlist.build import shortlist

    path = tmp_path / "drafter.shortlist.pt"
    built = shortlist(tiny_drafter, "dyna", size=256, clusters=8, path=path)
    again = shortlist(tiny_drafter, "dyna", size=256, clusters=8, path=path)
    assert torch.equal(built.core.ids, again.core.ids)
    other = od.TorchDrafter(tiny_llama(len(target_tokenizer), seed=3), target_tokenizer, "other")
    with pytest.raises(ValueError, match="another tokenizer"):
        shortlist(other, "static", size=256, clusters=8, path=path)
    saved = torch.load(io.BytesIO(path.read_bytes()), weights_only=True)
    for change, reason in [
        ({"format": 0}, "format"),
        ({"router": {"weight": torch.zeros(8, 3)}}, "router"),
        ({"core": torch.tensor([10**7])}, "vocabulary"),
    ]:
        bad = tmp_path / f"bad-{reason}.pt"
        torch.save({**saved, **change}, bad)
        with pytest.raises(ValueError, match=reason):
            shortlist(tiny_drafter, "dyna", size=256, clusters=8, path=bad)
    older = tmp_path / "format-2.pt"  # an older layout: its DynaSpec part is refused, its core still read
    torch.save({**saved, "format": 2}, older)
    with pytest.raises(ValueError, match="format"):
        shortlist(tiny_drafter, "dyna", size=256, clusters=8, path=older)
    assert torch.equal(
        shortlist(tiny_drafter, "static", size=256, path=older).core.ids, saved["core"].unique()
    )
    bad.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="unreadable"):
        shortlist(tiny_drafter, "static", size=256, path=bad)
    cached = shortlist(tiny_drafter, "static", size=256)  # the cache: built, then a corrupt copy rebuilt
    (file,) = (tmp_path / "shortlists").glob("*.pt")
    file.write_bytes(b"torn")
    assert torch.equal(shortlist(tiny_drafter, "static", size=256).core.ids, cached.core.ids)


def test_the_centroid_router_finds_the_cluster_of_the_full_heads_argmax(tiny_drafter):
    """DynaSpec's router scores a cluster of head rows by the hidden state's dot product with its
    centroid: its top clusters hold the full head's argmax far more often than the clusters' sizes
    would by chance, and the core is in no cluster."""
    from omnidraft.shortlist.build import shortlist

    model, m = tiny_drafter.model, 8
    policy = shortlist(tiny_drafter, "dyna", size=64, clusters=m)
    weight = model.get_output_embeddings().weight.detach().float()
    x = torch.randn(2000, weight.shape[1], generator=torch.Generator().manual_seed(0))
    best = (x @ weight.T).argmax(-1)
    outside = torch.ones(len(weight), dtype=torch.bool)
    outside[policy.core.ids] = False
    x, best = x[outside[best]], best[outside[best]]
    cluster_of = torch.full((len(weight),), -1)
    for c, block in enumerate(policy.clusters):
        if block is not None:
            assert not (~outside[block.ids]).any()
            cluster_of[block.ids] = c
    want = cluster_of[best]
    hit = (policy.router(x).topk(2, dim=-1).indices == want[:, None]).any(-1).float().mean()
    prior = float((torch.bincount(want, minlength=m).float() / len(want)).topk(2).values.sum())
    assert hit > prior + 0.2  # far better than always naming the two clusters the argmax falls in most


def test_healing_keeps_a_context_token_the_support_leaves_out(tiny_drafter):
    """Healing compares the held token's logit with longer candidates'; outside the support it has none,
    so the drafter keeps it (before, the first candidate in the support, or token 0, replaced it)."""
    table = tiny_drafter.token_bytes.table
    ids = tiny_drafter.codec.encode(b"She has 3 apples and ")
    held = table[ids[-1]]
    longer = torch.tensor([bool(d) and d.startswith(held) for d in table])  # held itself and the longer ones
    outside = torch.tensor([i for i in range(len(table)) if i != ids[-1]])
    install(tiny_drafter.model, Static(tiny_drafter.model.get_output_embeddings(), outside))
    try:
        draft = tiny_drafter.begin(ids).propose(3, stop_confidence=0, heal=longer)
        assert not draft.healed
        for i in longer.nonzero().flatten().tolist():  # nothing to compare with, whatever the candidates
            assert (
                not tiny_drafter.begin(ids)
                .propose(1, stop_confidence=0, heal=longer & (torch.arange(len(table)) != i))
                .healed
            )
    finally:
        tiny_drafter.model.set_output_embeddings(tiny_drafter.model.get_output_embeddings().full)


def test_the_shipped_corpus_is_the_checkouts_training_text():
    """The shortlist corpus ships in the package (a wheel has no data/); it must be what
    tools/shortlist_corpus.py writes from data/, byte for byte."""
    import importlib.util
    from pathlib import Path

    from omnidraft.shortlist.build import CORPUS, corpus

    spec = importlib.util.spec_from_file_location(
        "shortlist_corpus", Path(__file__).parents[1] / "tools" / "shortlist_corpus.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert corpus() == tool.texts()
    assert CORPUS.read_bytes() == tool.encode(tool.texts())
