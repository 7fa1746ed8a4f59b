"""On-disk pairing profiles: per (drafter, target, user) the state that makes a pairing faster.

A profile is a directory of versions plus a `CURRENT` pointer:

    <root>/<drafter>/<target>/<user>/CURRENT          "v000003"
                                    /v000003/meta.json    library version, tokenizer fingerprints, steps,
                                    metrics
                                    /v000003/ngram.json   the n-gram cache
                                    /v000003/history.json the user's past outputs (retrieval drafts)
                                    /v000003/*.safetensors  adapter / acceptance head tensors, when present

A save takes the profile's inter-process lock (`<user>/.lock`, filelock), writes a complete new
version, fsyncs its files and directory, swaps `CURRENT` atomically and keeps the last `KEEP`
versions, so a crash at any point leaves a loadable profile and two writers never interleave.
Readers take no lock: a version is complete before `CURRENT` names it, and a reader whose version
was pruned under it reads `CURRENT` again. A `CURRENT` that names no complete version falls back
to the newest complete one. Loading refuses a profile whose tokenizer fingerprints differ from the
pairing's. One profile exports to a single .tar file (to move a user's personalization between
devices). No training code here.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CorruptFileError, IncompatibleError
from .atomic import atomic_write_bytes, fsync_dir

__all__ = ["KEEP", "SHARED_USER", "PairingProfile", "ProfileStore", "model_dir_name", "pairing_profile"]

# the user whose profile of a (drafter, target) pair every user shares: its adapter is the baseline a
# user's own must score at least as well as before it drafts; `omnidraft export` without --user
SHARED_USER = "default"

log = logging.getLogger(__name__)

FORMAT = "omnidraft.profile"
VERSION = 1
KEEP = 2  # versions kept: a broken or pruned-under-a-reader CURRENT falls back to the one before
LOCK_TIMEOUT_S = 60.0
_NAME = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"
)  # fullmatch: "$" would also match before a trailing newline
_VERSION = re.compile(r"v\d{6}")
_READ_TRIES = 5


@dataclass
class PairingProfile:
    """What a pairing keeps between sessions. `tensors` maps a file stem ("adapter", "head") to a
    dict of tensors; `ngram` is the n-gram cache document (see NgramCache.save); `history` the
    datastore of the user's past outputs (see retrieve/datastore.py)."""

    drafter: str
    target: str
    user: str
    fingerprint: str
    steps: int = 0
    metrics: list[dict[str, Any]] = field(default_factory=list)
    ngram: dict[str, Any] | None = None
    history: dict[str, Any] | None = None
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)


def pairing_profile(pair: Any) -> PairingProfile:
    """What a pairing keeps for its user: adapter (with its alpha), acceptance head, n-gram cache,
    datastore of past outputs, metrics and optimizer steps (the caller waits for training first)."""
    import torch

    from ..distill.adapters import adapter_state

    tensors = {"head": head} if (head := pair.speculator.lengths.state()) is not None else {}
    if pair.adapter is not None:
        with pair.drafter.lock:
            alpha = pair.drafter.trainable.peft_config[pair.adapter].lora_alpha
            tensors["adapter"] = {
                **adapter_state(pair.drafter.trainable, pair.adapter),
                "meta.alpha": torch.tensor(alpha),
            }
    retriever = pair.speculator.retriever
    history = retriever.history if retriever is not None else None
    return PairingProfile(
        drafter=pair.drafter.name,
        target=pair.target.name,
        user=pair.user,
        fingerprint=pair.fingerprint,
        steps=pair.steps,
        metrics=pair.metrics + (pair.learner.metrics if pair.learner else []),
        ngram=pair.speculator.translator.cache.to_doc(),
        tensors=tensors,
        history=history.to_doc() if history is not None else None,
    )


def model_dir_name(value: str) -> str:
    """A directory name for a model spec, injective: a preset or plain name as it is, an HF id or
    a path ("Qwen/Qwen2.5-0.5B", "./my-drafter") as a readable part plus a hash of the whole spec."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"model name must be a non-empty string, got {value!r}")
    if _NAME.fullmatch(value) and "-h-" not in value:
        return value
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", value).strip("._-")[:60] or "model"
    return f"{readable}-h-{hashlib.sha256(value.encode()).hexdigest()[:12]}"


def _check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(
            f"{kind} name must be 1-100 characters of letters, digits, '.', '_' or '-', got {value!r}"
        )
    return value


class ProfileStore:
    """Profiles under `root` (default: $OMNIDRAFT_CACHE/profiles)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        if root is None:
            from .presets import cache_dir

            root = cache_dir() / "profiles"
        self.root = Path(root)

    def path(self, drafter: str, target: str, user: str) -> Path:
        """The profile's directory: model names of any form (preset, HF id, path) and user ids of
        any form (a plain name, an e-mail address, ...) map injectively to safe directory names."""
        if not isinstance(user, str) or not user or len(user) > 320:
            raise ValueError(f"user id must be a non-empty string of at most 320 characters, got {user!r}")
        return self.root / model_dir_name(drafter) / model_dir_name(target) / model_dir_name(user)

    def save(self, profile: PairingProfile) -> Path:
        """Write a new version of `profile` and make it current; returns its directory."""
        from filelock import FileLock, Timeout

        home = self.path(profile.drafter, profile.target, profile.user)
        home.mkdir(parents=True, exist_ok=True)
        try:
            with FileLock(home / ".lock", timeout=LOCK_TIMEOUT_S):
                return self._save_locked(home, profile)
        except Timeout:
            raise TimeoutError(
                f"profile {home} stayed locked by another writer for {LOCK_TIMEOUT_S:.0f} s"
            ) from None

    def entries(self) -> list[PairingProfile]:
        """Every current profile in the store (metadata and all), by directory."""
        out = []
        for meta in sorted(self.root.glob("*/*/*/CURRENT")):
            home = meta.parent
            if (current := self._current(home)) is not None:
                out.append(_read_version(home / current))
        return out

    def delete(self, drafter: str, target: str, user: str) -> bool:
        """Remove a user's profile for a pairing (every version), under the writers' lock; False if
        there was none."""
        from filelock import FileLock

        home = self.path(drafter, target, user)
        if not home.is_dir():
            return False
        with FileLock(home / ".lock", timeout=LOCK_TIMEOUT_S):
            for entry in home.iterdir():
                if entry.name != ".lock":
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        shutil.rmtree(home, ignore_errors=True)
        return True

    def _save_locked(self, home: Path, profile: PairingProfile) -> Path:
        _clean_leftovers(home)
        versions = _versions(home)
        number = int(versions[-1][1:]) + 1 if versions else 1
        version = home / f"v{number:06d}"
        version.mkdir()
        _write_version(version, profile)
        fsync_dir(version)
        fsync_dir(home)
        atomic_write_bytes(home / "CURRENT", version.name.encode())
        for old in _complete(home)[:-KEEP]:
            shutil.rmtree(home / old, ignore_errors=True)
        return version

    def load(
        self, drafter: str, target: str, user: str, *, fingerprint: str | None = None
    ) -> PairingProfile | None:
        """The current profile, or None if there is none. A tokenizer mismatch raises IncompatibleError."""
        home = self.path(drafter, target, user)
        for attempt in range(_READ_TRIES):
            current = self._current(home)
            if current is None:
                return None
            try:
                profile = _read_version(home / current)
                break
            except (FileNotFoundError, CorruptFileError):  # pruned by a writer while we read: look again
                if attempt == _READ_TRIES - 1 or self._current(home) == current and (home / current).is_dir():
                    profile = _previous(home, current)  # the version kept for exactly this, or the error
                    break
        if fingerprint is not None and profile.fingerprint != fingerprint:
            raise IncompatibleError(
                f"profile {home} was made for tokenizers {profile.fingerprint!r}, this pairing has "
                f"{fingerprint!r}; "
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
                members = {
                    m.name: m for m in tar.getmembers() if m.isfile() and m.name.startswith("profile/")
                }
                readers = {Path(n).name: tar.extractfile(m) for n, m in members.items()}  # regular files only
                files = {n: r.read() for n, r in readers.items() if r is not None}
        except (tarfile.TarError, OSError) as exc:
            raise CorruptFileError(f"{path} is not an exported omnidraft profile: {exc}") from exc
        profile = _from_files(files, str(path))
        if user is not None:
            profile.user = user
        self.save(profile)
        return profile

    @staticmethod
    def _current(home: Path) -> str | None:
        """The version `CURRENT` names, or the newest complete one when it names none (a broken
        pointer is logged, never fatal while a complete version exists); None for no profile."""
        try:
            name = (home / "CURRENT").read_text().strip()
        except FileNotFoundError:
            name = None
        except (OSError, UnicodeDecodeError):
            name = ""
        if name is not None and _VERSION.fullmatch(name) and (home / name / "meta.json").is_file():
            return name
        complete = _complete(home)
        if name is None and not complete:
            return None
        if not complete:
            raise CorruptFileError(
                f"{home / 'CURRENT'} names {name!r}, and no complete profile version is left"
            )
        log.warning("%s names %r, not a complete version; using %s", home / "CURRENT", name, complete[-1])
        return complete[-1]


def _previous(home: Path, broken: str) -> PairingProfile:
    """The newest complete version before `broken` (whose files are corrupt), logged; re-raises
    the corrupt version's error when there is none."""
    for name in reversed([v for v in _complete(home) if v < broken]):
        try:
            profile = _read_version(home / name)
        except (FileNotFoundError, CorruptFileError):
            continue
        log.warning("profile %s: version %s is corrupt; using %s, the one before it", home, broken, name)
        return profile
    return _read_version(home / broken)


def _versions(home: Path) -> list[str]:
    """Every version directory's name, oldest first."""
    return sorted(p.name for p in home.glob("v*") if p.is_dir() and _VERSION.fullmatch(p.name))


def _complete(home: Path) -> list[str]:
    """The versions whose meta.json (written last) exists, oldest first."""
    return [v for v in _versions(home) if (home / v / "meta.json").is_file()]


def _clean_leftovers(home: Path) -> None:
    """What killed saves leave (under the lock: no writer is using them): temp files and versions
    that never got their meta.json."""
    for tmp in home.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
    complete = set(_complete(home))
    for name in _versions(home):
        if name not in complete:
            shutil.rmtree(home / name, ignore_errors=True)


def _write_version(version: Path, profile: PairingProfile) -> None:
    from safetensors.torch import save as save_tensors

    meta = {
        "format": FORMAT,
        "version": VERSION,
        "library": _library_version(),
        "drafter": profile.drafter,
        "target": profile.target,
        "user": profile.user,
        "fingerprint": profile.fingerprint,
        "steps": profile.steps,
        "metrics": profile.metrics,
        "tensors": sorted(profile.tensors),
    }
    for stem, tensors in profile.tensors.items():
        atomic_write_bytes(
            version / f"{_check_name('tensor file', stem)}.safetensors",
            save_tensors({k: v.contiguous() for k, v in tensors.items()}),
        )
    if profile.ngram is not None:
        atomic_write_bytes(version / "ngram.json", json.dumps(profile.ngram).encode())
    if profile.history is not None:
        atomic_write_bytes(version / "history.json", json.dumps(profile.history).encode())
    atomic_write_bytes(
        version / "meta.json", json.dumps(meta, indent=1).encode()
    )  # last: marks the version complete


def _read_version(version: Path) -> PairingProfile:
    return _from_files({p.name: p.read_bytes() for p in version.iterdir() if p.is_file()}, str(version))


def _from_files(files: dict[str, bytes], where: str) -> PairingProfile:
    from safetensors.torch import load as load_tensors

    try:
        meta = json.loads(files["meta.json"])
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise CorruptFileError(f"{where}/meta.json: not an omnidraft profile of format version {VERSION}")
        tensors = {stem: load_tensors(files[f"{stem}.safetensors"]) for stem in meta["tensors"]}
        ngram = json.loads(files["ngram.json"]) if "ngram.json" in files else None
        history = json.loads(files["history.json"]) if "history.json" in files else None
        return PairingProfile(
            drafter=meta["drafter"],
            target=meta["target"],
            user=meta["user"],
            fingerprint=meta["fingerprint"],
            steps=meta["steps"],
            metrics=meta["metrics"],
            ngram=ngram,
            history=history,
            tensors=tensors,
        )
    except KeyError as exc:
        raise CorruptFileError(
            f"{where}: incomplete profile: {exc.args[0]!r} is missing (from meta.json or its files)"
        ) from exc
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
        raise CorruptFileError(f"{where}: corrupt profile ({exc})") from exc
    except Exception as exc:  # safetensors raises its own error type on a truncated file
        if isinstance(exc, CorruptFileError):
            raise
        raise CorruptFileError(f"{where}: unreadable tensors ({exc})") from exc


def _library_version() -> str:
    from .. import __version__

    return __version__
