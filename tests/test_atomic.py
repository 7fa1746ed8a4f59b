"""atomic.py: crash-safe writes keep the replaced file's permissions, and land whole or not at all."""

from __future__ import annotations

import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest

from omnidraft.store.atomic import STALE_S, atomic_path, atomic_write_bytes, build_lock, recover


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


def test_a_directory_is_replaced_whole_and_the_old_one_comes_back_if_the_new_one_cannot(
    tmp_path, monkeypatch
):
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


def test_a_killed_writers_leftovers_are_undone_by_the_next_reader_or_writer(tmp_path):
    final = tmp_path / "adapter"
    with atomic_path(final, directory=True) as tmp:
        (tmp / "weights").write_bytes(b"v1")
    # killed between its two renames: the old directory aside, the new one never arrived
    aside = tmp_path / ".adapter.k1ll3d_1.old"
    os.replace(final, aside)
    assert recover(final) == final and (final / "weights").read_bytes() == b"v1"
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]

    old = time.time() - STALE_S - 60
    stale = tmp_path / ".adapter.abcd1234.tmp"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "half.bin").write_bytes(b"x" * 100)
    for p in (stale / "sub" / "half.bin", stale / "sub", stale):
        os.utime(p, (old, old))
    busy = tmp_path / ".adapter.zzzz9999.tmp"  # another writer at work: recently written
    busy.mkdir()
    (busy / "part.bin").write_bytes(b"y")
    os.utime(busy, (old, old))
    other = tmp_path / ".adapter.json.abcd1234.tmp"  # a temporary of another path
    other.write_bytes(b"z")
    os.utime(other, (old, old))
    with atomic_path(final, directory=True) as tmp:
        (tmp / "weights").write_bytes(b"v2")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".adapter.json.abcd1234.tmp", ".adapter.zzzz9999.tmp", "adapter"]
    assert (final / "weights").read_bytes() == b"v2"

    leftover_file = tmp_path / ".state.bin.00000000.tmp"
    leftover_file.write_bytes(b"half")
    os.utime(leftover_file, (old, old))
    atomic_write_bytes(tmp_path / "state.bin", b"whole")
    assert not leftover_file.exists() and (tmp_path / "state.bin").read_bytes() == b"whole"


def _build_once(path: str, log: str) -> None:
    with build_lock(path):
        if not os.path.exists(path):
            with open(log, "a") as fh:
                fh.write("built\n")
            time.sleep(0.3)  # long enough for the other process to arrive and wait
            atomic_write_bytes(Path(path), b"model")


def test_two_processes_that_want_the_same_cached_file_build_it_once(tmp_path):
    path, log = tmp_path / "converted", tmp_path / "log"
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=_build_once, args=(str(path), str(log))) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert [w.exitcode for w in workers] == [0, 0]
    assert log.read_text() == "built\n" and path.read_bytes() == b"model"
