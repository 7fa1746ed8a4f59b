"""Crash-safe file writes: every adapter, head, cache and profile goes through here."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

__all__ = ["atomic_write_bytes", "fsync_dir"]


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


_DEFAULT_MODE = 0o666 & ~_umask()  # what open() would give a new file


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to a temp file beside `path`, fsync it, and rename it into place.

    The file keeps the mode of the one it replaces (a new file gets the umask default), so a
    rewrite never changes who may read the user's state.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = _DEFAULT_MODE
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # the rename itself survives a power cut only once the directory is synced


def fsync_dir(path: Path) -> None:
    """fsync a directory, so the names created or renamed in it are durable (a no-op where the
    platform cannot open a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
