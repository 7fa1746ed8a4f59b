"""profiles.py: save/load equality, crash safety, fingerprint refusal, export/import."""

from __future__ import annotations

import time

import pytest
import torch

from omnidraft.errors import CorruptFileError, IncompatibleError
from omnidraft.store.profiles import PairingProfile, ProfileStore
from omnidraft.translate.ngram_cache import NgramCache


def _profile(steps: int = 3) -> PairingProfile:
    cache = NgramCache(fingerprint="d:t")
    cache.add((1, 2), 9)
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        cache.save(Path(tmp) / "c.json")
        doc = json.loads((Path(tmp) / "c.json").read_text())
    g = torch.Generator().manual_seed(steps)
    return PairingProfile(
        drafter="smollm2-135m",
        target="qwen2.5-coder-0.5b",
        user="alice",
        fingerprint="d:t",
        steps=steps,
        metrics=[{"step": steps, "acceptance_rate": 0.5}],
        ngram=doc,
        tensors={"adapter": {"lora_A": torch.randn(4, 8, generator=g), "lora_B": torch.zeros(8, 4)}},
    )


def test_save_load_round_trip(tmp_path):
    store = ProfileStore(tmp_path)
    saved = _profile()
    store.save(saved)
    back = store.load("smollm2-135m", "qwen2.5-coder-0.5b", "alice", fingerprint="d:t")
    assert back.steps == 3 and back.metrics == saved.metrics and back.ngram == saved.ngram
    assert torch.equal(back.tensors["adapter"]["lora_A"], saved.tensors["adapter"]["lora_A"])
    assert store.load("smollm2-135m", "qwen2.5-coder-0.5b", "bob") is None


def test_a_save_killed_midway_leaves_the_previous_profile_loadable(tmp_path, monkeypatch):
    store = ProfileStore(tmp_path)
    store.save(_profile(steps=1))
    import omnidraft.store.profiles as profiles

    real = profiles.atomic_write_bytes

    def dies_on_meta(path, data):
        if path.name == "meta.json":
            raise KeyboardInterrupt("killed")
        real(path, data)

    monkeypatch.setattr(profiles, "atomic_write_bytes", dies_on_meta)
    with pytest.raises(KeyboardInterrupt):
        store.save(_profile(steps=2))
    monkeypatch.setattr(profiles, "atomic_write_bytes", real)
    assert store.load("smollm2-135m", "qwen2.5-coder-0.5b", "alice").steps == 1
    store.save(_profile(steps=5))  # the next save cleans up after the crash
    assert store.load("smollm2-135m", "qwen2.5-coder-0.5b", "alice").steps == 5


def test_mismatched_tokenizers_are_refused(tmp_path):
    store = ProfileStore(tmp_path)
    store.save(_profile())
    with pytest.raises(IncompatibleError, match="another drafter/target version"):
        store.load("smollm2-135m", "qwen2.5-coder-0.5b", "alice", fingerprint="x:y")


def test_export_import_moves_a_profile_between_stores(tmp_path):
    a, b = ProfileStore(tmp_path / "a"), ProfileStore(tmp_path / "b")
    a.save(_profile())
    file = a.export("smollm2-135m", "qwen2.5-coder-0.5b", "alice", tmp_path / "alice.tar")
    moved = b.import_file(file, user="alice-laptop")
    assert moved.user == "alice-laptop"
    assert b.load("smollm2-135m", "qwen2.5-coder-0.5b", "alice-laptop").ngram == _profile().ngram
    (tmp_path / "junk.tar").write_bytes(b"not a tar")
    with pytest.raises(CorruptFileError, match="not an exported omnidraft profile"):
        b.import_file(tmp_path / "junk.tar")


@pytest.mark.parametrize("bad", ["", "x" * 321, None, 3])
def test_user_ids_are_checked(tmp_path, bad):
    with pytest.raises(ValueError, match="user id must be"):
        ProfileStore(tmp_path).path("d", "t", bad)


def test_any_user_id_maps_injectively_to_a_safe_directory(tmp_path):
    """E-mail addresses and ids with separators or newlines are user ids too: each gets its own
    directory inside the store, never one another id has."""
    store = ProfileStore(tmp_path)
    users = [
        "alice@example.com",
        "alice_example.com",
        "../etc",
        "a/b",
        "x" * 101,
        "alice\n",
        "alice",
        "a-h-b",
    ]
    paths = [store.path("d", "t", u) for u in users]
    assert len(set(paths)) == len(users)
    assert all(
        p.parent == tmp_path / "d" / "t" and "/" not in p.name and p.name not in ("..", ".") for p in paths
    )
    profile = _profile()
    profile.user = "alice@example.com"
    store.save(profile)
    assert store.load("smollm2-135m", "qwen2.5-coder-0.5b", "alice@example.com").steps == profile.steps


def test_hf_ids_and_paths_as_model_names_get_their_own_profile_directories(tmp_path):
    """Any model spec works with user=: "Qwen/Qwen2.5-0.5B" used to fail the name check."""
    from omnidraft.store.profiles import model_dir_name

    store = ProfileStore(tmp_path)
    specs = [
        "Qwen/Qwen2.5-0.5B",
        "Qwen_Qwen2.5-0.5B",
        "./my-drafter",
        "../my-drafter",
        "/abs/path/m.gguf",
        "smollm2-135m",
        "x" * 150,
        "x" * 151,
    ]
    dirs = [model_dir_name(s) for s in specs]
    assert len(set(dirs)) == len(specs) and dirs[-3] == "smollm2-135m"
    for d in dirs:
        assert "/" not in d and d not in (".", "..") and len(d) <= 100
        assert store.path(d, "t", "alice").parent.parent.parent == tmp_path  # no escape from the store
    profile = _profile()
    profile.drafter, profile.target = "./my-drafter", "Qwen/Qwen2.5-0.5B"
    store.save(profile)
    assert store.load("./my-drafter", "Qwen/Qwen2.5-0.5B", "alice").target == "Qwen/Qwen2.5-0.5B"
    assert store.load("../my-drafter", "Qwen/Qwen2.5-0.5B", "alice") is None


PROFILE = ("smollm2-135m", "qwen2.5-coder-0.5b", "alice")


def _writer(root: str, first_step: int, saves: int) -> None:
    store = ProfileStore(root)
    for i in range(saves):
        store.save(_profile(steps=first_step + i))


def test_two_writers_and_a_reader_never_see_a_half_written_profile(tmp_path):
    """Two processes save the same profile 150 times each while this one reads it: every read is a
    complete version (never a false "not a complete profile"), and the profile loads at the end."""
    import multiprocessing

    store = ProfileStore(tmp_path)
    store.save(_profile(steps=0))
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), start, 150)) for start in (1, 1001)]
    for w in writers:
        w.start()
    reads = 0
    while any(w.is_alive() for w in writers):
        profile = store.load(*PROFILE, fingerprint="d:t")
        assert profile is not None and profile.tensors["adapter"]["lora_A"].shape == (4, 8)
        reads += 1
        time.sleep(0.002)  # reads between saves, not a spin that starves the writers of the core
    for w in writers:
        w.join()
        assert w.exitcode == 0
    home = store.path(*PROFILE)
    final = store.load(*PROFILE, fingerprint="d:t")
    assert final.steps in (150, 1150) and reads > 0
    assert len(list(home.glob("v*"))) == 2 and not list(home.glob(".*.tmp"))  # the last two versions kept
    numbers = sorted(int(v.name[1:]) for v in home.glob("v*"))
    assert numbers[-1] == 301  # one version per save: no two writers picked the same number


def _learning_user(root: str, seed: int, requests: int) -> None:
    """One process of user "pat": a learning pairing that saves its profile after every request."""
    from omnidraft import LocalTarget, TorchDrafter
    from omnidraft.distill.trainer import TrainConfig
    from tests.conftest import gsm8k_texts, tiny_llama, train_bpe

    texts = gsm8k_texts()
    dt, tt = train_bpe(400, texts), train_bpe(700, texts)
    target = LocalTarget(tiny_llama(len(tt), seed=1, logit_scale=30.0), tt, "tiny-target")
    drafter = TorchDrafter(tiny_llama(len(dt), seed=2, logit_scale=30.0), dt, "tiny-drafter")
    torch.manual_seed(seed)
    train = TrainConfig(interval=1, lr=1e-2, cpu_share=0)
    pair = drafter.pair(target, k=4, user="pat", learn=True, store=ProfileStore(root), train=train)
    for i in range(requests):
        pair.generate(f"Question: Tom has {seed} apples and buys {i} more.", max_new_tokens=12)
        pair.save()


def test_two_learning_processes_of_one_user_leave_a_whole_profile(tmp_path, draft_tokenizer, tiny_target):
    """Two processes of one user learn and save the same profile at once: both finish, and the
    profile loads whole (one process's last save) into a pairing that still drafts losslessly."""
    import multiprocessing

    from omnidraft import TorchDrafter

    from .conftest import target_greedy, tiny_llama

    ctx = multiprocessing.get_context("spawn")
    users = [ctx.Process(target=_learning_user, args=(str(tmp_path), seed, 6)) for seed in (1, 2)]
    for u in users:
        u.start()
    for u in users:
        u.join(timeout=300)
        assert u.exitcode == 0
    store = ProfileStore(tmp_path)
    profile = store.load("tiny-drafter", "tiny-target", "pat", fingerprint=None)
    assert profile is not None and profile.steps >= 6 and "adapter" in profile.tensors
    drafter = TorchDrafter(
        tiny_llama(len(draft_tokenizer), seed=2, logit_scale=30.0), draft_tokenizer, "tiny-drafter"
    )  # (a fresh one: learning wraps a drafter)
    pair = drafter.pair(tiny_target, k=4, user="pat", learn=True, store=store)
    assert pair.steps == profile.steps
    prompt = "Question: A train travels 60 miles in 2 hours."
    assert pair.generate(prompt, max_new_tokens=16).token_ids == target_greedy(tiny_target, prompt, 16)


def test_a_broken_current_falls_back_to_the_previous_version(tmp_path):
    store = ProfileStore(tmp_path)
    store.save(_profile(steps=1))
    second = store.save(_profile(steps=2))
    import shutil

    shutil.rmtree(second)  # CURRENT now names a deleted version
    assert store.load(*PROFILE).steps == 1
    store.save(_profile(steps=3))  # and saving still works
    assert store.load(*PROFILE).steps == 3
    (store.path(*PROFILE) / "CURRENT").write_text("garbage")
    assert store.load(*PROFILE).steps == 3


def test_a_corrupt_current_version_falls_back_to_the_previous_one(tmp_path):
    """Reliability defect 7: a corrupt current version blocked loading although the version before
    it (kept for exactly this) was intact."""
    store = ProfileStore(tmp_path)
    store.save(_profile(steps=1))
    second = store.save(_profile(steps=2))
    for tensors in second.glob("*.safetensors"):
        tensors.write_bytes(tensors.read_bytes()[:20])  # torn
    assert store.load(*PROFILE).steps == 1


def test_leftovers_of_killed_saves_are_cleaned_and_missing_keys_name_the_file(tmp_path):
    import json

    store = ProfileStore(tmp_path)
    version = store.save(_profile(steps=1))
    home = version.parent
    (home / ".CURRENT.abc.tmp").write_bytes(b"v0000")
    (home / "v000009").mkdir()  # a version that never got its meta.json
    store.save(_profile(steps=2))
    assert not (home / ".CURRENT.abc.tmp").exists() and not (home / "v000009").exists()
    current = home / (home / "CURRENT").read_text()
    for kept in home.glob("v*"):  # no version to fall back to: the corrupt one's error is raised
        if kept != current:
            __import__("shutil").rmtree(kept)
    meta = json.loads((current / "meta.json").read_text())
    del meta["steps"]
    (current / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CorruptFileError, match="'steps' is missing") as err:
        store.load(*PROFILE)
    assert str(current) in str(err.value)


def test_adapter_names_are_injective():
    from omnidraft import TorchDrafter as Drafter

    users = ["a.b", "a_b", "a-b", "a__b", None, "default"]
    names = {Drafter.adapter_name("qwen", u) for u in users} | {
        Drafter.adapter_name("qwen_x", "y"),
        Drafter.adapter_name("qwen", "x_y"),
    }
    assert len(names) == len(users) + 2  # the anonymous pairing (None) shares with no named user
    assert all(n.replace("_", "").isalnum() for n in names)


def test_users_on_one_drafter_never_share_adapter_weights(draft_tokenizer, tiny_target, tmp_path):
    """Users "a.b" and "a_b" used to map to one adapter name, and the second drafted with (and saved)
    the first's weights."""
    from omnidraft import TorchDrafter as Drafter
    from omnidraft.distill.adapters import adapter_state

    from .conftest import tiny_llama

    drafter = Drafter(
        tiny_llama(len(draft_tokenizer), seed=2, logit_scale=30.0), draft_tokenizer, "tiny-drafter"
    )
    store = ProfileStore(tmp_path)
    a, b = (drafter.pair(tiny_target, user=u, learn=True, store=store) for u in ("a.b", "a_b"))
    assert a.adapter != b.adapter
    with torch.no_grad():
        for name, param in drafter.trainable.named_parameters():
            if f".{a.adapter}." in name and "lora_B" in name:
                param.fill_(0.5)  # only user a.b's adapter moves
    moved = {k: v for k, v in adapter_state(drafter.trainable, a.adapter).items() if "lora_B" in k}
    kept = {k: v for k, v in adapter_state(drafter.trainable, b.adapter).items() if "lora_B" in k}
    assert moved and all(bool((v == 0.5).all()) for v in moved.values())
    assert kept and all(float(v.abs().sum()) == 0.0 for v in kept.values())
    b.save()
    assert all(
        float(v.abs().sum()) == 0.0
        for k, v in store.load("tiny-drafter", tiny_target.name, "a_b").tensors["adapter"].items()
        if "lora_B" in k
    )


def test_a_profile_keeps_none_of_a_users_text_when_asked(tiny_drafter, tiny_target, tmp_path):
    """Retention: `history_tokens=0` keeps no output text in the user's profile; a small value keeps
    only the newest tokens."""
    from omnidraft import RetrievalConfig

    store = ProfileStore(tmp_path)
    for kept, expect in ((0, None), (8, 8)):
        pair = tiny_drafter.pair(
            tiny_target, user=f"u{kept}", store=store, k=3, retrieval=RetrievalConfig(history_tokens=kept)
        )
        pair.generate("Question: Tom has 3 apples", max_new_tokens=16)
        version = pair.save()
        has = (version / "history.json").exists()
        assert has == (expect is not None)
        if has:
            back = store.load(tiny_drafter.name, tiny_target.name, f"u{kept}")
            assert sum(len(d) for d in back.history["docs"]) <= expect
