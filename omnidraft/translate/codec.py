"""Bytes to token ids for one tokenizer, the way the re-sync step needs it.

Encoding a tail of committed text must reproduce those exact bytes: never add BOS, never add or strip
a leading space (SentencePiece's dummy prefix, ByteLevel's add_prefix_space), never turn literal
text such as "<|im_end|>" into a special token, and survive bytes that are not valid UTF-8 (a
byte-level token can end mid-character). This module does the encoding and nothing else.
"""

from __future__ import annotations

import copy
from typing import Any

from .token_bytes import TokenBytes

__all__ = ["ByteCodec"]

_ANCHORS = ("\u2603", "\n", "a")  # prefixes that absorb a dummy prefix space; tried in order


class ByteCodec:
    """Encode bytes to ids whose `TokenBytes.join` is exactly those bytes (less any byte the
    vocabulary has no token for: a drafter may lack a few control bytes, a target may not)."""

    def __init__(self, tokenizer: Any, token_bytes: TokenBytes) -> None:
        backend = copy.deepcopy(tokenizer.backend_tokenizer)
        backend.encode_special_tokens = True  # literal "<|im_end|>" in text stays text
        backend.no_truncation()
        backend.no_padding()
        self._backend, self.token_bytes = backend, token_bytes

    def encode(self, data: bytes) -> list[int]:
        """Token ids spelling exactly `data`; invalid UTF-8 bytes become single-byte tokens."""
        ids: list[int] = []
        rest = data
        while rest:
            try:
                text = rest.decode("utf-8")
                stray = b""
                rest = b""
            except UnicodeDecodeError as err:
                text = rest[: err.start].decode("utf-8")
                stray, rest = rest[err.start : err.end], rest[err.end :]
            if text:
                ids += self.encode_text(text)
            ids += self._bytes(stray)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids spelling exactly `text`, as the tokenizer would split it in running text."""
        want = text.encode("utf-8")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if self.token_bytes.join(ids) == want:
            return ids
        for anchor in _ANCHORS:  # a prefix space was added: encode behind an anchor and cut it off
            ids = self._backend.encode(anchor + text, add_special_tokens=False).ids
            for cut in range(1, min(4, len(ids))):
                if self.token_bytes.join(ids[cut:]) == want:
                    return ids[cut:]
        return self._bytes(want)  # exact whenever the vocabulary covers every byte; not expected in practice

    def _bytes(self, data: bytes) -> list[int]:
        """One single-byte token per byte; a byte the vocabulary cannot spell is dropped."""
        table = self.token_bytes.byte_token
        return [t for t in (table[b] for b in data) if t is not None]

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` (special tokens dropped, invalid UTF-8 replaced)."""
        return self.token_bytes.join(ids).decode("utf-8", errors="replace")
