"""One vLLM engine driven by one thread, shared by every session of a `VLLMTarget`.

vLLM's `LLMEngine` is not thread-safe: requests are added and the engine is stepped here only,
on the loop's own thread. Callers on any thread `submit` a request and wait on its handle;
requests submitted while the engine is busy join the next step, so concurrent sessions' verifies
are batched by vLLM's scheduler (continuous batching), never serialised by a lock of ours.
Beside it: the engine arguments a verifying target needs (`engine_defaults`) and vLLM itself, or
how to install it (`require_vllm`). This module knows nothing about drafting or acceptance: it
moves token ids and vLLM outputs.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..errors import Cancelled

__all__ = ["DEFAULT_MAX_LOGPROBS", "EngineLoop", "Handle", "engine_defaults", "require_vllm"]

log = logging.getLogger(__name__)

GATHER_S = 0.02  # how long a step may wait for the next requests of sessions that were just answered
ACTIVE_S = 1.0  # a session answered within this long is one the loop waits for
CANCEL_POLL_S = 0.05  # how often a waiting request looks whether its client left
AOT_ENV = "VLLM_USE_AOT_COMPILE"  # vLLM's own switch; off on the CPU (engine_defaults)
EAGER_ENV = "OMNIDRAFT_VLLM_EAGER"  # "1": engines run eager unless their caller says otherwise
DEFAULT_MAX_LOGPROBS = 64  # top log-probabilities a request may ask for (distillation's top-k included)


def require_vllm() -> Any:
    # vLLM's own deprecation notices about torch (torch.distributed.reduce_op) are not the user's
    # to act on: they stay out of a run's output
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")
    try:
        import vllm
    except ImportError as exc:
        from ..errors import MissingDependencyError

        raise MissingDependencyError(
            "VLLMTarget needs vLLM: pip install 'omnidraft[vllm]' (the CPU build "
            "matching the torch pin) or vLLM itself on a GPU host"
        ) from exc
    mend_cpu_expand()
    return vllm


EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_by_request(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 (the kernel's own argument name)
) -> None:
    """vLLM's rejection sampler's `expand_kernel`: each request's value (`input_val`, with
    `replace_from` read as `replace_to`) written over its draft positions of `output`, which
    `cu_num_tokens` (cumulative draft tokens per request) delimits; any dtype."""
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output.copy_(torch.repeat_interleave(values, counts)[: output.numel()].to(output.dtype))


def mend_cpu_expand() -> None:
    """Replace the stand-in that vLLM's CPU backend registers for `expand_kernel` (without
    Triton-CPU) by `expand_by_request`. That stand-in writes into an int64 copy of its output
    and drops it, so a sampled request's temperature, top-p and top-k at its draft positions
    were uninitialised memory: its drafts were judged against a wrong distribution (those past the
    first never accepted, a draft accepted at the wrong rate), or a garbage top-k failed the whole
    engine step. Applied before an engine registers its kernels; an engine built earlier in this
    process is rebound."""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # a build without the CPU backend's stand-ins
        return
    if cpu_triton_utils._expand_kernel_impl is expand_by_request:
        return
    cpu_triton_utils._expand_kernel_impl = expand_by_request
    from vllm.triton_utils import dispatcher

    if EXPAND_KERNEL in dispatcher._registry:
        dispatcher.register_kernels({EXPAND_KERNEL: expand_by_request})


def engine_defaults(engine_args: dict[str, Any]) -> dict[str, Any]:
    """Engine arguments with what a verifying target needs (prefix caching, enough log-probabilities),
    what a server of many streams needs (a bound on a long prefill's tokens per step) and what
    vLLM's CPU backend needs (blocks of 32 tokens, an explicit KV-cache size) filled in where the
    caller left them out."""
    args = {"enable_prefix_caching": True, "max_logprobs": DEFAULT_MAX_LOGPROBS, "seed": 0, **engine_args}
    if os.environ.get(EAGER_ENV) == "1":  # no compilation: an engine up in seconds, its steps slower
        args.setdefault("enforce_eager", True)
    if not args["enable_prefix_caching"]:
        raise ValueError(
            "VLLMTarget needs enable_prefix_caching=True: a verify reads the context from the cache"
        )
    # a long prompt's prefill takes at most this many tokens a step while other requests run (vLLM
    # lifts the cap when it runs alone), so streaming sessions keep moving during it
    args.setdefault("long_prefill_token_threshold", 512 if torch.cuda.is_available() else 64)
    if not torch.cuda.is_available():
        args.setdefault("block_size", 32)  # the CPU attention backend's block size is a multiple of 32
        # vLLM's CPU build saves its AOT-compiled graph and then fails to load it ("'function' object
        # has no attribute 'finalize_loading'"), so every start compiled again; its inductor cache
        # loads, so an engine restarted on this machine skips the compilation (docs/vllm.md)
        os.environ.setdefault(AOT_ENV, "0")
        if "kv_cache_memory_bytes" not in args and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            args["kv_cache_memory_bytes"] = 2 << 30
    return args


@dataclass
class Handle:
    """One submitted request: its outputs arrive on `outputs` (vLLM RequestOutput deltas), then
    None when it finished, was aborted or the engine failed (`error`)."""

    request_id: str
    tag: str | None = None  # who asked (a session): the loop waits briefly for a session's next request
    outputs: queue.Queue = field(default_factory=queue.Queue)
    error: BaseException | None = None
    abort: Callable[[Handle], None] | None = field(default=None, repr=False)  # its loop's abort

    def stream(self, timeout: float | None = None, cancel: threading.Event | None = None) -> Iterator[Any]:
        """Each output as it arrives; raises the engine's error, if it failed. `cancel` set while it
        waits (its client left): the request is aborted and Cancelled raised."""
        while (item := self._next(timeout, cancel)) is not None:
            yield item
        if self.error is not None:
            raise self.error

    def result(self, timeout: float | None = None, cancel: threading.Event | None = None) -> Any:
        """The last output of a request (its final one when the request asked for FINAL_ONLY);
        `cancel` as for `stream`."""
        last = None
        for last in self.stream(timeout, cancel):
            pass
        if last is None:
            raise RuntimeError(f"vLLM request {self.request_id} ended without output (aborted)")
        return last

    def _next(self, timeout: float | None, cancel: threading.Event | None) -> Any:
        if cancel is None:
            return self.outputs.get(timeout=timeout)
        while True:  # wait in short slices, looking at `cancel` between them
            try:
                return self.outputs.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                if cancel.is_set():
                    if self.abort is not None:
                        self.abort(self)
                    raise Cancelled(f"vLLM request {self.request_id}: its client went away") from None


class EngineLoop:
    """A thread that owns `engine` (a vLLM LLMEngine): adds submitted requests, steps while any
    is unfinished, routes outputs to their handles, and sleeps while there is nothing to do."""

    def __init__(self, engine: Any, name: str = "vllm-engine") -> None:
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._handles: dict[str, Handle] = {}
        self._ids = itertools.count()
        self._closed = False
        self.steps, self.busy = (
            0,
            0.0,
        )  # engine steps taken and seconds spent in them (what a benchmark reads)
        self.durations: deque[float] = deque(maxlen=256)  # the latest steps' seconds
        self.prompt_tokens = self.cached_tokens = 0  # of finished requests: all, and read from the cache
        self._seen: dict[str, float] = {}  # tag -> when its last request finished
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, prompt: Any, params: Any, tag: str | None = None, outputs: queue.Queue | None = None
    ) -> Handle:
        """Queue one request (a vLLM prompt dict and SamplingParams) for `tag` (a session); returns
        its handle at once. `outputs`: the queue its outputs go to, when the caller waits on one
        queue for more than this request (default: a queue of its own)."""
        if self._closed:
            raise RuntimeError("the vLLM engine loop is closed")
        handle = Handle(f"od-{next(self._ids)}", tag, abort=self.abort)
        if outputs is not None:
            handle.outputs = outputs
        self._inbox.put(("add", handle, prompt, params))
        return handle

    def abort(self, handle: Handle) -> None:
        """Stop a request (its client is gone): the engine frees its KV pages; the handle ends."""
        self._inbox.put(("abort", handle, None, None))

    def forget(self, tag: str) -> None:
        """`tag`'s session is over: a step no longer waits for its next request (GATHER_S)."""
        self._inbox.put(("forget", None, tag, None))

    def close(self) -> None:
        """Abort whatever runs and stop the thread (the engine object stays the caller's)."""
        if not self._closed:
            self._closed = True
            self._inbox.put(("stop", None, None, None))
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            try:
                command = self._inbox.get(block=not busy)
            except queue.Empty:
                command = None
            deadline = time.monotonic() + GATHER_S
            while command is not None:
                if not self._apply(*command):
                    return
                command = self._next(deadline)
            if self.engine.has_unfinished_requests():
                self._step()

    def _next(self, deadline: float) -> tuple | None:
        """The next queued command; when none is queued, wait until `deadline` for one while a
        session that was just answered (likely to ask again at once) has not asked yet."""
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            wait = deadline - time.monotonic()
            if wait <= 0 or not self._awaited():
                return None
        try:
            return self._inbox.get(timeout=wait)
        except queue.Empty:
            return None

    def _awaited(self) -> int:
        """Sessions whose last request finished within ACTIVE_S and that have none queued or running:
        a step started without them would run them in the next one, alone (ping-pong)."""
        now, running = time.monotonic(), {h.tag for h in self._handles.values()}
        return sum(1 for tag, when in self._seen.items() if now - when < ACTIVE_S and tag not in running)

    def _apply(self, op: str, handle: Handle | None, prompt: Any, params: Any) -> bool:
        if op == "stop":
            self._fail_all(RuntimeError("the vLLM engine loop was closed"))
            return False
        if op == "forget":
            self._seen.pop(prompt, None)
            return True
        assert handle is not None
        if op == "add":
            try:
                self.engine.add_request(handle.request_id, prompt, params)
            except Exception as exc:  # a bad request: its caller gets the error, the engine goes on
                handle.error = exc
                handle.outputs.put(None)
                return True
            self._handles[handle.request_id] = handle
        elif op == "abort" and self._handles.pop(handle.request_id, None) is not None:
            self.engine.abort_request([handle.request_id])
            handle.outputs.put(None)
        return True

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
            self.steps += 1
            self.busy += time.perf_counter() - started
            self.durations.append(time.perf_counter() - started)
        except Exception as exc:  # the engine itself failed: every waiting caller hears of it
            log.exception("vLLM engine step failed")
            self._fail_all(exc)
            return
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue
            handle.outputs.put(out)
            if out.finished:
                self.prompt_tokens += len(out.prompt_token_ids or ())
                self.cached_tokens += out.num_cached_tokens or 0
                del self._handles[out.request_id]
                handle.outputs.put(None)
                if handle.tag is not None:
                    self._seen[handle.tag] = time.monotonic()
        if len(self._seen) > 4096:  # forget sessions long gone
            self._seen = {t: w for t, w in self._seen.items() if time.monotonic() - w < ACTIVE_S}

    def _fail_all(self, exc: BaseException) -> None:
        for handle in self._handles.values():
            handle.error = exc
            handle.outputs.put(None)
        self._handles.clear()
