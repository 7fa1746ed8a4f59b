"""atomic.py: crash-safe writes keep the replaced file's permissions, and land whole or not at all."""

from __future__ import annotations

import os
import stat

import pytest

from omnidraft.atomic import atomic_path, atomic_write_bytes


def test_new_files_get_the_umask_default_and_rewrites_keep_the_mode(tmp_path):
    path = tmp_path / "state.bin"
    atomic_write_bytes(path, b"one")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    path.chmod(0o600)
    atomic_write_bytes(path, b"two")
    assert path.read_bytes() == b"two" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


def test_a_path_written_by_another_writer_lands_whole_or_not_at_all(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="writer died"):
        with atomic_path(path) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("writer died")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
    with atomic_path(path) as tmp:
        tmp.write_bytes(b"new")
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def test_a_directory_is_replaced_whole_and_the_old_one_comes_back_if_the_new_one_cannot(tmp_path, monkeypatch):
    final = tmp_path / "adapter"
    with atomic_path(final, directory=True) as tmp:
        (tmp / "weights").write_bytes(b"v1")
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "weights"]
    with atomic_path(final, directory=True) as tmp:
        (tmp / "weights").write_bytes(b"v2")
    assert [p.name for p in final.iterdir()] == ["weights"] and (final / "weights").read_bytes() == b"v2"

    real, calls = os.replace, []

    def failing_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the old directory is aside; the new one fails to arrive
            raise OSError("disk gone")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", failing_second_rename)
    with pytest.raises(OSError, match="disk gone"):
        with atomic_path(final, directory=True) as tmp:
            (tmp / "weights").write_bytes(b"v3")
    monkeypatch.setattr(os, "replace", real)
    assert (final / "weights").read_bytes() == b"v2" and [p.name for p in tmp_path.iterdir()] == ["adapter"]
