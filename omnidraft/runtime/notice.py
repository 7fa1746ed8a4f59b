"""One-time work, said in words: dequantising a preset, exporting it, timing kernels, a measurement
kept per machine. Each says once what it does and about how long it takes, before it starts: through
the `omnidraft` logger where the application shows its INFO lines (the CLI does), else on stderr, so
a first run never sits silent for minutes. Every other line the SDK logs stays in the logger."""

from __future__ import annotations

import logging
import sys

__all__ = ["one_time"]

log = logging.getLogger("omnidraft")


def one_time(message: str, *args: object) -> None:
    """Say `message % args`, one line: logged at INFO where that is shown, else written to stderr."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(message, *args)
    else:
        print(message % args if args else message, file=sys.stderr, flush=True)
