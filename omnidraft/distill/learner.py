"""What `learn=True` adds to a pairing: each verified request becomes a distillation example, and
every `interval` requests the pairing's adapter is updated (Algorithm 2), either right after the
request that completes the interval or in a background thread.

An update holds the drafter's lock from start to end: drafting (of this pairing or another one on
the same drafter) waits rather than read an adapter mid-step or the wrong active adapter. Learning
changes how fast the pairing is, never what the target commits.

Test-Time Speculation (`TrainConfig.tts_every`): a long request also teaches the drafter while it
runs. `begin_request` keeps a copy of the adapter, `within_request` takes one fast Adam step on the
request so far, `end_request` puts the copy back, so Algorithm 2's updates see only whole requests.
The drafter's KV cache of the running request keeps what the older weights computed; drafting from it
stays correct (the target decides what is committed), only slightly less well aimed.

Learning that cannot hurt: each verified request is also scored, teacher-forced, with the adapter
being learned and with its `baseline` (the per-target adapter every user shares, or the base
drafter): how many of its direct positions each one's top-1 gets right, which is greedy acceptance
per position. The pairing drafts with the learned adapter only while it scores at least as well as
the baseline over the last `WINDOW` requests (`drafting_adapter`); it goes on learning either way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import torch

from .buffer import VerifiedRequest, build_example
from .trainer import OnlineTrainer, TrainConfig

__all__ = ["Learner"]

log = logging.getLogger("omnidraft")

WINDOW = 8  # requests the learned adapter and its baseline are compared over
MIN_POSITIONS = 32  # direct positions scored before the comparison decides anything


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
        self._thread: threading.Thread | None = None
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
        """Whether the adapter scores at least as well as its baseline (True until it is measured)."""
        scores = self.scores
        return scores is None or scores[0] >= scores[1]

    @property
    def drafting_adapter(self) -> str | None:
        """The adapter the pairing should draft with: the learned one while it is trusted, else its
        baseline."""
        return self.adapter if self.trusted else self.baseline

    def note(self) -> str:
        """When the adapter's next update comes, and which adapter drafts if not the learned one,
        in words (a request's stats carry it)."""
        interval, seen = self.config.interval, self.trainer.requests
        if self._thread is not None and self._thread.is_alive():
            when = "an update is running beside the requests"
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
        with self.drafter.lock:
            previous = self.drafter.active
            try:
                self.drafter.activate(self.adapter)
                own, n = self.trainer.agreement(example)
                self.drafter.activate(self.baseline)
                base, _ = self.trainer.agreement(example)
            finally:
                self.drafter.activate(previous)
        if n:
            trusted = self.trusted
            self._scores.append((own, base, n))
            if trusted != self.trusted:
                other = self.baseline or "the base drafter"
                log.info(
                    "adapter %s: drafting with %s", self.adapter, self.adapter if self.trusted else other
                )

    def observe(self, request: VerifiedRequest, acceptance_rate: float, tau: float) -> None:
        """Buffer one verified request; train when the interval is complete."""
        self._recent.append((acceptance_rate, tau))
        example = build_example(request, self.drafter, self.target_bytes, self.t2d, spans=self.config.spans)
        if self._thread is None or not self._thread.is_alive():  # (an update holds the drafter: skip)
            self._score(example)
        if not self.trainer.add(example):
            return
        self.wait()
        if self.config.background:
            self._thread = threading.Thread(
                target=self._update, name=f"omnidraft-learn-{self.adapter}", daemon=True
            )
            self._thread.start()
        else:
            self._update()

    def begin_request(self) -> None:
        """Test-Time Speculation: remember the adapter before a request changes it (no-op when off)."""
        if not self.config.tts_every:
            return
        self.wait()  # a background update must land before the copy is taken
        with self.drafter.lock:
            self._saved = [p.detach().clone() for p in self.trainer.params]
        self._fast = torch.optim.Adam(self.trainer.params, lr=self.config.tts_lr)

    def within_request(self, request: VerifiedRequest) -> None:
        """One fast step on the running request's verified part (after `begin_request`)."""
        if self._fast is None:
            raise RuntimeError("within_request() outside a request: call begin_request() first")
        started = time.perf_counter()
        example = build_example(request, self.drafter, self.target_bytes, self.t2d, spans=self.config.spans)
        if not len(example.kl_rows) and not len(example.ng_rows):
            return  # nothing labelled yet (e.g. only misaligned tokens)
        with self.drafter.lock:
            previous = self.drafter.active
            self.drafter.activate(self.adapter)
            try:
                self.trainer.step([example], optimizer=self._fast)
            finally:
                self.drafter.activate(previous)
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
        """Block until a background update in flight has finished; re-raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"background training of adapter {self.adapter!r} failed") from error

    def _update(self) -> None:
        try:
            with self.drafter.lock:
                previous = self.drafter.active
                self.drafter.activate(self.adapter)
                try:
                    logs = self.trainer.update()
                finally:
                    self.drafter.activate(previous)
        except BaseException as exc:  # a background thread has nobody to raise to: keep it for wait()
            if not self.config.background:
                raise
            self.error = exc
            return
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
