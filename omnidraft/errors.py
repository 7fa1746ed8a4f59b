"""The one exception hierarchy of omnidraft. Input mistakes raise ValueError/TypeError; domain
failures (a missing model package, a corrupt profile file) raise an OmnidraftError subclass."""

from __future__ import annotations

from typing import Any

__all__ = [
    "CorruptFileError",
    "IncompatibleError",
    "MissingDependencyError",
    "MissingModelError",
    "OmnidraftError",
    "RemoteRequestError",
    "StreamCutError",
    "TargetError",
    "TargetUnavailableError",
]


class OmnidraftError(Exception):
    """Base class of every domain failure raised by omnidraft."""


class Cancelled(OmnidraftError):
    """Work stopped because whoever asked for it went away (a client that disconnected)."""


class MissingModelError(OmnidraftError):
    """A preset's model package is not installed; the message names the pip command to run."""


class MissingDependencyError(OmnidraftError):
    """An optional engine (llama-cpp-python, onnxruntime) is not installed; the message says how."""


class CorruptFileError(OmnidraftError):
    """A saved artefact is truncated, foreign or of an unknown format version."""


class IncompatibleError(OmnidraftError):
    """An artefact was made for another tokenizer or model than the one it is loaded for."""


class TargetError(OmnidraftError):
    """A target failed mid-generation. `partial` is the Generation committed up to that point
    (set by the pairing; None if it failed before the first round)."""

    partial: Any = None


class TargetUnavailableError(TargetError):
    """A remote target could not be reached after the allowed retries."""


class StreamCutError(TargetUnavailableError):
    """The server closed the session a stream ran on (a deliberate cut, not a failure): the stream
    is not started again elsewhere; `partial` holds what was committed."""


class RemoteRequestError(TargetError):
    """A remote target refused a request (4xx); the message carries the server's reason and
    `status` its HTTP status."""

    def __init__(self, message: str, status: int | None = None, committed: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.committed = committed  # a 409's: the length the server's session has committed
