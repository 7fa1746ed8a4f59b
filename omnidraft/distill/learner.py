"""What `learn=True` adds to a pairing: each verified request becomes a distillation example, and
every `interval` requests the pairing's adapter is updated (Algorithm 2).

Learning never holds up a reply. By default (`TrainConfig.background`) a request's learning is
queued when it ends, and a thread of the learner's own does it in units (one request scored and
buffered, or one optimizer step) while no request of the pairing runs: `pause` / `resume` bracket
each request, and a request that arrives while a unit runs waits for that one unit only. Inline
(`background=False`) the learning is done before `generate` returns: reproducible, for tests and
benchmarks. Each unit holds the drafter's lock: drafting (of this pairing or another one on the
same drafter) never reads an adapter mid-step or the wrong active adapter. Learning changes how
fast the pairing is, never what the target commits.

Test-Time Speculation (`TrainConfig.tts_every`): a long request also teaches the drafter while it
runs. `begin_request` keeps a copy of the adapter, `within_request` takes one fast Adam step on the
request so far, `end_request` puts the copy back, so Algorithm 2's updates see only whole requests.
The drafter's KV cache of the running request keeps what the older weights computed; drafting from it
stays correct (the target decides what is committed), only slightly less well aimed.

Learning that cannot hurt: each verified request is also scored, teacher-forced, with the adapter
being learned and with its `baseline` (the per-target adapter every user shares, or the base
drafter): how many of its direct positions each one's top-1 gets right, which is greedy acceptance
per position. Over the last `WINDOW` requests, the pairing stops drafting with the learned adapter
once it scores `MARGIN` below the baseline and drafts with it again once it scores at least as well
(`drafting_adapter`); it goes on learning either way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from .buffer import Example, VerifiedRequest, build_example
from .trainer import OnlineTrainer, TrainConfig

__all__ = ["Learner"]

log = logging.getLogger("omnidraft")

WINDOW = 8  # requests the learned adapter and its baseline are compared over
MIN_POSITIONS = 32  # direct positions scored before the comparison decides anything
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
        self._idle = threading.Condition()  # guards the queue, the units and the requests running
        self._queue: deque[tuple[VerifiedRequest, float, float]] = deque()  # requests to learn from
        self._steps: deque[tuple[Literal["step", "done"], list[Example]]] = deque()  # an update's
        self._logs: list[dict[str, float]] = []  # the running update's step logs
        self._serving = 0  # requests of the pairing running now
        self._busy = False  # a unit of learning is running
        self._working = False  # the learning thread has work or is doing it
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
        interval, seen = self.config.interval, self.requests
        if self._steps:
            when = "an update is under way between requests"
        else:
            left = interval - seen % interval
            first = "the first update" if self.steps == 0 else "the next update"
            when = f"{first} after {left} more request{'s' if left != 1 else ''} (one every {interval})"
        if self.trusted:
            return when
        own, base, n = self.scores or (0.0, 0.0, 0)
        other = "the shared adapter" if self.baseline is not None else "the base drafter"
        return (
            f"{when}; drafting with {other}: this adapter agrees with the target on {own:.0%} of "
            f"{n} positions over its last requests, {other} on {base:.0%}"
        )

    def _score(self, example: Any) -> None:
        """Score `example` with the adapter and with its baseline (teacher-forced top-1)."""
        with self._drafter_on(self.adapter):
            own, n = self.trainer.agreement(example)
            self.drafter.activate(self.baseline)
            base, _ = self.trainer.agreement(example)
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
        """One verified request to learn from: queued for the learning thread, or (inline) scored,
        buffered and, when the interval is complete, trained on before this returns."""
        self.requests += 1
        if not self.config.background:
            if self._learn(request, acceptance_rate, tau):
                self._update()
            return
        with self._idle:
            self._queue.append((request, acceptance_rate, tau))
            if not self._working:
                self._working = True
                name = f"omnidraft-learn-{self.adapter}"
                threading.Thread(target=self._work, name=name, daemon=True).start()
            self._idle.notify_all()

    def pause(self) -> None:
        """A request of the pairing begins: no unit of learning starts until it ends (`resume`); one
        that is running is waited for."""
        with self._idle:
            while self._busy:
                self._idle.wait()
            self._serving += 1

    def resume(self) -> None:
        """A request of the pairing has ended (after `pause`)."""
        with self._idle:
            self._serving -= 1
            self._idle.notify_all()

    def _learn(self, request: VerifiedRequest, acceptance_rate: float, tau: float) -> bool:
        """Score and buffer one request; True when the interval is complete (an update is due)."""
        self._recent.append((acceptance_rate, tau))
        example = self._example(request)
        self._score(example)
        return self.trainer.add(example)

    def _work(self) -> None:
        """The learning thread: one unit at a time, each while no request runs; it ends when the
        queue is empty (`observe` starts another)."""
        while True:
            with self._idle:
                while self._serving and (self._queue or self._steps):
                    self._idle.wait()
                if self.error is not None or not (self._queue or self._steps):
                    self._working = False
                    self._idle.notify_all()
                    return
                self._busy = True
                step = self._steps.popleft() if self._steps else None
                request = self._queue.popleft() if step is None else None
            try:
                if step is not None:
                    self._unit(*step)
                elif request is not None and self._learn(*request):
                    batches = self.trainer.take_batches()
                    with self._idle:
                        self._steps.extend([("step", b) for b in batches] + [("done", [])])
            except BaseException as exc:  # a thread has nobody to raise to: kept for wait()
                self.error = exc
            finally:
                with self._idle:
                    self._busy = False
                    self._idle.notify_all()

    def _unit(self, kind: Literal["step", "done"], batch: list[Example]) -> None:
        """One optimizer step of an update on `batch`, or ("done") the update's bookkeeping."""
        if kind == "done":
            logs, self._logs = self._logs, []
            self._record(logs)
            return
        with self._drafter_on(self.adapter):
            self._logs.append(self.trainer.step(batch))

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

    def wait(self) -> None:
        """Block until the learning queued so far is done; re-raise the learning thread's error, if
        any. (Never from inside a request of the pairing: the thread waits for it to end.)"""
        with self._idle:
            while self._working:
                self._idle.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"background training of adapter {self.adapter!r} failed") from error

    def _update(self) -> None:
        """An update inline: `epochs` passes over the buffer."""
        with self._drafter_on(self.adapter):
            logs = self.trainer.update()
        self._record(logs)

    def _record(self, logs: list[dict[str, float]]) -> None:
        """An update's metrics row: its steps' mean loss and the requests' acceptance and tau."""
        recent, self._recent = self._recent, []
        entry = {
            "requests": self.trainer.requests,
            "steps": self.trainer.steps,
            "loss": sum(x["loss"] for x in logs) / max(1, len(logs)),
            "acceptance_rate": sum(a for a, _ in recent) / max(1, len(recent)),
            "tau": sum(t for _, t in recent) / max(1, len(recent)),
        }
        self.metrics.append(entry)
        log.info("adapter %s updated: %s", self.adapter, entry)
