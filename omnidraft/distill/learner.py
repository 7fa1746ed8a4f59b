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
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from .buffer import VerifiedRequest, build_example
from .trainer import OnlineTrainer, TrainConfig

__all__ = ["Learner"]

log = logging.getLogger("omnidraft")


class Learner:
    def __init__(
        self,
        drafter: Any,
        adapter: str,
        t2d: torch.Tensor,
        target_bytes: Any,
        config: TrainConfig = TrainConfig(),
        start_step: int = 0,
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
        self.fast_steps = 0  # Test-Time Speculation steps taken, over all requests
        self.fast_seconds = (
            0.0  # and the wall time they took (each holds the drafter: nothing drafts meanwhile)
        )

    @property
    def steps(self) -> int:
        return self.trainer.steps

    def note(self) -> str:
        """When the adapter's next update comes, in words (a request's stats carry it)."""
        interval, seen = self.config.interval, self.trainer.requests
        if self._thread is not None and self._thread.is_alive():
            return "an update is running beside the requests"
        left = interval - seen % interval
        first = "the first update" if self.steps == 0 else "the next update"
        return f"{first} after {left} more request{'s' if left != 1 else ''} (one every {interval})"

    def observe(self, request: VerifiedRequest, acceptance_rate: float, tau: float) -> None:
        """Buffer one verified request; train when the interval is complete."""
        self._recent.append((acceptance_rate, tau))
        if not self.trainer.add(
            build_example(request, self.drafter, self.target_bytes, self.t2d, spans=self.config.spans)
        ):
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
