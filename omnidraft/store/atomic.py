"""Crash-safe file writes: every adapter, head, cache and profile goes through here."""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_path", "atomic_write_bytes", "build_lock", "fsync_dir", "recover"]

STALE_S = 3600.0
"""A hidden temporary beside a path that nothing has written for this long is a killed writer's
leftover: the next write of that path deletes it (a converted model's half can be gigabytes)."""


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


_DEFAULT_MODE = 0o666 & ~_umask()  # what open() would give a new file
_DEFAULT_DIR_MODE = 0o777 & ~_umask()  # and mkdir() a new directory


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to a temp file beside `path`, fsync it, and rename it into place.

    The file keeps the mode of the one it replaces (a new file gets the umask default), so a
    rewrite never changes who may read the user's state.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
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


@contextmanager
def build_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive lock for building `path` once: callers check whether `path` exists inside
    the block, so two processes that want the same cached model at once build it once (the second
    waits, then finds it). The lock is a small hidden file beside `path`, left in place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(path.parent / f".{path.name}.lock")):
        yield


@contextmanager
def atomic_path(path: str | os.PathLike[str], *, directory: bool = False) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that needs a path of its own (llama.cpp's
    quantizer, an ONNX export, `save_pretrained`): a file, or with `directory=True` an empty
    directory. When the block ends cleanly everything in it is fsynced and renamed over `path`;
    when it raises, the temporary is removed and `path` is untouched. A directory it replaces is
    moved aside before the new one is renamed in and deleted only after, so a crash between the two
    renames leaves the old directory under a hidden `.old` name rather than nothing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    prefix = f".{path.name}."
    if directory:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=prefix, suffix=".tmp"))
        tmp.chmod(_DEFAULT_DIR_MODE)  # mkdtemp makes it private
    else:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        tmp.chmod(_DEFAULT_MODE)
    aside = None
    try:
        yield tmp
        _fsync_tree(tmp)
        if directory and path.exists():
            aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=prefix, suffix=".old"))
            os.replace(path, aside)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        if aside is not None and not path.exists():
            os.replace(aside, path)  # the new one never arrived: the old one goes back
            aside = None
        raise
    finally:
        if aside is not None:
            _remove(aside)
    fsync_dir(path.parent)


def recover(path: str | os.PathLike[str], stale_s: float = STALE_S) -> Path:
    """Undo what a killed writer of `path` left beside it, and return `path`.

    A replacement killed between its two renames leaves `path` missing and the old copy under a
    hidden `.old` name: it is renamed back, so the reader finds what the user had. Temporaries
    (`.tmp`) and moved-aside copies that nothing has touched for `stale_s` seconds are deleted; a
    younger one may belong to a writer still at work and is left alone. Readers of a directory
    written by `atomic_path` call this before they look; every write calls it first.
    """
    path = Path(path)
    ours = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.(tmp|old)")  # tempfile's names
    try:
        leftovers = [p for p in path.parent.iterdir() if ours.fullmatch(p.name)]
    except FileNotFoundError:
        return path
    olds = sorted((p for p in leftovers if p.suffix == ".old"), key=_last_written, reverse=True)
    if olds and not os.path.lexists(path):
        os.replace(olds[0], path)
        fsync_dir(path.parent)
        leftovers.remove(olds[0])
    now = time.time()
    for p in leftovers:
        if now - _last_written(p) > stale_s:
            _remove(p)
    return path


def _last_written(path: Path) -> float:
    """The newest modification time of a file, or of anything under a directory."""
    try:
        newest = path.lstat().st_mtime
        if path.is_dir() and not path.is_symlink():
            for root, dirs, files in os.walk(path):
                for name in dirs + files:
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    except FileNotFoundError:  # another process finished with it meanwhile
        return time.time()
    return newest


def _fsync_tree(path: Path) -> None:
    """fsync a file, or every file and directory under `path`."""
    if not path.is_dir():
        with path.open("rb") as fh:
            os.fsync(fh.fileno())
        return
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(root))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
