"""What a verification server is configured with (`ServerConfig`: keys, quotas, limits), how it
refuses a request (`HTTPError`: the status and the reason its reply carries), and what a
request's fields ask for, checked: the rule of its sampling fields (`sampling_rule`), its token
ids (`check_ids`) and its draft rows as a distribution (`dense_draft_rows`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..target import Rule

__all__ = [
    "OPERATOR",
    "HTTPError",
    "shown",
    "ServerConfig",
    "check_ids",
    "checked_rule",
    "dense_draft_rows",
    "sampling_rule",
    "verify_rule",
]


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    api_key: str | tuple[str, ...] | None = None  # one key, or several (each with its own session quota)
    # None: an equal share of `max_sessions` per API key (all of them with one key), so none locks out another
    max_sessions_per_key: int | None = None
    max_sessions: int = 64
    ttl_s: float = 600.0
    max_body_bytes: int = 8 << 20
    max_tokens: int = 262_144  # committed tokens over all sessions: bounds KV-cache memory
    max_tokens_per_key: int | None = (
        None  # None: an equal share of max_tokens per API key, so none starves another
    )
    fresh_ttl_s: float = 30.0  # a session that has not verified yet expires after this long idle
    body_timeout_s: float = 30.0  # a request body not read completely within this is refused (408)
    open_metrics: bool = False  # True: /metrics without the API key (a scraper on a private network)
    # the key that reads /metrics and /health's server-wide counts; None: with one API key (or none)
    # that key does, with several only this one may (a tenant's key sees its own sessions only)
    operator_key: str | None = None
    # the longest an engine step waits for a streaming device's proposal (at most a quarter of a step)
    proposal_wait_s: float = 0.03
    log_requests: bool = False  # one line per request on the "omnidraft.requests" logger (INFO)
    adapters_dir: str | None = None  # where the adapter exchange keeps its versions (None: off)
    adapter_min_keys: int = 2  # API keys whose uploads make a round of the shared adapter

    def __post_init__(self) -> None:
        if (
            self.max_sessions < 1
            or self.ttl_s <= 0
            or self.max_body_bytes < 1024
            or self.max_tokens < 1
            or self.body_timeout_s <= 0
            or (self.max_sessions_per_key is not None and self.max_sessions_per_key < 1)
            or self.fresh_ttl_s <= 0
            or self.proposal_wait_s < 0
            or (self.max_tokens_per_key is not None and self.max_tokens_per_key < 1)
        ):
            raise ValueError(f"server limits must be positive (body >= 1 KiB), got {self}")
        if isinstance(self.api_key, tuple) and (not self.api_key or not all(self.api_key)):
            raise ValueError("api_key: give one key or a non-empty tuple of non-empty keys")
        if self.operator_key is not None and (not self.operator_key or self.operator_key in self.keys):
            raise ValueError("operator_key: a non-empty key that is not one of the API keys")

    @property
    def keys(self) -> tuple[str, ...]:
        return (
            () if self.api_key is None else (self.api_key,) if isinstance(self.api_key, str) else self.api_key
        )

    def sees_all(self, key: int | None) -> bool:
        """Whether a request carrying `key` (a key index, OPERATOR, or None) reads the whole
        server's counts: the operator key, or with no operator key the only API key (or none)."""
        if key == OPERATOR:
            return True
        return key is not None and self.operator_key is None and len(self.keys) <= 1

    @property
    def key_sessions(self) -> int:
        """The sessions one API key may hold: `max_sessions_per_key`, or an equal share of the table
        (at least one), so that one key filling its share leaves every other key's free."""
        return self.max_sessions_per_key or max(1, self.max_sessions // max(1, len(self.keys)))

    @property
    def key_tokens(self) -> int:
        """The KV tokens one API key may hold: `max_tokens_per_key`, or an equal share of the budget."""
        return self.max_tokens_per_key or self.max_tokens // max(1, len(self.keys))


OPERATOR = -1  # the operator key's index (it reads /metrics and /health; it holds no sessions)
SHOWN = 64  # the most characters of a client's value an error message repeats
MESSAGE = 2000  # the most characters of an error message


def shown(value: Any) -> str:
    """A client's value as an error message repeats it: its repr, cut to `SHOWN` characters with
    its length said, so a huge value is never echoed back whole."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


class HTTPError(Exception):
    """A refusal: its HTTP `status`, the `message` its reply's "error" carries (at most `MESSAGE`
    characters: values from the request in it go through `shown`), and `fields` the reply carries
    beside it (a stale request's 409 says the session's `committed` length)."""

    def __init__(self, status: int, message: str, **fields: Any) -> None:
        message = message if len(message) <= MESSAGE else message[:MESSAGE] + "..."
        super().__init__(message)
        self.status, self.message, self.fields = status, message, fields


def sampling_rule(request: Any) -> Rule:
    """The Rule of a request's sampling fields (wire._Sampled): greedy at temperature 0, else
    `match` under its filters and seed; a combination Rule refuses is a 422."""
    if request.temperature == 0:
        return Rule()
    return checked_rule(
        mode="match",
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        min_p=request.min_p,
        seed=request.seed,
    )


def verify_rule(request: Any) -> Rule:
    """The Rule a verify request (wire.VerifyRequest) names: its mode under its temperature and
    filters; a combination Rule refuses is a 422."""
    return checked_rule(
        mode=request.mode,
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        min_p=request.min_p,
    )


def checked_rule(**fields: Any) -> Rule:
    """`Rule(**fields)`; a combination Rule refuses is a 422 naming why."""
    try:
        return Rule(**fields)
    except ValueError as exc:
        raise HTTPError(422, str(exc)) from exc


def check_ids(ids: Any, vocab: int, what: str) -> None:
    """Refuse (422) token ids outside [0, vocab), naming `what` holds them."""
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise HTTPError(422, f"{what} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")


def dense_draft_rows(request: Any, vocab: int) -> torch.Tensor:
    """(K, Vt) float: a verify's sparse draft rows q, one per proposed token, each made a
    distribution (whatever it summed to); 422 where rows are missing or name foreign ids."""
    if request.q is None or len(request.q) != len(request.proposal):
        raise HTTPError(422, f"mode {request.mode!r} needs one draft row q per proposed token")
    q = torch.zeros(len(request.q), vocab, dtype=torch.float64)
    for i, row in enumerate(request.q):
        check_ids(row.ids, vocab, "q")
        q[i, torch.tensor(row.ids, dtype=torch.long)] = torch.tensor(row.probs, dtype=torch.float64)
    return (q / q.sum(-1, keepdim=True)).float()
