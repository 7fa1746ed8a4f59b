"""atomic.py: crash-safe writes keep the replaced file's permissions."""

from __future__ import annotations

import os
import stat

from omnidraft.atomic import atomic_write_bytes


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
