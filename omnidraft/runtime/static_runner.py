"""A `CausalRunner` on a static KV cache whose small feeds replay captured CUDA graphs (docs/gpu.md).

A GPU target's verify of a few tokens is launch-bound: hundreds of small kernels, each a few
microseconds of work. Captured once per shape (new tokens, logits kept), such a forward replays as
one graph launch. The cache is allocated once for `capacity` positions and its layers write at a
position the runner sets, so cropping only moves that position: the causal mask, built from the
positions of the tokens fed, hides whatever a rejected draft left past it. The runner is reusable:
`reset` starts a new sequence on the same cache and graphs. A sequence that outgrows the capacity
moves, once, to a dynamic cache (a `CausalRunner`) and goes on there.
"""

from __future__ import annotations

from typing import Any

import torch

from .causal_runner import CausalRunner, cache_keyword

__all__ = ["GRAPH_MOST", "StaticRunner", "static_cache_supported"]

GRAPH_MOST = 16  # feeds of at most this many new tokens replay a graph; longer ones (prefill) run eagerly
BUCKET = 256  # attention reads the cache up to the next multiple of this past the fed tokens


def _static_cache(model: Any, capacity: int) -> Any:
    """A cache of one `_SpanLayer` per model layer (refused for sliding-window layers)."""
    from transformers import StaticCache
    from transformers.cache_utils import Cache, StaticLayer

    stock = StaticCache(config=model.config, max_cache_len=capacity)
    if not all(type(layer) is StaticLayer for layer in stock.layers):
        raise ValueError(
            f"{type(model).__name__}: a static cache needs every layer to attend to the whole context "
            "(sliding-window layers cannot be cropped back); use graphs=False"
        )
    return Cache(layers=[_span_layer()(capacity) for _ in stock.layers])


_SPAN_LAYER: Any = None


def _span_layer() -> Any:
    """transformers' StaticLayer whose attention reads only the first `span` positions: the
    attention kernels' work then follows the context rather than the capacity (one graph per
    span bucket)."""
    global _SPAN_LAYER
    if _SPAN_LAYER is None:
        from transformers.cache_utils import StaticLayer

        class SpanLayer(StaticLayer):
            span = 0  # set before each forward; 0: the whole capacity

            def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
                keys, values = super().update(key_states, value_states, *args, **kwargs)
                if self.span:
                    return keys[:, :, : self.span], values[:, :, : self.span]
                return keys, values

        _SPAN_LAYER = SpanLayer
    return _SPAN_LAYER


def static_cache_supported(model: Any) -> bool:
    """Whether `model` can run on a `StaticRunner` (full attention in every layer)."""
    try:
        _static_cache(model, 1)
    except (ValueError, TypeError, AttributeError):
        return False
    return True


class StaticRunner(CausalRunner):
    """`ids` is the sequence; the static cache holds its first `kv_len` tokens. `graphs` (CUDA only):
    feeds of at most GRAPH_MOST new tokens without hidden states replay a graph captured on first use."""

    def __init__(
        self, model: Any, ids: list[int], capacity: int, *, graphs: bool = True, bucket: int = BUCKET
    ) -> None:
        if capacity < 1:
            raise ValueError(f"a static cache needs a capacity of at least 1 position, got {capacity}")
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.capacity, self.bucket = capacity, bucket
        self.cache = _static_cache(model, capacity)
        self._layers: list[Any] = list(self.cache.layers)  # SpanLayers
        self.graphs_on = graphs and self.device.type == "cuda"
        self.graph_error: str | None = None  # why capture failed, if it did (then every feed runs eagerly)
        self._graphs: dict[tuple[int, int, int], tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pool: Any = None
        self._positions = torch.arange(capacity, device=self.device)
        self.reset(ids)

    def reset(self, ids: list[int]) -> None:
        """Start a new sequence on the same cache and graphs (what the old one left is never read)."""
        self.ids = list(ids)
        self.kv_len = 0
        self.spilled: CausalRunner | None = None

    # -- the sequence: delegated once it has outgrown the cache ------------------------------------

    def extend(self, ids: list[int]) -> None:
        if self.spilled is not None:
            self.spilled.extend(ids)
        else:
            super().extend(ids)

    def crop(self, n: int) -> None:
        if self.spilled is not None:
            self.spilled.crop(n)
        else:
            super().crop(n)

    def crop_cache(self, n: int) -> None:
        if self.spilled is not None:
            self.spilled.crop_cache(n)
        elif self.kv_len > n:
            self.kv_len = n  # the positions past n are rewritten before they are read again

    def _spill(self) -> CausalRunner:
        """Move the sequence to a dynamic cache: it re-feeds the whole sequence once."""
        if self.spilled is None:
            self.spilled = CausalRunner(self.model, self.ids)
            self.ids = self.spilled.ids
        return self.spilled

    # -- forwards ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, keep: int = 1, *, hidden: bool = False) -> torch.Tensor:
        if not 1 <= keep <= len(self.ids):
            raise ValueError(f"asked for logits of {keep} positions of a {len(self.ids)}-token sequence")
        if self.spilled is not None or len(self.ids) > self.capacity:
            spilled = self._spill()
            spilled_logits = spilled.forward(keep, hidden=hidden)
            if hidden:
                self.hidden = spilled.hidden
            return spilled_logits
        if len(self.ids) - self.kv_len < keep:
            self.crop_cache(len(self.ids) - keep)
        new = self.ids[self.kv_len :]
        logits: torch.Tensor | None = None
        if self.graphs_on and not hidden and len(new) <= GRAPH_MOST:
            logits = self._replay(new, keep)
        if logits is None:  # eager: a long feed, hidden states asked for, no graphs or a failed capture
            ids = torch.tensor([new], dtype=torch.long, device=self.device)
            start = torch.tensor(self.kv_len, dtype=torch.long, device=self.device)
            logits, states = self._run(ids, start, keep, hidden, self._span(len(new)))
            if hidden:
                self.hidden = states
        self.kv_len = len(self.ids)
        return logits

    @property
    def pending(self) -> int:
        return self.spilled.pending if self.spilled is not None else super().pending

    @torch.inference_mode()
    def prefill(self, limit: int) -> int:
        if self.spilled is not None or len(self.ids) > self.capacity:
            return self._spill().prefill(limit)
        end = min(self.kv_len + limit, len(self.ids) - 1)
        if end > self.kv_len:
            ids = torch.tensor([self.ids[self.kv_len : end]], dtype=torch.long, device=self.device)
            start = torch.tensor(self.kv_len, dtype=torch.long, device=self.device)
            self._run(ids, start, 1, False, self._span(end - self.kv_len))
            self.kv_len = end
        return self.pending

    def _span(self, n: int) -> int:
        """How many cache positions a feed of `n` tokens after the cached ones attends over."""
        return min(self.capacity, -(-(self.kv_len + n) // self.bucket) * self.bucket)

    def _run(
        self, ids: torch.Tensor, start: torch.Tensor, keep: int, hidden: bool, span: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of `ids` (1, n) written at positions start.. of the cache, attending over
        its first `span` positions; no host sync, so it can be captured. The additive mask lets
        each token see the positions up to its own."""
        n = ids.shape[1]
        where = start + torch.arange(n, device=self.device)
        for layer in self._layers:
            layer.span = span
            if layer.is_initialized:
                layer.cumulative_length.copy_(start)
            else:  # the first forward allocates the layer (never under capture: see _replay)
                layer.cumulative_length = start.clone()
        blocked = (self._positions[None, :span] > where[:, None]).to(self.dtype)
        mask = (blocked * torch.finfo(self.dtype).min)[None, None]
        out = self.model(
            input_ids=ids,
            position_ids=where[None],
            attention_mask=mask,
            use_cache=True,
            **{cache_keyword(self.model): self.cache},
            logits_to_keep=keep,
            output_hidden_states=hidden,
        )
        return out.logits[0, -keep:], (out.hidden_states[-1][0, -keep:] if hidden else None)

    def _replay(self, new: list[int], keep: int) -> torch.Tensor | None:
        """The logits of feeding `new` by replaying its shape's graph; None when the capture failed
        (graphs are then off for good and the caller runs the feed eagerly)."""
        span = self._span(len(new))
        key = (len(new), keep, span)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(new, keep, span)
            except Exception as exc:  # a model whose forward cannot be captured runs eagerly
                self.graphs_on, self.graph_error = False, f"{type(exc).__name__}: {exc}"[:300]
                return None
        graph, ids_in, start_in, logits = self._graphs[key]
        ids_in.copy_(torch.tensor([new], dtype=torch.long), non_blocking=True)
        start_in.fill_(self.kv_len)
        graph.replay()
        return logits.clone()

    def _capture(
        self, new: list[int], keep: int, span: int
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        ids_in = torch.tensor([new], dtype=torch.long, device=self.device)
        start_in = torch.tensor(self.kv_len, dtype=torch.long, device=self.device)
        # warm-up on a side stream (allocates the cache, loads the kernels); it writes the very
        # positions the replay writes next, so nothing of the sequence changes
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(ids_in, start_in, keep, False, span)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, _ = self._run(ids_in, start_in, keep, False, span)
        self._pool = graph.pool()
        return graph, ids_in, start_in, logits


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify_ms(runner: CausalRunner, k: int, reps: int) -> float:
    """Median ms of a verify of `k` drafted tokens after the runner's sequence (fed, read, cropped);
    the warm pass also captures the graph of a graphed runner."""
    from .kernels import median_ms

    base = len(runner.ids)
    draft = runner.ids[:k]
    runner.forward(keep=1)

    def once(_: Any) -> None:
        runner.extend(draft)
        runner.forward(keep=k + 1)
        _sync(runner.device)
        runner.crop(base)

    return median_ms(once, [None], reps)


def measure_graphs(
    model: Any, capacity: int, *, context: int = 200, k: int = 4, reps: int = 10
) -> dict[str, Any]:
    """A verify of `k` tokens after `context` tokens on the dynamic cache, eagerly, and on a static
    cache replaying graphs: both ms, and whether graphs were faster (the choice LocalTarget keeps)."""
    context = max(1, min(context, capacity - k - 1))
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    eager = verify_ms(CausalRunner(model, prompt.tolist()), k, reps)
    static = StaticRunner(model, prompt.tolist(), capacity=context + k + 1, graphs=True)
    graphed = verify_ms(static, k, reps)
    return {
        "eager_ms": round(eager, 3),
        "graph_ms": round(graphed, 3),
        "graphs": static.graph_error is None and graphed < eager,
        "error": static.graph_error,
    }
