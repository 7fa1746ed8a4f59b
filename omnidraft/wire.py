"""What travels between a client and a verification server: the device protocol (version 1) and
the OpenAI completion request the server also accepts. Clients (targets/remote.py,
targets/openai_client.py) and the server (server/) both import this module; it imports no other
part of the SDK.

The device protocol (RemoteTarget and `omnidraft serve`):

A session is opened with the prompt's target ids; the server keeps the committed ids and the KV
cache. Each verify request names the committed length it builds on. The server applies a request
only when that length is its own; a retry of the request it applied last (same length, same
proposal) gets the stored reply again, and anything else is refused as stale: a request is never
applied twice. Replies carry the accepted count, the emitted token and, when asked, the target's
top-k log-probabilities per committed position (what distillation needs: K pairs, not 150k floats).
Draft rows q' for rejection sampling travel sparse: only the target ids with q' > 0.
A generate request hands the rest of a completion to the server (greedy, no draft): its reply
streams one `GenerateChunk` per line (NDJSON) as the tokens are committed. A `PromptGenerateRequest`
does the same for a whole completion without a session (one exchange, as a plain server would).
On an engine that verifies drafts inside its own step (vLLM), a `SpeculateRequest` streams the
rest of a session's completion the same way while the device posts `ProposalRequest`s: the
engine verifies the newest one that continues the committed text (server/device_proposals.py).
"""

from __future__ import annotations

import math
import os

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

__all__ = [
    "KEY_ENV",
    "MAX_LOGPROBS",
    "ROUTE_HEADER",
    "MIN_TEMPERATURE",
    "VERSION",
    "CompletionRequest",
    "ErrorReply",
    "GenerateChunk",
    "GenerateRequest",
    "InfoReply",
    "OpenReply",
    "OpenRequest",
    "PromptGenerateRequest",
    "SamplingFields",
    "ProposalReply",
    "ProposalRequest",
    "SpeculateRequest",
    "SparseRow",
    "VerifyReply",
    "VerifyRequest",
    "env_keys",
]

# a device's own key for one session, the same on each of its requests: a router hashes on it, so
# that a session's requests reach the replica holding its KV cache (docs/deploy.md)
ROUTE_HEADER = "x-omnidraft-route"
KEY_ENV = "OMNIDRAFT_API_KEY"  # the API key(s), comma-separated: the server's, and a client's default


def env_keys() -> tuple[str, ...]:
    """The keys in $OMNIDRAFT_API_KEY (comma-separated; empty entries skipped)."""
    return tuple(k.strip() for k in os.environ.get(KEY_ENV, "").split(",") if k.strip())


VERSION = 1
MAX_PROMPT = 32_768
MAX_PROPOSAL = 64
MAX_TOPK = 64
MAX_GENERATE = 4096
MIN_TEMPERATURE = (
    1e-3  # sampling temperatures are 0 (greedy) or at least this: smaller ones overflow the softmax
)
MAX_SEED = 2**63 - 1


class _Message(BaseModel):
    # strict: a token id is a JSON integer, never `true` or "3"
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    version: int = VERSION

    @model_validator(mode="after")
    def _version(self) -> _Message:
        if self.version != VERSION:
            raise ValueError(
                f"protocol version {self.version} is not supported; this server speaks {VERSION}"
            )
        return self


class ServerLoad(_Message):
    """How loaded the server is now, as it advertises it (`/v1/info`): `sessions` verifying lately
    (the rows of its steps), `step_s` the mean seconds of an engine step since the last answer
    (None: no step since, or an engine that does not count them), and `draft_budget` the draft
    tokens a streaming session's next proposal may hold at this load (None: no measured costs)."""

    sessions: int
    step_s: float | None = None
    draft_budget: int | None = None


class InfoReply(_Message):
    """What a device needs to pair with the server's target, and its load now."""

    name: str
    vocab_size: int
    fingerprint: str
    eos_ids: list[int]
    drafts_in_engine: bool = False  # the engine verifies a streaming session's proposals (`/speculate`)
    load: ServerLoad | None = None


class OpenRequest(_Message):
    prompt_ids: list[int] = Field(min_length=1, max_length=MAX_PROMPT)


class OpenReply(_Message):
    session: str
    committed: int


class SparseRow(_Message):
    """One draft distribution q' over target ids: ids with their probabilities (the rest is 0)."""

    ids: list[int] = Field(max_length=300_000)
    probs: list[float] = Field(max_length=300_000)

    @model_validator(mode="after")
    def _same_length(self) -> SparseRow:
        if len(self.ids) != len(self.probs):
            raise ValueError(
                f"a sparse row needs as many probs as ids, got {len(self.ids)} and {len(self.probs)}"
            )
        if not self.ids:
            raise ValueError("a draft row needs at least one id with its probability (the row is empty)")
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("a draft row's ids must be distinct (an id is repeated)")
        bad = [p for p in self.probs if not (math.isfinite(p) and 0.0 <= p <= 1.0)]
        if bad:
            raise ValueError(f"probabilities must be finite and in [0, 1], got {bad[:3]}")
        if not math.fsum(self.probs) > 0:
            raise ValueError("a draft row needs some probability mass (all its probs are 0)")
        return self


class _Sampled(_Message):
    """A request's sampling: greedy at temperature 0, else the target's distribution at
    `temperature` filtered by `top_k`, `top_p` and `min_p` (target.Rule), drawn with `seed`."""

    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    top_k: int = Field(default=0, ge=0, le=1_000_000)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if value != 0 and not value >= MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {value}")
        return value


class VerifyRequest(_Sampled):
    committed: int = Field(ge=1)
    proposal: list[int] = Field(max_length=MAX_PROPOSAL)
    mode: str = "greedy"
    q: list[SparseRow] | None = None
    topk: int = Field(default=0, ge=0, le=MAX_TOPK)


class VerifyReply(_Message):
    committed: int  # the committed length after this round
    accepted: int
    token: int
    budget: int | None = None  # the most draft tokens the server takes next round (None: no limit; 0: none)
    topk_ids: list[list[int]] | None = None
    topk_logp: list[list[float]] | None = None


class GenerateRequest(_Message):
    """Greedy-decode up to `max_tokens` more tokens alone (stopping after an EOS)."""

    committed: int = Field(ge=1)
    max_tokens: int = Field(ge=1, le=MAX_GENERATE)


class PromptGenerateRequest(_Sampled):
    """Decode up to `max_tokens` tokens after `prompt_ids` alone (greedy at temperature 0, else
    sampled), with no session kept."""

    prompt_ids: list[int] = Field(min_length=1, max_length=MAX_PROMPT)
    max_tokens: int = Field(ge=1, le=MAX_GENERATE)


class SpeculateRequest(_Sampled):
    """Decode up to `max_tokens` more tokens in the engine's loop, greedy or sampled (`match` at a
    temperature above 0), verifying the device's proposals (`ProposalRequest`) as they come."""

    committed: int = Field(ge=1)
    max_tokens: int = Field(ge=1, le=MAX_GENERATE)


class ProposalRequest(_Message):
    """A streaming session's draft: target ids drafted after its first `at` committed ids."""

    at: int = Field(ge=1)
    proposal: list[int] = Field(max_length=MAX_PROPOSAL)


class ProposalReply(_Message):
    budget: int  # the most draft tokens the engine takes from a proposal now (0: none)


class GenerateChunk(_Message):
    tokens: list[int]
    committed: int  # the session's committed length after these tokens
    done: bool = False
    budget: int | None = None  # on a speculating stream: the draft tokens the engine takes next
    # the last chunk of a stream cut before its end (its session closed meanwhile): what it
    # committed stands; a client continues from the committed ids, not from the text
    cancelled: bool = False

    @classmethod
    def cut(cls, committed: int) -> bytes:
        """The NDJSON line that ends a stream cut after `committed` tokens."""
        return (
            cls(tokens=[], committed=committed, done=True, cancelled=True).model_dump_json().encode() + b"\n"
        )


class ErrorReply(_Message):
    error: str
    committed: int | None = None  # a stale request's 409: the session's committed length


# OpenAI's /v1/completions (server/completions.py, server/openai_api.py)

MAX_LOGPROBS = 20


class SamplingFields(BaseModel):
    """What OpenAI's completion and chat requests share: the model name, sampling, stop, streaming.
    An unknown field is refused, naming it; OpenAI fields this server does not implement are taken
    at their neutral values only (a penalty of 0, no logit bias), and `user` is accepted. An empty
    stop string is refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
    logit_bias: None = None
    stream_options: dict | None = None
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        """An empty stop string is refused (422): it would match before the first character and end
        every reply at once. (`Pairing.generate` refuses it too.)"""
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError(
                "stop strings must be non-empty: an empty one would end the reply before it starts"
            )
        return stop


class CompletionRequest(SamplingFields):
    """The subset of OpenAI's completion request this server implements."""

    prompt: list[StrictInt] | str = Field(min_length=1)  # an empty prompt is a 400, never a 500
    max_tokens: int = Field(16, ge=0, le=4096)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False

    @property
    def top_logprob_count(self) -> int | None:
        """Alternatives per token the reply lists; None: no log-probabilities asked for."""
        return self.logprobs
