"""`LlamaCppDrafter`: the drafter's own GGUF file run by llama.cpp, a drafting backend.

Its `Stream` keeps the drafter's view of the committed text; each drafted token is one
single-token llama.cpp step after the cached prefix (the engine drops rejected entries at the next
step). Drafting itself is the shared `DraftSession`, so greedy and sampled drafts, the
shared-vocabulary restriction and token healing work unchanged. It drafts with the base weights:
LoRA adapters and the acceptance head need the PyTorch drafter.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..draft.base import Drafter
from ..store.models import load_tokenizer
from .engine import LlamaEngine
from .loading import gguf_file
from .requant import drafting_weights

__all__ = ["LlamaCppDrafter", "LlamaStream"]


class LlamaStream:
    """A `Stream` on a llama.cpp engine: the engine reuses its cache for the common prefix."""

    gives_hidden = False

    def __init__(self, engine: LlamaEngine, ids: list[int]) -> None:
        self.engine, self.ids = engine, list(ids)

    def extend(self, ids: list[int]) -> None:
        self.ids.extend(ids)

    def crop(self, n: int) -> None:
        del self.ids[n:]

    def logits(self, rows: int = 1, *, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if hidden:
            raise ValueError("the llama.cpp drafter gives no hidden states")
        return torch.from_numpy(self.engine.logits(self.ids, rows)), None


class LlamaCppDrafter(Drafter, name="llama.cpp"):
    """A drafter on llama.cpp (`Drafter.load(spec, backend="llama.cpp")`).
    `weights`: "auto" (default) runs the GGUF file as shipped or requantized to Q8_0, whichever
    drafts a request faster here (requant.py); "shipped" or "q8_0" choose."""

    pytorch: Any = None  # the PyTorch drafter it stands in for, as a pairing's faster copy

    backend = "llama.cpp"

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        tokenizer: Any = None,
        n_ctx: int = 4096,
        threads: int | None = None,
        weights: str = "auto",
    ) -> None:
        path, self.name = gguf_file(model)
        # a drafter's steps need not be bit-exact with one token a call: no exactness probe
        self.engine = LlamaEngine(path, n_ctx=n_ctx, threads=threads, exact_rows=1)
        run = drafting_weights(path, self.engine, weights, threads=threads)
        if run != path:
            self.engine = LlamaEngine(run, n_ctx=n_ctx, threads=threads, exact_rows=1)
        self._init_vocabulary(
            tokenizer if tokenizer is not None else load_tokenizer(os.fspath(model)), self.engine.n_vocab
        )

    @classmethod
    def from_spec(cls, spec: str, *, threads: int | None = None, **_: Any) -> LlamaCppDrafter:
        return cls(spec, threads=threads)

    drafts_beside = True

    def use_threads(self, threads: int | None) -> None:
        self.engine.use_threads(threads)

    def stream(self, ids: list[int]) -> LlamaStream:
        return LlamaStream(self.engine, ids)

    @property
    def cost_key(self) -> str:
        return f"{super().cost_key}|{self.engine.path.name}"  # the weights it runs
