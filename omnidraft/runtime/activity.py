"""How many requests run in this process now: learning (distill/learner.py) works only while none does.

Every pairing's request is counted from its start to its end (`begin`, `end`), whatever its
drafter, target or user. A learning thread waits on `condition` until `running` is 0, and a unit of
learning under way stops at its next layer once it is not. One count for the process, not one per
pairing: one user's reply (or another target's) must not wait for another pairing's adapter to take
a step on the drafter they share, and learning beside any request takes that request's CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["REQUESTS", "Requests"]


class Requests:
    """The requests running in this process (`running`), under `condition`, which is notified
    whenever one ends."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.running = 0

    def begin(self) -> None:
        """A request begins."""
        with self.condition:
            self.running += 1

    def end(self) -> None:
        """A request has ended (after `begin`)."""
        with self.condition:
            self.running -= 1
            self.condition.notify_all()

    @contextmanager
    def serving(self) -> Iterator[None]:
        """One request, counted while the block runs."""
        self.begin()
        try:
            yield
        finally:
            self.end()


REQUESTS = Requests()  # the process's
