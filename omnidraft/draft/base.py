"""`Drafter`: what every drafting backend shares, and `Drafter.load`, which returns one.

A backend (PyTorch and its int8 form in torch_drafter.py, llama.cpp in llamacpp/drafting.py, ONNX
Runtime in export/ort_drafter.py) subclasses `Drafter` with a name, which registers it, and
implements `from_spec` and `stream(ids)`; sessions, the vocabulary tables, pairing and the
capabilities a pairing asks about live here. This module imports no backend: `load` imports the
one asked for by name (`BACKEND_MODULES`).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import threading
from typing import TYPE_CHECKING, Any

import torch

from ..translate.codec import ByteCodec
from ..translate.token_bytes import TokenBytes, build_token_bytes
from .session import DraftSession, Stream

if TYPE_CHECKING:
    from ..decode.config import DecodeConfig
    from ..pairing import Pairing
    from ..target import Target

__all__ = ["BACKENDS", "Drafter"]

BACKENDS = ("torch", "llama.cpp", "onnx", "auto")
BACKEND_ENV = "OMNIDRAFT_DRAFTER_BACKEND"  # the backend `load` uses when none is passed
# where each backend is defined: imported on first use (a plugin table, so this module imports none)
BACKEND_MODULES = {
    "torch": "omnidraft.draft.torch_drafter",
    "llama.cpp": "omnidraft.llamacpp.drafting",
    "onnx": "omnidraft.export.ort_drafter",
}
_REGISTERED: dict[str, type[Drafter]] = {}  # backend name -> class, filled as each backend's module loads


class Drafter:
    """A small LM on the device that proposes tokens for any target; shared by every pairing
    (per-target state lives in the pairing). `load` picks the backend; `begin(ids)` opens a
    `DraftSession`; `pair(target)` pairs it."""

    name: str
    tokenizer: Any
    token_bytes: TokenBytes
    codec: ByteCodec
    stop_ids: frozenset[int]
    lock: threading.RLock
    head: Any = None  # the shortlisted LM head (shortlist/shortlisted_head.py), when one is in use
    hidden_size: int | None = None  # the hidden state an acceptance head reads; None: none given
    learns: bool = False  # whether it carries per-target LoRA adapters and learns them (PyTorch only)
    trainable: Any = None  # a learning drafter's PEFT-wrapped model, once it has an adapter
    backend: str = "?"
    # whether it drafts on threads of its own, releasing Python's lock, so that it drafts beside a
    # target's verify (decode/overlap.py); `use_threads` sets how many
    drafts_beside: bool = False

    def use_threads(self, threads: int | None) -> None:
        """Draft on `threads` threads from now on (None: as loaded); a drafter that cannot ignores it."""

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        """`class MyDrafter(Drafter, name="mine")` registers a backend for `load(backend="mine")`."""
        super().__init_subclass__(**kwargs)
        if name is not None:
            _REGISTERED[name] = cls

    def _init_vocabulary(self, tokenizer: Any, vocab_size: int) -> None:
        """The tokenizer and what is derived from it: byte view, codec, stop ids; and the lock."""
        self.tokenizer = tokenizer
        self.token_bytes = build_token_bytes(tokenizer, vocab_size)
        self.codec = ByteCodec(tokenizer, self.token_bytes)
        self.stop_ids = frozenset(i for i in (tokenizer.eos_token_id,) if isinstance(i, int))
        self.lock = threading.RLock()

    def stream(self, ids: list[int]) -> Stream:
        """A new token sequence `ids` on this drafter's model (the backend's part)."""
        raise NotImplementedError

    def begin(self, ids: list[int]) -> DraftSession:
        """A draft session over the drafter's view of the committed text `ids`."""
        return DraftSession(
            self.stream(list(ids)), self.stop_ids, self.lock, self.head, backend=f"the {self.backend} drafter"
        )

    @property
    def cost_key(self) -> str:
        """What decides its drafting speed on one machine (the key its measured cost is kept under)."""
        head = type(self.head.policy).__name__ if self.head is not None else "full"
        return f"{self.name}|{type(self).__name__}|head {head}"

    @staticmethod
    def adapter_name(target: str, user: str | None) -> str:
        """A peft-safe adapter name for a (target, user) pairing, injective: a readable prefix plus a
        hash of the exact pair, so users "a.b", "a_b" and "a-b" never share an adapter, nor does
        the anonymous pairing (user None) share one with any named user ("default" included)."""
        exact = f"{target}\0{chr(1) if user is None else chr(2) + user}".encode()
        readable = re.sub(r"[^A-Za-z0-9]", "_", f"{target}__{'anonymous' if user is None else user}")[:48]
        return f"{readable}_{hashlib.sha256(exact).hexdigest()[:16]}"

    def pair(self, target: Target, config: DecodeConfig | None = None, **options: Any) -> Pairing:
        """Pair this drafter with `target`: see `omnidraft.pair` (user, learn, overrides)."""
        from ..pairing import pair

        return pair(self, target, config, **options)

    @staticmethod
    def load(
        spec: str | os.PathLike[str],
        *,
        backend: str | None = None,
        quantize: str | None = "int8",
        train_through_int8: bool = True,
        threads: int | None = None,
        shortlist: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> Drafter:
        """Load a drafter by preset name, .gguf path, local dir, HF id, or exported .onnx graph.

        `backend`: "torch" (the only one that learns adapters), "llama.cpp" (the GGUF file itself
        under llama.cpp: a preset or .gguf path; `threads` its thread count), "onnx" (a graph from
        `omnidraft export`; the default for a .onnx path), or "auto": whichever of the installed
        backends drafts a token fastest on this machine, timed once and remembered per machine
        (backends.py). None (default): `$OMNIDRAFT_DRAFTER_BACKEND` if set, else PyTorch, whose
        pairings draft through the GGUF file's llama.cpp copy where this machine's llama.cpp build
        runs it (llamacpp/smoke.py), it is faster here and they need nothing only PyTorch has
        (`backends.drafting_copy`); "torch" keeps every pairing on PyTorch.
        `quantize="int8"` (torch, default) applies dynamic int8 to its linear layers (int8.py):
        it changes only what is proposed, never what the target commits. `train_through_int8`:
        see `TorchDrafter`. `shortlist` (torch): evaluate the LM head on part of the vocabulary
        only, "static", "evo" or "dyna" (see `TorchDrafter.use_shortlist`). `device` / `dtype`
        (torch): where and in what the weights live, as `LocalTarget.load` takes them.
        """
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"drafter backend must be one of {BACKENDS}, got {backend!r}")
        if backend is None and os.environ.get(BACKEND_ENV):
            backend = os.environ[BACKEND_ENV]
            if backend not in BACKENDS:
                raise ValueError(f"${BACKEND_ENV} must be one of {BACKENDS}, got {backend!r}")
        from ..runtime.devices import resolve_device, resolve_dtype

        where, kind = resolve_device(device), resolve_dtype(dtype)
        if (where.type != "cpu" or kind != torch.float32) and backend not in (None, "torch"):
            raise ValueError(f"device and dtype apply to the torch backend, not {backend!r}")
        if backend == "auto":
            from ..runtime.backends import fastest_drafter

            return fastest_drafter(
                os.fspath(spec),
                lambda name: Drafter.load(
                    spec,
                    backend=name,
                    quantize=quantize,
                    train_through_int8=train_through_int8,
                    threads=threads,
                ),
            )
        if backend is None:
            backend = "onnx" if os.fspath(spec).endswith(".onnx") else "torch"
            llama_copy = True  # (a PyTorch drafter may draft through its llama.cpp copy)
        else:
            llama_copy = False
        if backend not in _REGISTERED:
            importlib.import_module(BACKEND_MODULES[backend])
        return _REGISTERED[backend].from_spec(
            os.fspath(spec),
            threads=threads,
            quantize=quantize,
            train_through_int8=train_through_int8,
            shortlist=shortlist,
            device=where,
            dtype=kind,
            llama_copy=llama_copy,
        )

    @classmethod
    def from_spec(cls, spec: str, **options: Any) -> Drafter:
        """This backend's drafter for `spec`; `options` are `load`'s (each backend reads its own)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab {len(self.token_bytes)})"
