"""Every token of a tokenizer as the raw bytes it stands for, and bytes back into token ids.

Tokens are compared as bytes, never as vocabulary strings: byte-level BPE (`Ġ`, `Ċ`, the GPT-2
byte-to-unicode table) and SentencePiece (`▁`, `<0xNN>` byte fallback) both normalise to bytes here.
Special and control tokens have no bytes (`None`); they map only to their declared counterparts.
This module knows nothing about models or decoding.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

__all__ = ["TokenBytes", "build_token_bytes"]

_SPM_SPACE = "\u2581"


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table (printable bytes map to themselves)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def _scheme(tokenizer: Any) -> str:
    """'byte_level' or 'sentencepiece', read from the fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} has no fast (tokenizers) backend; omnidraft needs one")
    decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
    if '"ByteLevel"' in decoder:
        return "byte_level"
    if "ByteFallback" in decoder or _SPM_SPACE in decoder:
        return "sentencepiece"
    raise ValueError(f"tokenizer decoder {decoder[:200]} is neither byte-level BPE nor SentencePiece")


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []))
    for idx, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(idx))
    return ids


def _piece_bytes(piece: str, scheme: str, u2b: dict[str, int]) -> bytes:
    if scheme == "sentencepiece":
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace(_SPM_SPACE, " ").encode("utf-8")
    if all(c in u2b for c in piece):
        return bytes(u2b[c] for c in piece)
    return piece.encode("utf-8")  # a non-special added token stored as plain text


@dataclass(frozen=True)
class TokenBytes:
    """Byte view of one vocabulary.

    `table[i]` is the bytes of token i, or None for special/control/unused ids (the table is sized
    to the model's vocabulary, which can exceed the tokenizer's). `byte_token[b]` is a token whose
    bytes are exactly the single byte b (None if there is none), used for bytes that are not valid UTF-8.
    """

    table: tuple[bytes | None, ...]
    scheme: str
    special: dict[int, str]
    byte_token: tuple[int | None, ...]
    fingerprint: str
    _by_bytes: dict[bytes, int] = field(repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.table)

    @property
    def missing_bytes(self) -> list[int]:
        """Byte values that can occur in UTF-8 text but have no single-byte token."""
        return [b for b, t in enumerate(self.byte_token) if t is None and b not in _NEVER_IN_UTF8]

    def require_byte_coverage(self, name: str) -> None:
        """Raise ValueError unless every byte of UTF-8 text can be spelled (a target must)."""
        if missing := self.missing_bytes:
            raise ValueError(
                f"tokenizer of {name!r} lacks byte coverage: no single-byte token for {len(missing)} byte "
                "values "
                f"(first: {missing[:8]}); a target needs byte-level BPE or SentencePiece with byte fallback"
            )

    def id_of(self, data: bytes) -> int | None:
        """The preferred token whose bytes equal `data` (a normal token before a byte-fallback one)."""
        return self._by_bytes.get(data)

    def join(self, ids: list[int]) -> bytes:
        """Concatenated bytes of `ids`; special tokens contribute nothing."""
        table = self.table
        return b"".join(table[i] or b"" for i in ids)


def build_token_bytes(tokenizer: Any, vocab_size: int | None = None) -> TokenBytes:
    """Build the byte view of `tokenizer`, sized to `vocab_size` (default: the tokenizer's length).

    A drafter may lack single-byte tokens for a few control bytes (it then never sees them); a
    target must not: see `TokenBytes.require_byte_coverage`.
    """
    n = max(len(tokenizer), vocab_size or 0)
    scheme, u2b, specials = _scheme(tokenizer), _unicode_to_byte(), _special_ids(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    table: list[bytes | None] = [None] * n
    special: dict[int, str] = {}
    for i, piece in enumerate(pieces):
        if piece is None:
            continue
        if i in specials:
            special[i] = piece
        else:
            table[i] = _piece_bytes(piece, scheme, u2b)
    by_bytes: dict[bytes, int] = {}
    for i, data in enumerate(table):  # first id wins, except that a normal token beats <0xNN>
        if data is None:
            continue
        current = by_bytes.get(data)
        if current is None or (
            _is_byte_fallback(pieces, current, scheme) and not _is_byte_fallback(pieces, i, scheme)
        ):
            by_bytes[data] = i
    byte_token = _byte_tokens(table, pieces, scheme)
    digest = hashlib.sha256(scheme.encode())
    for data in table:
        digest.update(b"\x00" if data is None else b"\x01" + len(data).to_bytes(2, "little") + data)
    return TokenBytes(tuple(table), scheme, special, byte_token, digest.hexdigest()[:16], by_bytes)


def _is_byte_fallback(pieces: list[str], i: int, scheme: str) -> bool:
    return (
        scheme == "sentencepiece" and i < len(pieces) and pieces[i].startswith("<0x") and len(pieces[i]) == 6
    )


# Bytes that never occur in UTF-8 text; a vocabulary may lack single-byte tokens for them.
_NEVER_IN_UTF8 = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})


def _byte_tokens(table: list[bytes | None], pieces: list[str], scheme: str) -> tuple[int | None, ...]:
    best: dict[int, int] = {}
    for i, data in enumerate(table):
        if data is not None and len(data) == 1:
            b = data[0]  # prefer <0xNN> in SentencePiece: that is what its encoder emits for raw bytes
            if b not in best or (
                _is_byte_fallback(pieces, i, scheme) and not _is_byte_fallback(pieces, best[b], scheme)
            ):
                best[b] = i
    return tuple(best.get(b) for b in range(256))
