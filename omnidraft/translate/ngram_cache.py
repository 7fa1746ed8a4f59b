"""The OmniDraft n-gram cache: runs of >= 2 drafter tokens that one target token spells exactly.

Bounded by entry count and by an estimate of its memory in bytes, with LFU or LRU eviction
(cachetools) and hit/miss/eviction counters. Saved as versioned JSON, atomically; a truncated or
foreign file is refused and the previous file stays in place. Lookups never change eviction order
(`peek`); only an n-gram actually used in a proposal counts as a use (`use`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import cachetools

from ..atomic import atomic_write_bytes
from ..errors import CorruptFileError, IncompatibleError

__all__ = ["NgramCache", "NgramCacheConfig"]

FORMAT = "omnidraft.ngram_cache"
VERSION = 1
ENTRY_OVERHEAD = 64  # bytes per entry beside its ids: dict slot, tuple header, counter


@dataclass(frozen=True, kw_only=True)
class NgramCacheConfig:
    """Bounds and policy. `max_len` is the longest drafter run considered for one target token."""

    max_entries: int = 65_536
    max_bytes: int = 8 << 20
    policy: str = "lfu"
    max_len: int = 8

    def __post_init__(self) -> None:
        if self.policy not in ("lfu", "lru"):
            raise ValueError(f"n-gram cache policy must be 'lfu' or 'lru', got {self.policy!r}")
        for name in ("max_entries", "max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"n-gram cache {name} must be >= 1, got {getattr(self, name)}")
        if self.max_len < 2:
            raise ValueError(f"n-gram cache max_len must be >= 2, got {self.max_len}")


def _entry_bytes(value: tuple[int, int]) -> int:
    """Memory estimate of one entry; values are (target id, key length) so cachetools can size them."""
    return ENTRY_OVERHEAD + 8 * (value[1] + 1)


class _Bounded:
    """Mixin for a cachetools cache: count evictions and bytes."""

    evictions = 0

    def popitem(self):  # type: ignore[no-untyped-def]
        key, value = super().popitem()  # type: ignore[misc]
        self.evictions += 1
        return key, value


class _LFU(_Bounded, cachetools.LFUCache):
    pass


class _LRU(_Bounded, cachetools.LRUCache):
    pass


class NgramCache:
    """Maps a tuple of drafter ids (length 2..max_len) to one target id."""

    def __init__(self, config: NgramCacheConfig | None = None, *, fingerprint: str = "") -> None:
        self.config = config or NgramCacheConfig()
        self.fingerprint = fingerprint  # drafter+target tokenizer fingerprints; refused on mismatch at load
        kind = _LFU if self.config.policy == "lfu" else _LRU
        # maxsize counts bytes; the entry bound is enforced in add()
        self._cache = kind(maxsize=self.config.max_bytes, getsizeof=_entry_bytes)
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, key: tuple[int, ...]) -> bool:
        return key in self._cache

    @property
    def nbytes(self) -> int:
        return int(self._cache.currsize)

    @property
    def evictions(self) -> int:
        return self._cache.evictions

    def peek(self, key: tuple[int, ...]) -> int | None:
        """The target id for `key`, without counting a use."""
        return self._cache[key][0] if key in self._cache else None

    def use(self, key: tuple[int, ...]) -> int:
        """Count a use of `key` (it was proposed) and return its target id."""
        self.hits += 1
        return self._cache[key][0]

    def add(self, key: tuple[int, ...], target_id: int) -> None:
        """Record that target token `target_id` spells exactly the drafter run `key`."""
        if not 2 <= len(key) <= self.config.max_len:
            return
        if key in self._cache:
            self._cache[key]  # a repeat observation counts as a use
            return
        self._cache[key] = (target_id, len(key))
        while len(self._cache) > self.config.max_entries:
            self._cache.popitem()

    def items(self) -> list[tuple[tuple[int, ...], int]]:
        return [(k, v[0]) for k, v in self._cache.items()]

    def stats(self) -> dict[str, int]:
        return {"entries": len(self), "bytes": self.nbytes, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions}

    def to_doc(self) -> dict:
        """The cache as a JSON-ready document (what `save` writes and a profile embeds)."""
        return {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint,
                "config": asdict(self.config), "stats": self.stats(),
                "entries": [[list(k), v] for k, v in self.items()]}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically: a crash mid-write leaves the previous file loadable."""
        atomic_write_bytes(Path(path), json.dumps(self.to_doc(), separators=(",", ":")).encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, fingerprint: str | None = None) -> NgramCache:
        """Load a saved cache; refuse a truncated, foreign or mismatched file with a clear error."""
        path = Path(path)
        try:
            doc = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CorruptFileError(f"n-gram cache file {path} is truncated or not JSON: {exc}") from exc
        return cls.from_doc(doc, where=str(path), fingerprint=fingerprint)

    @classmethod
    def from_doc(cls, doc: object, *, where: str = "n-gram cache", fingerprint: str | None = None,
                 config: NgramCacheConfig | None = None) -> NgramCache:
        """A cache from `to_doc` output; `config` overrides the saved bounds (entries beyond them are evicted)."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CorruptFileError(f"{where} is not an omnidraft n-gram cache (format {doc.get('format') if isinstance(doc, dict) else None!r})")
        if doc.get("version") != VERSION:
            raise CorruptFileError(f"{where} has n-gram cache format version {doc.get('version')}, this omnidraft reads {VERSION}")
        if fingerprint is not None and doc.get("fingerprint") != fingerprint:
            raise IncompatibleError(
                f"{where} was built for tokenizers {doc.get('fingerprint')!r}, not {fingerprint!r}; "
                "it belongs to another drafter/target pairing"
            )
        cache = cls(config or NgramCacheConfig(**doc["config"]), fingerprint=doc.get("fingerprint", ""))
        for key, value in doc["entries"]:
            cache.add(tuple(key), int(value))
        return cache

