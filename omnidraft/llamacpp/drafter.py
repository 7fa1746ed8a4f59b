"""`LlamaCppDrafter`: the drafter's own GGUF file run by llama.cpp, behind the drafter protocol.

A session keeps the drafter's view of the committed text; each drafted token is one single-token
llama.cpp step after the cached prefix, and `commit` rolls back to what the target accepted (the
engine removes the rejected entries at the next step). Proposals are picked from the full logits
row exactly as the PyTorch drafter picks them (`draft.pick`), so greedy drafts, sampled drafts with
their q rows, the shared-vocabulary restriction and token healing all work unchanged. It drafts
with the base weights: LoRA adapters and the acceptance head need the PyTorch drafter.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

import torch

from ..draft import Draft, confidence, heal_pick, pick
from ..models import load_tokenizer
from ..translate.codec import ByteCodec
from ..translate.token_bytes import build_token_bytes
from .engine import LlamaEngine, gguf_file
from .requant import drafting_weights

if TYPE_CHECKING:
    from ..adaptive.head import Stopper

__all__ = ["LlamaCppDrafter"]


class _LlamaDraftSession:
    def __init__(self, owner: LlamaCppDrafter, ids: list[int]) -> None:
        self.owner, self.ids = owner, list(ids)
        self._base = len(self.ids)

    def _row(self, rows: int = 1) -> torch.Tensor:
        return torch.from_numpy(self.owner.engine.logits(self.ids, rows))

    def propose(self, k: int, *, temperature: float = 0.0, allowed: torch.Tensor | None = None,
                generator: torch.Generator | None = None, stop_confidence: float = 0.0,
                stopper: Stopper | None = None, heal: torch.Tensor | None = None) -> Draft:
        if k < 1:
            raise ValueError(f"draft length k must be >= 1, got {k}")
        if stopper is not None:
            raise ValueError("the llama.cpp drafter gives no hidden states: an acceptance head needs the PyTorch drafter")
        with self.owner.lock:
            self._base = len(self.ids)
            ids, rows, healed = [], [], False
            for step in range(k):
                logits = None
                if step == 0 and heal is not None and len(self.ids) > 1:
                    logits, token, probs, healed = self._heal_step(heal, temperature, allowed, generator)
                if logits is None:
                    logits = self._row()[0]
                    token, probs = pick(logits, temperature, allowed, generator)
                ids.append(token)
                if probs is not None:
                    rows.append(probs)
                self.ids.append(token)
                if token in self.owner.stop_ids or (stop_confidence > 0 and confidence(logits, token, probs) < stop_confidence):
                    break
            return Draft(ids, torch.stack(rows) if rows else None, healed)

    def _heal_step(self, heal: torch.Tensor, temperature: float, allowed: torch.Tensor | None,
                   generator: torch.Generator | None) -> tuple[torch.Tensor | None, int, torch.Tensor | None, bool]:
        """Token healing (see the PyTorch drafter's session), from one call that returns the rows
        one position back and at the end."""
        both = self._row(2)
        chosen = heal_pick(both[0], heal, self.ids[-1], temperature, allowed, generator)
        if chosen is None:
            token, probs = pick(both[1], temperature, allowed, generator)
            return both[1], token, probs, False
        del self.ids[-1]  # a longer token replaces it
        self._base -= 1
        return (*chosen, True)

    def commit(self, keep: int, tail: list[int]) -> None:
        """Keep the first `keep` drafted tokens, then append `tail` (fed at the next propose)."""
        del self.ids[self._base + keep :]
        self.ids.extend(tail)
        self._base = len(self.ids)


class LlamaCppDrafter:
    """A drafter on llama.cpp; pairs with any target like `Drafter` (see `Drafter.load(backend=...)`).
    `weights`: "auto" (default) runs the GGUF file as shipped or requantized to Q8_0, whichever
    drafts a request faster here (requant.py); "shipped" or "q8_0" choose."""

    hidden_size = None  # no hidden states out of llama.cpp here: no acceptance head

    def __init__(self, model: str | os.PathLike[str], *, tokenizer: Any = None, n_ctx: int = 4096,
                 threads: int | None = None, weights: str = "auto") -> None:
        path, self.name = gguf_file(model)
        # a drafter's steps need not be bit-exact with one token a call: no exactness probe
        self.engine = LlamaEngine(path, n_ctx=n_ctx, threads=threads, exact_rows=1)
        run = drafting_weights(path, self.engine, weights, threads=threads)
        if run != path:
            self.engine = LlamaEngine(run, n_ctx=n_ctx, threads=threads, exact_rows=1)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(os.fspath(model))
        self.token_bytes = build_token_bytes(self.tokenizer, self.engine.n_vocab)
        self.codec = ByteCodec(self.tokenizer, self.token_bytes)
        self.stop_ids = frozenset(i for i in (self.tokenizer.eos_token_id,) if isinstance(i, int))
        self.lock = threading.RLock()

    def begin(self, ids: list[int]) -> _LlamaDraftSession:
        return _LlamaDraftSession(self, ids)

    def pair(self, target: Any, config: Any = None, **options: Any) -> Any:
        """Pair with `target`: see `omnidraft.pairing.pair`; this drafter drafts but cannot learn."""
        from ..pairing import pair

        return pair(self, target, config, **options)

    def __repr__(self) -> str:
        return f"LlamaCppDrafter({self.name!r}, vocab {self.engine.n_vocab})"
