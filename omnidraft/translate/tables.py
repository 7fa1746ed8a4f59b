"""The read-only tables of a drafter-target tokenizer pair (vocabulary map, token healer), built
once and shared by every pairing of the same two tokenizers."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from .healing import Healer
from .vocab_map import ROLES, VocabMap, build_vocab_map

if TYPE_CHECKING:
    from ..target import Target

__all__ = ["TABLES_KEPT", "pair_tables"]


TABLES_KEPT = 8  # tokenizer pairs whose vocabulary map and healer stay built (a few MB each)
_tables: OrderedDict[tuple[Any, ...], tuple[VocabMap, Healer | None]] = OrderedDict()
_tables_lock = threading.Lock()


def _tokenizer_key(side: Any) -> tuple[Any, ...]:
    """What a vocabulary map and a healer are functions of: the token bytes and the special tokens."""
    tb = side.token_bytes
    return (
        tb.fingerprint,
        tuple(sorted(tb.special.items())),
        tuple(getattr(side.tokenizer, r, None) for r in ROLES),
    )


def pair_tables(drafter: Any, target: Target, *, healing: bool = True) -> tuple[VocabMap, Healer | None]:
    """The vocabulary map and (with `healing`) the token healer of a drafter-target tokenizer pair.

    Both are read-only and take a noticeable time to build against a large vocabulary (Gemma's),
    so every pairing of the same two tokenizers shares one copy (the last TABLES_KEPT pairs are
    kept): a second `drafter.pair(target)` costs no rebuild.
    """
    key = (_tokenizer_key(drafter), _tokenizer_key(target))
    with _tables_lock:
        hit = _tables.get(key)
        if hit is not None:
            _tables.move_to_end(key)
    if hit is None or (healing and hit[1] is None):
        vmap = (
            hit[0]
            if hit is not None
            else build_vocab_map(drafter.token_bytes, target.token_bytes, drafter.tokenizer, target.tokenizer)
        )
        hit = (vmap, Healer(drafter.token_bytes, target.token_bytes) if healing else None)
        with _tables_lock:
            _tables[key] = hit
            while len(_tables) > TABLES_KEPT:
                _tables.popitem(last=False)
    return hit[0], hit[1] if healing else None
