"""`PairedDrafter`: what a pairing asks of its drafter, the interface every backend's `Drafter`
(base.py) satisfies. The pairing and its speculation (pairing.py, decode/) are typed against it,
not against `Drafter`, whose `pair` builds a pairing: so the layers import one way.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..translate.codec import ByteCodec
    from ..translate.token_bytes import TokenBytes
    from .session import DraftSession

__all__ = ["PairedDrafter"]


class PairedDrafter(Protocol):
    """A small LM that drafts for a pairing: its name and tokenizer (with the byte view and codec
    translation reads), the lock its model is used under, the hidden size an acceptance head reads
    (None: none), its PEFT model once it learns an adapter (None: it does not), whether it drafts on
    threads of its own beside a verify, and `begin`, a draft session over committed ids."""

    name: str
    tokenizer: Any
    token_bytes: TokenBytes
    codec: ByteCodec
    lock: threading.RLock
    hidden_size: int | None
    trainable: Any
    drafts_beside: bool

    def use_threads(self, threads: int | None) -> None: ...

    def begin(self, ids: list[int]) -> DraftSession: ...
