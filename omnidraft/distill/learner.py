"""What `learn=True` adds to a pairing: each verified request becomes a distillation example, and
every `interval` requests the pairing's adapter is updated (Algorithm 2), either right after the
request that completes the interval or in a background thread.

An update holds the drafter's lock from start to end: drafting (of this pairing or another one on
the same drafter) waits rather than read an adapter mid-step or the wrong active adapter. Learning
changes how fast the pairing is, never what the target commits.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from .buffer import VerifiedRequest, build_example
from .trainer import OnlineTrainer, TrainConfig

__all__ = ["Learner"]

log = logging.getLogger("omnidraft")


class Learner:
    def __init__(self, drafter: Any, adapter: str, t2d: torch.Tensor, target_bytes: Any,
                 config: TrainConfig = TrainConfig()) -> None:
        self.drafter, self.adapter, self.t2d, self.target_bytes, self.config = drafter, adapter, t2d, target_bytes, config
        drafter.activate(adapter)
        self.trainer = OnlineTrainer(drafter.trainable, t2d, config, step_lock=drafter.lock)
        self.metrics: list[dict[str, float]] = []  # one entry per update
        self._recent: list[tuple[float, float]] = []  # (acceptance rate, tau) of requests since the last update
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def steps(self) -> int:
        return self.trainer.steps

    def observe(self, request: VerifiedRequest, acceptance_rate: float, tau: float) -> None:
        """Buffer one verified request; train when the interval is complete."""
        self._recent.append((acceptance_rate, tau))
        if not self.trainer.add(build_example(request, self.drafter, self.target_bytes, self.t2d)):
            return
        self.wait()
        if self.config.background:
            self._thread = threading.Thread(target=self._update, name=f"omnidraft-learn-{self.adapter}", daemon=True)
            self._thread.start()
        else:
            self._update()

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
        entry = {"requests": self.trainer.requests, "steps": self.trainer.steps,
                 "loss": sum(x["loss"] for x in logs) / max(1, len(logs)),
                 "acceptance_rate": sum(a for a, _ in recent) / max(1, len(recent)),
                 "tau": sum(t for _, t in recent) / max(1, len(recent))}
        self.metrics.append(entry)
        log.info("adapter %s updated: %s", self.adapter, entry)
