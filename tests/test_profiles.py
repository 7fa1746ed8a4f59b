"""profiles.py: save/load equality, crash safety, fingerprint refusal, export/import."""

from __future__ import annotations

import pytest
import torch

from omnidraft.errors import CorruptFileError, IncompatibleError
from omnidraft.profiles import PairingProfile, ProfileStore
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
    return PairingProfile(drafter="smollm2-135m", target="qwen2.5-coder-0.5b", user="alice", fingerprint="d:t",
                          steps=steps, metrics=[{"step": steps, "acceptance_rate": 0.5}], ngram=doc,
                          tensors={"adapter": {"lora_A": torch.randn(4, 8, generator=g), "lora_B": torch.zeros(8, 4)}})


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
    import omnidraft.profiles as profiles

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


@pytest.mark.parametrize("bad", ["", "../etc", "a/b", "x" * 101])
def test_names_are_checked(tmp_path, bad):
    with pytest.raises(ValueError, match="name must be"):
        ProfileStore(tmp_path).path("d", "t", bad)
