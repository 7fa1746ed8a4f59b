"""On-disk pairing profiles: per (drafter, target, user) the state that makes a pairing faster.

A profile is a directory of versions plus a `CURRENT` pointer:

    <root>/<drafter>/<target>/<user>/CURRENT          "v000003"
                                    /v000003/meta.json    library version, tokenizer fingerprints, steps, metrics
                                    /v000003/ngram.json   the n-gram cache
                                    /v000003/*.safetensors  adapter / acceptance head tensors, when present

A save writes a complete new version, fsyncs it, then swaps `CURRENT` atomically and prunes old
versions, so a crash at any point leaves the previous profile loadable. Loading refuses a profile
whose tokenizer fingerprints differ from the pairing's. One profile exports to a single .tar file
(to move a user's personalization between devices). No training code here.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .atomic import atomic_write_bytes
from .errors import CorruptFileError, IncompatibleError

__all__ = ["PairingProfile", "ProfileStore"]

FORMAT = "omnidraft.profile"
VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass
class PairingProfile:
    """What a pairing keeps between sessions. `tensors` maps a file stem ("adapter", "head") to a
    dict of tensors; `ngram` is the n-gram cache document (see NgramCache.save)."""

    drafter: str
    target: str
    user: str
    fingerprint: str
    steps: int = 0
    metrics: list[dict[str, Any]] = field(default_factory=list)
    ngram: dict[str, Any] | None = None
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)


def _check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{kind} name must be 1-100 characters of letters, digits, '.', '_' or '-', got {value!r}")
    return value


class ProfileStore:
    """Profiles under `root` (default: $OMNIDRAFT_CACHE/profiles)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        if root is None:
            from .presets import cache_dir

            root = cache_dir() / "profiles"
        self.root = Path(root)

    def path(self, drafter: str, target: str, user: str) -> Path:
        return self.root / _check_name("drafter", drafter) / _check_name("target", target) / _check_name("user", user)

    def save(self, profile: PairingProfile) -> Path:
        """Write a new version of `profile` and make it current; returns its directory."""
        home = self.path(profile.drafter, profile.target, profile.user)
        home.mkdir(parents=True, exist_ok=True)
        current = self._current(home)
        number = int(current[1:]) + 1 if current else 1
        version = home / f"v{number:06d}"
        shutil.rmtree(version, ignore_errors=True)  # a leftover of a crashed save
        version.mkdir()
        _write_version(version, profile)
        atomic_write_bytes(home / "CURRENT", version.name.encode())
        for old in home.glob("v*"):
            if old.name != version.name:
                shutil.rmtree(old, ignore_errors=True)
        return version

    def load(self, drafter: str, target: str, user: str, *, fingerprint: str | None = None) -> PairingProfile | None:
        """The current profile, or None if there is none. A tokenizer mismatch raises IncompatibleError."""
        home = self.path(drafter, target, user)
        current = self._current(home)
        if current is None:
            return None
        profile = _read_version(home / current)
        if fingerprint is not None and profile.fingerprint != fingerprint:
            raise IncompatibleError(
                f"profile {home} was made for tokenizers {profile.fingerprint!r}, this pairing has {fingerprint!r}; "
                "it belongs to another drafter/target version"
            )
        return profile

    def export(self, drafter: str, target: str, user: str, out: str | os.PathLike[str]) -> Path:
        """Write the current profile as one .tar file."""
        home = self.path(drafter, target, user)
        current = self._current(home)
        if current is None:
            raise FileNotFoundError(f"no profile at {home}")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.add(home / current, arcname="profile")
        atomic_write_bytes(Path(out), buffer.getvalue())
        return Path(out)

    def import_file(self, path: str | os.PathLike[str], *, user: str | None = None) -> PairingProfile:
        """Install a profile exported by `export` (optionally under another user name)."""
        try:
            with tarfile.open(path) as tar:
                members = {m.name: m for m in tar.getmembers() if m.isfile() and m.name.startswith("profile/")}
                files = {Path(n).name: tar.extractfile(m).read() for n, m in members.items()}  # type: ignore[union-attr]
        except (tarfile.TarError, OSError) as exc:
            raise CorruptFileError(f"{path} is not an exported omnidraft profile: {exc}") from exc
        profile = _from_files(files, str(path))
        if user is not None:
            profile.user = _check_name("user", user)
        self.save(profile)
        return profile

    @staticmethod
    def _current(home: Path) -> str | None:
        try:
            name = (home / "CURRENT").read_text().strip()
        except FileNotFoundError:
            return None
        if not re.match(r"^v\d{6}$", name) or not (home / name / "meta.json").exists():
            raise CorruptFileError(f"{home}/CURRENT points at {name!r}, which is not a complete profile version")
        return name


def _write_version(version: Path, profile: PairingProfile) -> None:
    from safetensors.torch import save as save_tensors

    meta = {"format": FORMAT, "version": VERSION, "library": _library_version(), "drafter": profile.drafter,
            "target": profile.target, "user": profile.user, "fingerprint": profile.fingerprint,
            "steps": profile.steps, "metrics": profile.metrics, "tensors": sorted(profile.tensors)}
    for stem, tensors in profile.tensors.items():
        atomic_write_bytes(version / f"{_check_name('tensor file', stem)}.safetensors",
                           save_tensors({k: v.contiguous() for k, v in tensors.items()}))
    if profile.ngram is not None:
        atomic_write_bytes(version / "ngram.json", json.dumps(profile.ngram).encode())
    atomic_write_bytes(version / "meta.json", json.dumps(meta, indent=1).encode())  # last: marks the version complete


def _read_version(version: Path) -> PairingProfile:
    return _from_files({p.name: p.read_bytes() for p in version.iterdir() if p.is_file()}, str(version))


def _from_files(files: dict[str, bytes], where: str) -> PairingProfile:
    from safetensors.torch import load as load_tensors

    try:
        meta = json.loads(files["meta.json"])
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise CorruptFileError(f"{where}: not an omnidraft profile of format version {VERSION}")
        tensors = {stem: load_tensors(files[f"{stem}.safetensors"]) for stem in meta["tensors"]}
        ngram = json.loads(files["ngram.json"]) if "ngram.json" in files else None
    except (KeyError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptFileError(f"{where}: incomplete or corrupt profile ({exc})") from exc
    except Exception as exc:  # safetensors raises its own error type on a truncated file
        if isinstance(exc, CorruptFileError):
            raise
        raise CorruptFileError(f"{where}: unreadable tensors ({exc})") from exc
    return PairingProfile(drafter=meta["drafter"], target=meta["target"], user=meta["user"], fingerprint=meta["fingerprint"],
                          steps=meta["steps"], metrics=meta["metrics"], ngram=ngram, tensors=tensors)


def _library_version() -> str:
    from . import __version__

    return __version__
