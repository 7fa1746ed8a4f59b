"""One GGUF model in llama.cpp (through llama-cpp-python's low-level API), evaluated by token id.

`LlamaEngine.logits(ids, rows)` is the whole interface: the logits after each of the last `rows`
tokens of `ids`, leaving the context's KV cache holding exactly `ids`. It reuses the longest prefix
the cache already holds and removes everything after it first, so a rejected draft never leaves a
stale entry behind, and sessions that take turns on one engine each pay only for what differs
from the last caller's sequence (the prompt cache llama-cpp-python's own `generate` keeps).
Only the rows asked for are computed and copied: a verify costs O(draft), not O(context).

Lossless on llama.cpp needs the numbers, not only the algorithm, to match its own decoding: CPU
matrix kernels differ by batch size (a repacked GEMM from a few rows up, other tile kernels above
some size) and the attention kernels by the cache's length, and logits then differ in the last
bits, enough to flip a near-tie. So (docs/llamacpp.md): how many tokens one call may evaluate
and still give bit for bit what one token at a time gives is measured per machine, model and
settings and by context length (`exact_limits`, `rows_at`, remembered), a verify is fed in calls
of at most that many tokens (one at a time where no batch is exact), and a prompt is evaluated
as llama-cpp-python's `generate` evaluates it (in one call up to and including its last token).
The weights are repacked as llama.cpp does by default (the fastest decoding; `repack=False`
allows longer exact calls at short contexts but slows every call), here and in every baseline
`open_llama` builds.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from pathlib import Path
from typing import Sequence

import numpy as np

from ..runtime.measured import remembered
from .loading import close_at_exit, cpu_threads, open_llama, require_llama_cpp

__all__ = ["LlamaEngine"]

PROBE_ROWS = 16  # the most rows the batch-exactness probe tries
COST_CONTEXT = 200  # tokens of context before the tokens whose costs `row_costs` measures
# where it tries them: 248 / 256 straddle a stock build's limit (docs/llamacpp.md, tools/llama_wheel.py)
PROBE_CONTEXTS = (24, 128, 248, 256, 512, 1024, 2048)
# the probe reads each context in turn, so its cost grows with them (a 2,048-token read is tens of
# seconds for a 1.5B on two CPU cores): it stops at the first context past this many seconds, and
# past the last context it probed a call evaluates one token (exact, if slower to verify)
PROBE_BUDGET_S = 10.0


class _Slot:
    """One KV sequence of the context: its tokens in order and the caller that filled it."""

    def __init__(self, seq: int) -> None:
        self.seq, self.used = seq, 0
        self.cached: list[int] = []
        self.owner: object = None


class LlamaEngine:
    """A llama.cpp model and one context that callers take turns on.

    `threads`: llama.cpp's threads for decoding and prompt batches (default: every core).
    `n_ctx`: the longest sequence a caller may pass. `n_batch`: tokens per llama_decode call.
    `slots`: KV sequences kept side by side (each of `n_ctx`), one per recent owner (a server's
    sessions): an owner that finds its slot intact pays only for its new tokens; past `slots`
    owners, the least recently used slot is taken over and its owner evaluates afresh next time.
    `repack`: llama.cpp's weight repacking (its default, and its fastest decoding here)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        n_ctx: int = 4096,
        threads: int | None = None,
        n_batch: int = 512,
        flash_attn: bool = True,
        exact_rows: int | None = None,
        slots: int = 1,
        repack: bool = True,
    ) -> None:
        if n_ctx < 16 or n_batch < 16 or slots < 1:
            raise ValueError(
                f"n_ctx and n_batch must be >= 16 and slots >= 1, got {n_ctx}, {n_batch}, {slots}"
            )
        lc = self._lc = require_llama_cpp()
        self.path = Path(path)
        self.threads, self.flash_attn, self.repack = threads or cpu_threads(), flash_attn, repack
        self.llm = open_llama(
            self.path,
            n_ctx=n_ctx if slots == 1 else 64,
            threads=self.threads,
            n_batch=n_batch,
            flash_attn=flash_attn,
            repack=repack,
        )
        self._context = self.llm._ctx
        if slots > 1:  # llama-cpp-python's Llama keeps one sequence: a context of our own holds `slots`
            from llama_cpp import _internals

            params = lc.llama_context_params.from_buffer_copy(self.llm.context_params)
            params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx * slots, slots, False
            params.n_batch = params.n_ubatch = n_batch
            self._context = _internals.LlamaContext(model=self.llm._model, params=params, verbose=False)
            close_at_exit(self._context)
        self._ctx = self._context.ctx
        self._memory = lc.llama_get_memory(self._ctx)
        self._vocab = lc.llama_model_get_vocab(self.llm._model.model)
        self.n_vocab = int(self.llm.n_vocab())
        self.n_ctx = n_ctx if slots > 1 else int(self.llm.n_ctx())
        self.n_batch = n_batch
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        self._free = weakref.finalize(self, lc.llama_batch_free, self._batch)
        self._slots = [_Slot(i) for i in range(slots)]
        self._slot = self._slots[0]  # the slot the current call works on
        self._clock = 0
        self.lock = threading.RLock()
        self.decoded = 0  # tokens evaluated so far (a counter for benchmarks)
        # [(context, rows)]: at a cache of up to `context` tokens, calls of up to `rows` tokens are bit-exact
        self.exact_limits: list[tuple[int, int]] = (
            [(self.n_ctx, exact_rows)] if exact_rows else self._exact_limits()
        )
        self.exact_rows = self.exact_limits[0][1]  # at the shortest context probed (the most)
        self._row_costs: dict[int, dict[int, float]] = {}

    def use_threads(self, threads: int | None) -> None:
        """Decode on `threads` threads from now on (None: those it was loaded with)."""
        n = threads or self.threads
        self._lc.llama_set_n_threads(self._ctx, n, n)

    def eog_ids(self) -> frozenset[int]:
        """Every id llama.cpp ends a generation on (EOS, EOT and the template's end tokens)."""
        is_eog = self._lc.llama_vocab_is_eog
        return frozenset(t for t in range(self.n_vocab) if is_eog(self._vocab, t))

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's own tokenization of `text` (no BOS, special tokens parsed)."""
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))

    def logits(
        self, ids: Sequence[int], rows: int, *, prompt: int | None = None, owner: object = None
    ) -> np.ndarray:
        """(rows, V) float32: the logits after each of the last `rows` tokens of `ids`.

        `prompt`: how many leading tokens are a prompt, evaluated as llama.cpp's `generate` does
        (in calls of up to n_batch from position 0); every later token is evaluated at most
        `exact_rows` a call, which gives what one token a call gives. Default: all but the asked
        rows (fastest; a drafter's choice). `owner`: a caller whose outputs must not depend on who
        used the engine before (a target session): when the cache was filled by someone else it
        is cleared and this owner's sequence evaluated afresh."""
        n = len(ids)
        if not 1 <= rows <= n:
            raise ValueError(f"rows must be in [1, len(ids)], got {rows} for {n} ids")
        if n > self.n_ctx:
            raise ValueError(
                f"the sequence has {n} tokens; this llama.cpp context holds {self.n_ctx} (n_ctx)"
            )
        first = n - rows  # the first position whose logits are asked for
        prompt = first + 1 if prompt is None else prompt
        with self.lock:
            self._select(owner)
            self._drop_after(min(self._common_prefix(ids), first))
            out = np.empty((rows, self.n_vocab), dtype=np.float32)
            while len(self.cached) < n:
                start = len(self.cached)
                end = (
                    min(start + self.n_batch, prompt)
                    if start < prompt
                    else min(start + self.rows_at(start), n)
                )
                keep = max(0, end - max(start, first))  # the batch's last `keep` tokens have asked-for rows
                self._decode(ids[start:end], keep)
                for i in range(keep):
                    out[end - keep + i - first] = self._row(end - start - keep + i)
            return out

    @property
    def cached(self) -> list[int]:
        """The tokens whose KV entries the last caller's slot holds, in order."""
        return self._slot.cached

    def _select(self, owner: object) -> None:
        """Work on `owner`'s slot; a new owner takes a free or the least recently used one, cleared.
        Callers without an owner (drafters) share the first slot and reuse whatever prefix it holds."""
        self._clock += 1
        slot = (
            next((s for s in self._slots if s.owner is owner), None) if owner is not None else self._slots[0]
        )
        if slot is None:
            slot = min(self._slots, key=lambda s: (s.owner is not None, s.used))
            self._slot = slot
            self._clear()
        self._slot, slot.owner, slot.used = slot, owner, self._clock

    def release(self, owner: object) -> None:
        """`owner` is done: its slot is the first to be taken over."""
        with self.lock:
            for slot in self._slots:
                if slot.owner is owner:
                    slot.owner, slot.used = None, 0

    def _clear(self) -> None:
        self._lc.llama_memory_seq_rm(self._memory, self._slot.seq, -1, -1)
        self._slot.cached.clear()

    def _row(self, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(self._lc.llama_get_logits_ith(self._ctx, i), shape=(self.n_vocab,))

    def measure_key(self) -> str:
        """What this engine's numbers and costs are a function of besides the machine."""
        return (
            f"{self.path.name}|{self.path.stat().st_size}|{self._lc.__version__}|{self.threads}|"
            f"{self.flash_attn}|repack {self.repack}"
        )

    def rows_at(self, context: int) -> int:
        """The most tokens one call may evaluate bit-exactly after a cache of `context` tokens."""
        for limit, rows in self.exact_limits:
            if context <= limit:
                return rows
        return 1

    def _exact_limits(self) -> list[tuple[int, int]]:
        """How many tokens one call may evaluate and give, bit for bit, the logits one token a call
        gives, by context length (attention kernels change with the cache's length too): measured
        once per machine, llama.cpp build, model file and settings, then remembered."""
        found = remembered(
            "llama-exact-rows", f"{self.measure_key()}|n_ctx {self.n_ctx}|by context", self._probe_limits
        )
        return [(int(c), int(r)) for c, r in found]

    def _probe_limits(self) -> list[list[int]]:
        """[[context, rows]] ascending: `rows` is exact at every probed context up to the next
        entry's (conservative between probes: the lower of the two ends); past the last, 1. Longer
        contexts are probed until `PROBE_BUDGET_S` is spent."""
        text = (
            "def area(radius):\n    return 3.14159 * radius ** 2\n\n# The area of a circle with radius r\n"
            * 200
        )
        ids = self.tokenize(text)
        grid = [c for c in PROBE_CONTEXTS if c + PROBE_ROWS < min(self.n_ctx, len(ids))]
        rows: list[int] = []
        self.reset()
        started = time.perf_counter()
        for context in grid:  # until no batch is exact; each context extends the last one's cache
            rows.append(self._probe_exact_rows(ids[:context]))
            if rows[-1] == 1 or time.perf_counter() - started > PROBE_BUDGET_S:
                break
        self.reset()
        limits = [
            [grid[i + 1] if i + 1 < len(rows) else grid[i], min(rows[i : i + 2])] for i in range(len(rows))
        ]
        return [limit for limit in limits if limit[1] > 1] or [[grid[0] if grid else 1, 1]]

    def row_costs(self, up_to: int = 8) -> dict[int, float]:
        """Seconds to evaluate n = 1..`up_to` tokens after a context and get their logits, fed as a
        verify is (calls of at most `exact_rows`): what verifying n tokens costs. Measured once per
        machine, model and settings (a few seconds), then remembered."""
        if up_to not in self._row_costs:
            costs = remembered(
                "llama-row-costs", f"{self.measure_key()}|rows {up_to}", lambda: self._time_rows(up_to)
            )
            self._row_costs[up_to] = {int(n): float(s) for n, s in costs.items()}
        return dict(self._row_costs[up_to])

    def _time_rows(self, up_to: int, reps: int = 5) -> dict[str, float]:
        text = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n' * 12
        ids = self.tokenize(text)[: min(COST_CONTEXT, self.n_ctx - up_to - 1)]
        times: dict[int, list[float]] = {n: [] for n in range(1, up_to + 1)}
        with self.lock:
            self.logits(ids, 1, owner=self)
            for _ in range(reps):  # interleaved, so that a slow moment spreads over every n
                for n in times:
                    started = time.perf_counter()
                    self.logits(ids + ids[:n], n, prompt=len(ids), owner=self)
                    times[n].append(time.perf_counter() - started)
            self.release(self)
        return {str(n): sorted(t)[len(t) // 2] for n, t in times.items()}

    def _probe_exact_rows(self, prompt: list[int]) -> int:
        """The most tokens one call evaluates as one token a call does, after `prompt`; the cache
        may hold a prefix of it already (both sides of the comparison build on the same cache)."""
        self._drop_after(len(prompt) - 1)
        for start in range(len(self.cached), len(prompt) - 1, self.n_batch):
            self._decode(prompt[start : min(start + self.n_batch, len(prompt) - 1)], 0)
        reference, seq = [], list(prompt)
        for _ in range(PROBE_ROWS):  # one token a call
            self._decode(seq[len(self.cached) :], 1)
            reference.append(self._row(0).copy())
            seq.append(int(reference[-1].argmax()))
        best = 1
        for rows in range(2, PROBE_ROWS + 1):
            self._drop_after(len(prompt) - 1)
            self._decode(seq[len(prompt) - 1 : len(prompt) - 1 + rows], rows)
            if not all(np.array_equal(self._row(i), reference[i]) for i in range(rows)):
                break
            best = rows
        self._drop_after(len(prompt) - 1)
        return best

    def reset(self) -> None:
        """Forget every cached entry of every slot."""
        with self.lock:
            self._lc.llama_memory_clear(self._memory, True)
            for slot in self._slots:
                slot.cached.clear()
                slot.owner = None

    def _common_prefix(self, ids: Sequence[int]) -> int:
        cached, m = self.cached, min(len(self.cached), len(ids))
        if list(ids[:m]) == cached[:m]:
            return m
        a, b = np.asarray(cached[:m]), np.asarray(ids[:m])
        return int(np.argmax(a != b))

    def _drop_after(self, keep: int) -> None:
        if keep >= len(self.cached):
            return
        if not self._lc.llama_memory_seq_rm(self._memory, self._slot.seq, keep, -1):
            self._clear()  # a cache that cannot drop a suffix starts over
            return
        del self.cached[keep:]

    def _decode(self, tokens: Sequence[int], with_logits: int) -> None:
        """Feed `tokens` after the cache; the last `with_logits` of them keep their logits."""
        b, n, start = self._batch, len(tokens), len(self.cached)
        b.n_tokens = n
        for i, token in enumerate(tokens):
            b.token[i] = token
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = self._slot.seq
            b.logits[i] = i >= n - with_logits
        status = self._lc.llama_decode(self._ctx, b)
        if status != 0:
            self._lc.llama_memory_seq_rm(
                self._memory, self._slot.seq, start, -1
            )  # nothing half-fed stays behind
            raise RuntimeError(f"llama_decode failed with status {status} at position {start} ({n} tokens)")
        self.cached.extend(int(t) for t in tokens)
        self.decoded += n

    def __repr__(self) -> str:
        return (
            f"LlamaEngine({self.path.name}, n_ctx {self.n_ctx}, {self.threads} threads, "
            f"exact rows {self.exact_rows})"
        )
