"""The OmniDraft n-gram cache: runs of >= 2 drafter tokens that one target token spells exactly.

Bounded by entry count and by an estimate of its memory in bytes, with LFU-DA (LFU with dynamic
aging, the default), LFU or LRU eviction (cachetools caches with an explicit eviction order) and
hit/miss/eviction counters. Saved as versioned JSON, atomically, with each entry's use count and
priority in eviction order: a reloaded cache evicts what the saved one would have, where a plain
list of entries would restart every count at one. A truncated or foreign file is refused and the
previous file stays in place. Lookups never change eviction order (`peek`, `items`); only an
n-gram actually used in a proposal counts as a use (`use`).
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import cachetools

from ..errors import CorruptFileError, IncompatibleError
from ..store.atomic import atomic_write_bytes

__all__ = ["NgramCache", "NgramCacheConfig"]

FORMAT = "omnidraft.ngram_cache"
VERSION = 2  # 2: entries in eviction order with their use counts and priorities; 1 (read too): entries only
ENTRY_OVERHEAD = 64  # bytes per entry beside its ids: dict slot, tuple header, counter


@dataclass(frozen=True, kw_only=True)
class NgramCacheConfig:
    """Bounds and policy. `max_len` is the longest drafter run considered for one target token.
    `max_entries=0` keeps nothing: the translation then runs on the direct map alone.
    `policy`: "lfu-da" (LFU with dynamic aging, the default), "lfu" or "lru". On the paper's pair
    (Llama-2 drafting for Llama-3, `python -m benchmarks ngram-cache`) a cache at 1/4 of its full size keeps
    more of the full cache's gain with "lfu-da" than with either plain policy (docs/distillation.md)."""

    max_entries: int = 65_536
    max_bytes: int = 8 << 20
    policy: str = "lfu-da"
    max_len: int = 8

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"n-gram cache policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_entries < 0:
            raise ValueError(
                f"n-gram cache max_entries must be >= 0 (0 keeps nothing), got {self.max_entries}"
            )
        if self.max_bytes < 1:
            raise ValueError(f"n-gram cache max_bytes must be >= 1, got {self.max_bytes}")
        if self.max_len < 2:
            raise ValueError(f"n-gram cache max_len must be >= 2, got {self.max_len}")


def _entry_bytes(value: tuple[int, int]) -> int:
    """Memory estimate of one entry; values are (target id, key length) so cachetools can size them."""
    return ENTRY_OVERHEAD + 8 * (value[1] + 1)


class _Policy(cachetools.Cache):
    """A cachetools cache whose eviction order is explicit: `order()` lists the keys from the next
    to be evicted, `state(key)` what else a save must keep of an entry, `restore` puts an entry
    back as it was. So a saved cache reloads with the same eviction order, not as a fresh one.
    Reading through cachetools.Cache.__getitem__ counts no use; the policies' own __getitem__ does."""

    evictions = 0

    def _evict(self, key):
        value = cachetools.Cache.__getitem__(self, key)
        del self[key]
        self.evictions += 1
        return key, value

    def order(self) -> list:
        raise NotImplementedError

    def state(self, key) -> list:
        raise NotImplementedError

    def restore(self, key, value, state: list) -> None:
        raise NotImplementedError


class _Recent(_Policy):
    """LRU: evicts the entry least recently added or used."""

    def __init__(self, maxsize: int, getsizeof=None) -> None:
        super().__init__(maxsize, getsizeof)
        self._order: OrderedDict = OrderedDict()

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self._order.move_to_end(key)
        return value

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._order[key] = None
        self._order.move_to_end(key)

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        del self._order[key]

    def popitem(self):
        if not self._order:
            raise KeyError(f"{type(self).__name__} is empty")
        return self._evict(next(iter(self._order)))

    def order(self) -> list:
        return list(self._order)

    def state(self, key) -> list:
        return []

    def restore(self, key, value, state: list) -> None:
        self[key] = value  # restored in eviction order: the order is the state


class _Frequent(_Policy):
    """LFU: evicts the entry of fewest uses, ties to the least recently used. With `aging`, LFU with
    dynamic aging (Arlitt et al., "Evaluating content management techniques for web proxy caches",
    2000): an entry's priority is L + its use count, recomputed at each use, and evicting raises L
    to the evicted priority. Plain LFU keeps whatever was used often early on and starves
    newcomers; with aging an entry that stops being used sinks below new ones as L rises.
    A lazy heap holds (priority, tick, key); rows that are no longer an entry's rank are skipped."""

    aging = False

    def __init__(self, maxsize: int, getsizeof=None) -> None:
        super().__init__(maxsize, getsizeof)
        self._uses: dict = {}
        self._rank: dict = {}  # key -> (priority, tick) of its last use
        self._heap: list = []
        self._tick = itertools.count()
        self.age = 0

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self._uses[key] += 1
        self._push(key)
        return value

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if key not in self._uses:
            self._uses[key] = 1
            self._push(key)

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        del self._uses[key], self._rank[key]

    def _push(self, key, priority: int | None = None) -> None:
        if priority is None:
            priority = self._uses[key] + (self.age if self.aging else 0)
        self._rank[key] = rank = (priority, next(self._tick))
        heapq.heappush(self._heap, (*rank, key))
        if len(self._heap) > 4 * len(self._rank) + 64:  # drop stale rows now and then
            self._heap = [(p, t, k) for p, t, k in self._heap if self._rank.get(k) == (p, t)]
            heapq.heapify(self._heap)

    def popitem(self):
        while self._heap:
            priority, tick, key = heapq.heappop(self._heap)
            if self._rank.get(key) == (priority, tick):
                if self.aging:
                    self.age = priority
                return self._evict(key)
        raise KeyError(f"{type(self).__name__} is empty")

    def order(self) -> list:
        return sorted(self._rank, key=self._rank.__getitem__)

    def state(self, key) -> list:
        return [self._uses[key], self._rank[key][0]]

    def restore(self, key, value, state: list) -> None:
        """`state`: [uses, priority] as `state` gave them, or [] (an LRU's save, a version-1 file):
        one use."""
        cachetools.Cache.__setitem__(self, key, value)
        uses, priority = state if len(state) == 2 else (1, None)
        self._uses[key] = max(1, uses)
        self._push(key, priority if self.aging else None)


class _AgingFrequent(_Frequent):
    aging = True


POLICIES = {"lfu": _Frequent, "lfu-da": _AgingFrequent, "lru": _Recent}


class NgramCache:
    """Maps a tuple of drafter ids (length 2..max_len) to one target id."""

    def __init__(self, config: NgramCacheConfig | None = None, *, fingerprint: str = "") -> None:
        self.config = config or NgramCacheConfig()
        self.fingerprint = fingerprint  # drafter+target tokenizer fingerprints; refused on mismatch at load
        kind = POLICIES[self.config.policy]
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
        return self._read(key)[0] if key in self._cache else None

    def _read(self, key: tuple[int, ...]) -> tuple[int, int]:
        return cachetools.Cache.__getitem__(self._cache, key)  # the policies' own __getitem__ counts a use

    def use(self, key: tuple[int, ...]) -> int:
        """Count a use of `key` (it was proposed) and return its target id."""
        self.hits += 1
        return self._cache[key][0]

    def add(self, key: tuple[int, ...], target_id: int) -> None:
        """Record that target token `target_id` spells exactly the drafter run `key`."""
        if not self.admits(key):
            return
        if key in self._cache:
            self._cache[key]  # a repeat observation counts as a use
            return
        self._cache[key] = (target_id, len(key))
        self._trim()

    def admits(self, key: tuple[int, ...]) -> bool:
        """Whether `add` would keep `key` at all: a run of 2..max_len drafter tokens, in a cache of
        >= 1 entry."""
        return 2 <= len(key) <= self.config.max_len and self.config.max_entries > 0

    def _trim(self) -> None:
        while len(self._cache) > self.config.max_entries:
            self._cache.popitem()

    def items(self) -> list[tuple[tuple[int, ...], int]]:
        """Every (drafter run, target id), the next to be evicted first; reading counts no use."""
        return [(k, self._read(k)[0]) for k in self._cache.order()]

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self),
            "bytes": self.nbytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }

    def to_doc(self) -> dict:
        """The cache as a JSON-ready document (what `save` writes and a profile embeds)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "fingerprint": self.fingerprint,
            "config": asdict(self.config),
            "stats": self.stats(),
            "age": getattr(self._cache, "age", 0),
            "entries": [[list(k), v, *self._cache.state(k)] for k, v in self.items()],
        }

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
    def from_doc(
        cls,
        doc: object,
        *,
        where: str = "n-gram cache",
        fingerprint: str | None = None,
        config: NgramCacheConfig | None = None,
    ) -> NgramCache:
        """A cache from `to_doc` output, with its eviction order, use counts and counters as saved;
        `config` overrides the saved bounds and policy (entries beyond the bounds are evicted, next
        to be evicted first; under another policy every entry restarts at one use)."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CorruptFileError(
                f"{where} is not an omnidraft n-gram cache (format "
                f"{doc.get('format') if isinstance(doc, dict) else None!r})"
            )
        if doc.get("version") not in (1, VERSION):
            raise CorruptFileError(
                f"{where} has n-gram cache format version {doc.get('version')}, "
                f"this omnidraft reads 1 to {VERSION}"
            )
        if fingerprint is not None and doc.get("fingerprint") != fingerprint:
            raise IncompatibleError(
                f"{where} was built for tokenizers {doc.get('fingerprint')!r}, not {fingerprint!r}; "
                "it belongs to another drafter/target pairing"
            )
        cache = cls(config or NgramCacheConfig(**doc["config"]), fingerprint=doc.get("fingerprint", ""))
        same_policy = doc["config"].get("policy") == cache.config.policy
        try:
            for key, value, *state in doc["entries"]:
                cache._restore(tuple(key), int(value), [int(x) for x in state] if same_policy else [])
            stats = doc.get("stats", {})
            cache.hits, cache.misses = int(stats.get("hits", 0)), int(stats.get("misses", 0))
            cache._cache.evictions += int(stats.get("evictions", 0))
            if hasattr(cache._cache, "age") and same_policy:
                cache._cache.age = int(doc.get("age", 0))
        except (TypeError, ValueError) as exc:
            raise CorruptFileError(f"{where} has a malformed n-gram cache entry or counter: {exc}") from exc
        return cache

    def _restore(self, key: tuple[int, ...], target_id: int, state: list[int]) -> None:
        """Put back a saved entry (they come next to be evicted first), then hold the bounds."""
        if self.admits(key):
            self._cache.restore(key, (target_id, len(key)), state)
            self._trim()
