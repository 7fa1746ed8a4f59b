"""How many requests run in this process now: learning (distill/learner.py) works only while none does.

Every pairing's request is counted from its start to its end (`begin`, `end`), whatever its
drafter, target or user. A learning thread waits on `condition` until `running` is 0, and a unit of
learning under way stops at its next layer once it is not. One count for the process, not one per
pairing: one user's reply (or another target's) must not wait for another pairing's adapter to take
a step on the drafter they share, and learning beside any request takes that request's CPU.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["REQUESTS", "Requests"]


class Requests:
    """The requests running in this process (`running`), under `condition`, which is notified
    whenever one ends, and the threads they began in (`inside`)."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.running = 0
        self._threads: Counter[int] = Counter()  # thread id -> its requests running

    def begin(self) -> int:
        """A request begins in this thread; returns the token `end` takes."""
        me = threading.get_ident()
        with self.condition:
            self.running += 1
            self._threads[me] += 1
        return me

    def end(self, token: int) -> None:
        """The request `begin` gave `token` for has ended (whichever thread ends it)."""
        with self.condition:
            self.running -= 1
            self._threads[token] -= 1
            if not self._threads[token]:
                del self._threads[token]
            self.condition.notify_all()

    def inside(self) -> bool:
        """Whether a request begun in this thread is running (a stream it has not finished, say):
        waiting here for what runs only between requests would never end."""
        with self.condition:
            return threading.get_ident() in self._threads

    @contextmanager
    def serving(self) -> Iterator[None]:
        """One request, counted while the block runs."""
        token = self.begin()
        try:
            yield
        finally:
            self.end(token)


REQUESTS = Requests()  # the process's
