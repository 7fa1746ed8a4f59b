"""What `learn=True` adds to a pairing: each verified request becomes a distillation example, and
every `interval` requests the pairing's adapter is updated (Algorithm 2).

Learning never holds up a reply. By default (`TrainConfig.background`) a request's learning is
queued when it ends, and a thread of the learner's own does it in units while no request of the
process runs (runtime/activity.py: another user's or another target's pairing counts too): a
request taken in, a request scored, one example's gradient (forward and backward over one example),
an optimizer step. A unit running when a request begins stops at its next decoder layer, forward or
backward (`Preempted`), so a request waits for at most one layer, and the unit is done again after
it (one stopped `TRIES` times is given up, `dropped`: learning that never fits between requests does
not take their CPU). `pause` / `resume` bracket each request of the pairing: its CPU time and its
wait for a unit to stop are counted. Inline (`background=False`) the same units run before
`generate` returns: reproducible, for tests and benchmarks. Each unit holds the drafter's lock:
drafting (of this pairing or another one on the same drafter) never reads an adapter mid-step or
the wrong active adapter. Learning changes how fast the pairing is, never what the target
commits. `TrainConfig.cpu_share` caps learning's CPU time at a share of the requests' own
(`cpu_learning`, `cpu_requests`): a request over it is not learned from (`skipped`).

Test-Time Speculation (`TrainConfig.tts_every`): a long request also teaches the drafter while it
runs. `begin_request` keeps a copy of the adapter, `within_request` takes one fast Adam step on the
request so far, `end_request` puts the copy back, so Algorithm 2's updates see only whole requests.
The drafter's KV cache of the running request keeps what the older weights computed; drafting from it
stays correct (the target decides what is committed), only slightly less well aimed.

Learning that cannot hurt: one verified request in `TrainConfig.guard_every` is also scored,
teacher-forced, with the adapter being learned and with its `baseline` (the per-target adapter
every user shares, or the base drafter): how many of its direct positions each one's top-1 gets
right, which is greedy acceptance per position. Over the last `WINDOW` scored requests, the
pairing stops drafting with the learned adapter once it scores `MARGIN` below the baseline and
drafts with it again once it scores at least as well (`drafting_adapter`); it goes on learning
either way.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch

from ..runtime.activity import REQUESTS
from .buffer import VerifiedRequest, build_example
from .trainer import OnlineTrainer, Preempted, TrainConfig

__all__ = ["Learner"]

log = logging.getLogger("omnidraft")

_LIVE: weakref.WeakSet[Learner] = weakref.WeakSet()  # learners whose thread has started


@atexit.register
def _close_all() -> None:
    for learner in list(_LIVE):
        learner.close()


WINDOW = 8  # requests the learned adapter and its baseline are compared over
MIN_POSITIONS = 32  # direct positions scored before the comparison decides anything
TRIES = 2  # times a unit of learning may be stopped by requests before it is given up
MARGIN = 0.02  # agreement a trusted adapter may fall below its baseline's before it stops drafting


class Learner:
    def __init__(
        self,
        drafter: Any,
        adapter: str,
        t2d: torch.Tensor,
        target_bytes: Any,
        config: TrainConfig = TrainConfig(),
        start_step: int = 0,
        baseline: str | None = None,
    ) -> None:
        self.drafter, self.adapter, self.t2d, self.target_bytes, self.config = (
            drafter,
            adapter,
            t2d,
            target_bytes,
            config,
        )
        drafter.activate(adapter)
        self.trainer = OnlineTrainer(
            drafter.learner, t2d, config, step_lock=drafter.lock, start_step=start_step
        )
        self.metrics: list[dict[str, float]] = []  # one entry per update
        self._recent: list[
            tuple[float, float]
        ] = []  # (acceptance rate, tau) of requests since the last update
        self._idle = REQUESTS.condition  # guards the queue, the units and the requests running
        self._units: deque[tuple[str, Any, int]] = deque()  # (kind, what, times stopped): see `_admit`
        self._logs: list[dict[str, float]] = []  # the running update's step logs
        self._serving = 0  # requests of the pairing running now
        self._busy = False  # a unit of learning is running
        self._working = False  # the learning thread has work or is doing it
        self.cpu_requests = 0.0  # the process's CPU seconds while requests of the pairing ran
        self.cpu_learning = 0.0  # and in units of learning (no request runs beside one)
        self._cpu_since = 0.0
        self.waited = 0.0  # seconds requests waited in `pause` for a running unit to stop
        self._thread: threading.Thread | None = None  # the learning thread, once started
        self._closing = False  # `close` was called: the thread stops at its next layer
        self.skipped = 0  # requests not learned from: `cpu_share` was spent
        self.dropped = 0  # units of learning given up: requests stopped them `TRIES` times
        self.requests = 0  # requests handed to the learner
        self._trusted = True  # the pairing drafts with the adapter (see `trusted`)
        self.error: BaseException | None = None
        self._saved: list[torch.Tensor] | None = None  # the adapter as it was before this request (TTS)
        self._fast: torch.optim.Optimizer | None = None
        self.baseline = baseline  # what the adapter must score at least as well as (None: the base)
        self._scores: deque[tuple[int, int, int]] = deque(maxlen=WINDOW)  # (own right, baseline right, n)
        self.fast_steps = 0  # Test-Time Speculation steps taken, over all requests
        self.fast_seconds = (
            0.0  # and the wall time they took (each holds the drafter: nothing drafts meanwhile)
        )

    @property
    def steps(self) -> int:
        return self.trainer.steps

    @property
    def scores(self) -> tuple[float, float, int] | None:
        """(adapter, baseline) greedy agreement over the last `WINDOW` requests and the positions
        scored; None before `MIN_POSITIONS` positions."""
        n = sum(s[2] for s in self._scores)
        if n < MIN_POSITIONS:
            return None
        return sum(s[0] for s in self._scores) / n, sum(s[1] for s in self._scores) / n, n

    @property
    def trusted(self) -> bool:
        """Whether the pairing drafts with the adapter: True until it is measured; then False once it
        scores `MARGIN` below its baseline, True again once it scores at least as well (a margin, so
        two near-equal adapters do not take turns request by request)."""
        return self._trusted

    @property
    def drafting_adapter(self) -> str | None:
        """The adapter the pairing should draft with: the learned one while it is trusted, else its
        baseline."""
        return self.adapter if self.trusted else self.baseline

    def note(self) -> str:
        """When the adapter's next update comes, and which adapter drafts if not the learned one,
        in words (a request's stats carry it)."""
        interval, seen = self.config.interval, self.requests - self.skipped
        with self._idle:
            updating = any(kind == "step" for kind, _, _ in self._units)
        if updating:
            when = "an update is under way between requests"
        else:
            left = interval - seen % interval
            first = "the first update" if self.steps == 0 else "the next update"
            when = f"{first} after {left} more request{'s' if left != 1 else ''} (one every {interval})"
        if self.skipped:
            share = f"{self.config.cpu_share:.0%}"
            when += f"; learning from {seen} of {self.requests} requests (a CPU share of {share})"
        if self.trusted:
            return when
        own, base, n = self.scores or (0.0, 0.0, 0)
        other = "the shared adapter" if self.baseline is not None else "the base drafter"
        return (
            f"{when}; drafting with {other}: this adapter agrees with the target on {own:.0%} of "
            f"{n} positions over its last requests, {other} on {base:.0%}"
        )

    def _score(self, example: Any, stop: Callable[[], bool] | None = None) -> None:
        """Score `example` with the adapter and with its baseline (teacher-forced top-1)."""
        with self._drafter_on(self.adapter):
            own, n = self.trainer.agreement(example, stop)
            self.drafter.activate(self.baseline)
            base, _ = self.trainer.agreement(example, stop)
        if n:
            trusted = self._trusted
            self._scores.append((own, base, n))
            if (scores := self.scores) is not None:
                self._trusted = scores[0] >= scores[1] - (MARGIN if trusted else 0.0)
            if trusted != self.trusted:
                other = self.baseline or "the base drafter"
                log.info(
                    "adapter %s: drafting with %s", self.adapter, self.adapter if self.trusted else other
                )

    def observe(self, request: VerifiedRequest, acceptance_rate: float, tau: float) -> None:
        """One verified request to learn from: queued for the learning thread, or (inline) learned
        from before this returns."""
        self.requests += 1
        if not self.config.background:
            self._units.append(("request", (request, acceptance_rate, tau), 0))
            while self._units:
                self._run(self._units.popleft(), None)
            return
        with self._idle:
            self._units.append(("request", (request, acceptance_rate, tau), 0))
            if not self._working:
                self._working = True
                name = f"omnidraft-learn-{self.adapter}"
                self._thread = threading.Thread(target=self._work, name=name, daemon=True)
                self._thread.start()
                _LIVE.add(self)
            self._idle.notify_all()

    def pause(self) -> None:
        """A request of the pairing begins, inside `REQUESTS.serving` (so no unit of learning starts
        until it ends, and one that is running stops at its next layer, to be done again later):
        the time it waits for that unit to stop is counted in `waited`, its CPU time from here to
        `resume` in `cpu_requests`."""
        with self._idle:
            if not REQUESTS.running:
                raise RuntimeError("Learner.pause() outside a request: call it inside REQUESTS.serving()")
            if not self._serving:
                self._cpu_since = time.process_time()
            self._serving += 1
            if self._busy:
                started = time.perf_counter()
                while self._busy:
                    self._idle.wait()
                self.waited += time.perf_counter() - started

    def resume(self) -> None:
        """A request of the pairing has ended (after `pause`)."""
        with self._idle:
            self._serving -= 1
            if not self._serving:
                self.cpu_requests += time.process_time() - self._cpu_since
            self._idle.notify_all()

    def _admit(self, request: VerifiedRequest, acceptance_rate: float, tau: float) -> None:
        """Take one request into learning (unless it would go over `cpu_share`): its example is
        buffered, every `guard_every`-th one scored, and once the interval is complete the
        update's units are queued: one per example of each batch, a step after each batch."""
        cfg = self.config
        self._recent.append((acceptance_rate, tau))
        admitted = self.trainer.requests
        cost = self.cpu_learning / admitted if admitted else 0.0  # a request's learning, so far
        if cfg.cpu_share and self.cpu_learning + cost > cfg.cpu_share * self.cpu_requests:
            self.skipped += 1
            return
        example = self._example(request)
        if admitted % cfg.guard_every == 0:
            self._units.append(("score", example, 0))
        if self.trainer.add(example):  # the update runs before the requests queued after this one
            update: list[tuple[str, Any, int]] = []
            for batch in self.trainer.take_batches():
                update += [("grad", (e, batch), 0) for e in batch] + [("step", None, 0)]
            recent, self._recent = self._recent, []
            self._units.extendleft(reversed(update + [("done", (self.trainer.requests, recent), 0)]))

    def _work(self) -> None:
        """The learning thread: one unit at a time, each while no request runs; a unit a request
        stopped goes back to the queue's head. It ends when the queue is empty (`observe` starts
        another)."""
        # one intra-op thread here: a second thread driving PyTorch's full pool left the requests'
        # own threads partly idle afterwards (docs/personalization.md), and learning has no hurry
        torch.set_num_threads(1)
        while True:
            with self._idle:
                while REQUESTS.running and self._units and not self._closing:
                    self._idle.wait()
                if self.error is not None or not self._units or self._closing:
                    self._working = False
                    self._idle.notify_all()
                    return
                self._busy = True
                unit = self._units.popleft()
            try:
                self._run(unit, lambda: REQUESTS.running > 0 or self._closing)
            except Preempted:  # done again after the request, or given up after `TRIES`
                kind, what, tries = unit
                with self._idle:
                    if tries + 1 < TRIES:
                        self._units.appendleft((kind, what, tries + 1))
                    else:
                        self.dropped += 1
            except BaseException as exc:  # a thread has nobody to raise to: kept for wait()
                self.error = exc
            finally:
                with self._idle:
                    self._busy = False
                    self._idle.notify_all()

    def _run(self, unit: tuple[str, Any, int], stop: Callable[[], bool] | None) -> None:
        """One unit of learning (see `_admit`); its CPU time is counted in `cpu_learning`."""
        kind, what, _ = unit
        started = time.process_time()
        try:
            if kind == "request":
                self._admit(*what)
            elif kind == "score":
                self._score(what, stop)
            elif kind == "grad":
                example, batch = what
                with self._drafter_on(self.adapter):
                    self.trainer.accumulate(example, batch, stop)
            elif kind == "step":
                if self.trainer.accumulated:  # (none where every example's unit was given up)
                    with self._drafter_on(self.adapter):
                        self._logs.append(self.trainer.apply())
                        self.drafter.drafting_model()  # the merged weights built here, not in a reply
            else:
                logs, self._logs = self._logs, []
                self._record(logs, *what)
        finally:
            self.cpu_learning += time.process_time() - started

    @contextmanager
    def _drafter_on(self, adapter: str | None) -> Iterator[None]:
        """The drafter held (its lock) with `adapter` active; the adapter it had comes back after."""
        with self.drafter.lock:
            previous = self.drafter.active
            try:
                self.drafter.activate(adapter)
                yield
            finally:
                self.drafter.activate(previous)

    def _example(self, request: VerifiedRequest) -> Any:
        cfg = self.config
        return build_example(
            request, self.drafter, self.target_bytes, self.t2d, spans=cfg.spans, context=cfg.context
        )

    def begin_request(self) -> None:
        """Test-Time Speculation: remember the adapter before a request changes it (no-op when off)."""
        if not self.config.tts_every:
            return
        with self.drafter.lock:  # (no unit of learning runs while a request does: `pause`)
            self._saved = [p.detach().clone() for p in self.trainer.params]
            self.drafter.merge_adapters = False  # fast steps every few rounds: draft through the LoRA layers
        self._fast = torch.optim.Adam(self.trainer.params, lr=self.config.tts_lr)

    def within_request(self, request: VerifiedRequest) -> None:
        """One fast step on the running request's verified part (after `begin_request`)."""
        if self._fast is None:
            raise RuntimeError("within_request() outside a request: call begin_request() first")
        started = time.perf_counter()
        example = self._example(request)
        if not len(example.kl_rows) and not len(example.ng_rows):
            return  # nothing labelled yet (e.g. only misaligned tokens)
        with self._drafter_on(self.adapter):
            self.trainer.step([example], optimizer=self._fast)
        self.fast_steps += 1
        self.fast_seconds += time.perf_counter() - started

    def end_request(self) -> None:
        """Undo the request's fast steps: the adapter is again what Algorithm 2 made it."""
        saved, self._saved, self._fast = self._saved, None, None
        if saved is None:
            return
        with self.drafter.lock, torch.no_grad():
            for p, old in zip(self.trainer.params, saved):
                p.copy_(old)
            self.drafter.merge_adapters = True

    def close(self, timeout: float = 10.0) -> None:
        """Stop learning: a running unit stops at its next layer, what is queued is left undone (the
        adapter keeps its last step), and the thread is waited for up to `timeout` seconds. Done for
        every learner at interpreter exit: a thread killed inside a PyTorch op aborts the process
        ("terminate called without an active exception")."""
        with self._idle:
            self._closing = True
            self._idle.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def wait(self) -> None:
        """Block until the learning queued so far is done; re-raise the learning thread's error, if
        any. Refused (RuntimeError) where it would never return: in a thread with a request of the
        process still running (a stream not finished), as learning waits for it to end."""
        with self._idle:
            while self._working:
                if REQUESTS.inside():
                    raise RuntimeError(
                        f"waiting for adapter {self.adapter!r} to learn inside a request (a stream not yet "
                        "finished?) would never end: learning runs between requests; it stays queued"
                    )
                self._idle.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"background training of adapter {self.adapter!r} failed") from error

    def _record(self, logs: list[dict[str, float]], requests: int, recent: list[tuple[float, float]]) -> None:
        """An update's metrics row: its steps' mean loss, the requests learned from so far and the
        acceptance and tau of the ones since the last update (`recent`)."""
        entry = {
            "requests": requests,
            "steps": self.trainer.steps,
            "loss": sum(x["loss"] for x in logs) / max(1, len(logs)),
            "acceptance_rate": sum(a for a, _ in recent) / max(1, len(recent)),
            "tau": sum(t for _, t in recent) / max(1, len(recent)),
        }
        self.metrics.append(entry)
        log.info("adapter %s updated: %s", self.adapter, entry)
