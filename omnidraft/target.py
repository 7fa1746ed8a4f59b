"""The target interface: `Target` and `TargetSession` (what every target implements: vLLM, llama.cpp,
a remote server, an HF model in this process; targets/__init__.py lists where each lives), the
`Capabilities` a target declares, `TargetBase` and `SessionBase` (the defaults a new engine
inherits), the acceptance `Rule` of a request and `judge`, which applies it to the target's logits
(verify.py has the maths).

A target session holds the committed target tokens and the target's KV cache. `verify` scores the
pending token and the proposal, applies the rule, keeps the accepted tokens (rollback of the rest)
and appends the emitted token. Whatever else a target can do it declares in `capabilities`; the
pairing and the server read that record and call the members it promises, never probe for them.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, replace
from typing import Any, Generator, Iterator, Protocol, runtime_checkable

import torch

from .decode import verify as V
from .translate.codec import ByteCodec
from .translate.token_bytes import TokenBytes

__all__ = [
    "MODES",
    "BatchingTarget",
    "Capabilities",
    "ChunkedSession",
    "DecodingSession",
    "EngineSession",
    "EngineStream",
    "ProposalSource",
    "Rule",
    "ScoringSession",
    "SessionBase",
    "StreamingSession",
    "Target",
    "TargetBase",
    "TargetSession",
    "check_target",
    "judge",
]

MODES = ("greedy", "match", "exact", "omnidraft")
MIN_TEMPERATURE = 1e-3  # sampling temperatures below this overflow exp(logits / T)


@dataclass(frozen=True, kw_only=True)
class Rule:
    """How proposals are accepted: `mode` (see verify.py) at `temperature` (0 for greedy). Sampling
    modes draw from the target's distribution filtered by `top_k`, `top_p` and `min_p` (as HF and
    vLLM apply them), which verification then reproduces exactly; greedy ignores them. With `seed`,
    `match` draws the sample at each position from a generator keyed by (seed, position), so the
    output depends on the seed alone, not on how drafting split it into rounds."""

    mode: str = "greedy"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63
        ):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.mode not in MODES:
            raise ValueError(f"verification mode must be one of {MODES}, got {self.mode!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature != 0 and not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}: "
                "a smaller one overflows the softmax"
            )
        if (self.mode == "greedy") != (self.temperature == 0):
            raise ValueError(
                f"mode {self.mode!r} with temperature {self.temperature}: greedy needs temperature 0, "
                "sampling modes need temperature > 0"
            )


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a target can do besides verifying a proposal, declared once (`Target.capabilities`).

    in_process: it verifies in this process, so a round without a draft costs what one decode step
        costs: drafting is decided round by round (a remote or engine target decides per request);
    decodes_alone: its sessions decode greedily with the target alone (`TargetSession.decode`);
    drafts_in_engine: its engine verifies a pairing's drafts in its own step (the session's
        `steps`; vLLM with omnidraft's proposer, or a server running one);
    batches_sessions: concurrent sessions share its engine's steps (a server takes no model lock);
    prefills_in_chunks: its sessions feed a long prompt in bounded pieces (`prefill(limit)`, `cached`)
        so that a server interleaves other sessions' work with it;
    scores_positions: its sessions return rows of logits (`scores(new, keep)`), which the server's
        echo and log-probability completions read;
    verifies_beside: the threads its verify runs on, releasing Python's lock (0: it does not), so
        that a drafter on the other cores drafts the next proposal meanwhile (decode/overlap.py)."""

    in_process: bool = False
    decodes_alone: bool = False
    drafts_in_engine: bool = False
    batches_sessions: bool = False
    prefills_in_chunks: bool = False
    scores_positions: bool = False
    verifies_beside: int = 0


@runtime_checkable
class TargetSession(Protocol):
    """One generation on a target. `ids` are the committed target tokens (prompt included);
    `budget`: the most draft tokens the target takes in the next round (a server under load), None
    for no limit; `close` frees what the session holds (a KV slot, a server-side session)."""

    @property
    def ids(self) -> list[int]: ...

    @property
    def budget(self) -> int | None: ...

    cancel: threading.Event | None  # set by whoever runs the next call: its engine stops (SessionBase)

    def close(self) -> None: ...

    def verify(
        self,
        proposal: torch.Tensor,
        rule: Rule,
        q: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        *,
        topk: int = 0,
    ) -> V.Verdict:
        """Accept a prefix of `proposal` and emit one token; with `topk` > 0 the verdict carries
        the target's top-k log-probabilities at every committed position (see Verdict)."""
        ...


@runtime_checkable
class Target(Protocol):
    """Anything that can verify: a tokenizer's byte view plus sessions, and what it declares it can
    do (`capabilities`). `context_length`: the longest session in tokens (None: not bounded here);
    `verify_costs`: seconds to verify n tokens as measured on this machine (None: not measured);
    `check_rule` refuses, naming why, a sampling rule it cannot verify losslessly."""

    name: str
    tokenizer: Any
    token_bytes: TokenBytes
    codec: ByteCodec
    eos_ids: frozenset[int]

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def context_length(self) -> int | None: ...

    def begin(self, prompt_ids: list[int]) -> TargetSession: ...

    def verify_costs(self, context: int | None = None) -> dict[int, float] | None: ...

    def check_rule(self, rule: Rule) -> None: ...

    def engine_counters(self) -> tuple[int, float] | None: ...

    @property
    def generation_config(self) -> Any:
        """The model's own `transformers.GenerationConfig`, or None."""
        ...


class SessionBase:
    """What a target session inherits unless it says otherwise: no draft budget, nothing to free.
    `cancel`: set by whoever runs the session's next call (a server whose client may leave); a
    session whose engine computes a call elsewhere stops it once that is set (raising Cancelled).
    `prefill_s`: the seconds its first call spent reading the prompt and giving the first token,
    where the session times that apart (None: it does not), so the floor can book the rest of a
    request's first round against the target alone (adaptive/floor.py)."""

    budget: int | None = None
    cancel: threading.Event | None = None
    prefill_s: float | None = None

    def close(self) -> None:
        """The generation is over: nothing to free."""

    def share_prefix_cache(self, tenant: str) -> None:
        """Share this session's prefix-cache pages with the sessions given the same `tenant`, never
        with others (a server gives one per API key): nothing to do without a shared prefix cache."""


class TargetBase:
    """What a target inherits unless it says otherwise (a new engine subclasses it; see
    docs/architecture.md): no capability beyond verifying, no bound on a session's length, no
    measured verify costs, every rule accepted, no engine counters."""

    capabilities = Capabilities()
    context_length: int | None = None
    generation_config: Any = None  # the model's own `transformers.GenerationConfig`, where it has one

    def verify_costs(self, context: int | None = None) -> dict[int, float] | None:
        """Seconds to verify n tokens (n = 1 ..) measured on this machine; None: not measured."""
        return None

    def check_rule(self, rule: Rule) -> None:
        """Refuse (ValueError, naming why) a rule this target cannot verify losslessly."""

    def engine_counters(self) -> tuple[int, float] | None:
        """(engine steps, seconds the engine was busy) so far, where an engine loop counts them."""
        return None

    @property
    def generates_alone(self) -> bool:
        """Alias of `capabilities.decodes_alone`."""
        return self.capabilities.decodes_alone

    @property
    def in_process(self) -> bool:
        """Alias of `capabilities.in_process`."""
        return self.capabilities.in_process

    @property
    def drafts_in_engine(self) -> bool:
        """Alias of `capabilities.drafts_in_engine`."""
        return self.capabilities.drafts_in_engine


# the protocol's members, read off `Target` itself (declared once)
TARGET_MEMBERS = tuple(
    dict.fromkeys(n for n in (*Target.__annotations__, *vars(Target)) if not n.startswith("_"))
)


def check_target(target: Target) -> None:
    """Refuse, naming what is missing, an object that does not implement `Target`: what a pairing
    and a server check once, where a target comes in."""
    missing = [m for m in TARGET_MEMBERS if not hasattr(target, m)]
    if missing or not isinstance(target.capabilities, Capabilities):
        lacks = ", ".join(missing) or "a Capabilities record"
        raise TypeError(
            f"{type(target).__name__} is not a target: it lacks {lacks} "
            "(a target subclasses omnidraft.TargetBase and declares its capabilities; docs/architecture.md)"
        )


class DecodingSession(TargetSession, Protocol):
    """A session of a target with `capabilities.decodes_alone`."""

    def decode(self, max_tokens: int) -> Iterator[int]:
        """Greedy-decode up to `max_tokens` tokens with the target alone (stopping after an EOS)."""
        ...


class ProposalSource(Protocol):
    """Where an engine's own step takes a sequence's drafts (`EngineSession.steps`): a pairing's
    `EngineProposals`, a server's `DeviceProposals` (a device's proposals), or anything with these."""

    def open(self, ids: list[int], drafter_ids: list[int] | None = None) -> None:
        """A new sequence over the committed `ids` (`drafter_ids`: its text in the drafter's ids)."""

    def prepare(self, ids: list[int]) -> None:
        """Told every row's committed ids before any row is asked for its draft (a device that
        drafts elsewhere hears of them here)."""

    def next(self, ids: list[int], limit: int, remaining: int) -> list[int]:
        """The proposal (at most `limit` target ids) after the committed `ids`."""
        ...


class EngineSession(TargetSession, Protocol):
    """A session of a target with `capabilities.drafts_in_engine`: `steps` runs one request in the
    engine's own loop, its drafts taken from `source` and verified in the engine's step, yielding
    the ids each step committed; greedy, or sampled under a `match` `rule`."""

    def steps(
        self,
        max_tokens: int,
        source: ProposalSource | None = None,
        drafter_ids: list[int] | None = None,
        *,
        eos: bool = True,
        rule: Rule | None = None,
    ) -> Iterator[list[int]]: ...


class EngineStream(Protocol):
    """One request of a `StreamingSession` in its engine's loop: each output that arrives on the
    caller's queue goes to `take`, which commits it and returns its ids; `error` is the engine's
    once the outputs end; `end` finishes it (the engine's work aborted unless `done`)."""

    @property
    def error(self) -> BaseException | None: ...

    def take(self, out: Any) -> list[int]: ...

    def end(self, done: bool) -> None: ...


class StreamingSession(EngineSession, Protocol):
    """An engine session a server drives itself (a `BatchingTarget`'s): `start` submits what
    `steps` reads and returns at once, the engine's outputs put on `outputs`, a queue its caller
    also waits on for other news (a device's proposals); `decode` is the engine's loop alone."""

    def start(
        self,
        max_tokens: int,
        source: ProposalSource | None = None,
        drafter_ids: list[int] | None = None,
        *,
        eos: bool = True,
        outputs: queue.Queue | None = None,
        rule: Rule | None = None,
    ) -> EngineStream: ...

    def decode(self, max_tokens: int, rule: Rule | None = None) -> Generator[int, None, None]:
        """The engine's loop alone, each token as it commits; closing it aborts the request."""
        ...


class ChunkedSession(TargetSession, Protocol):
    """A session of a target with `capabilities.prefills_in_chunks`: `cached` tokens are in its
    KV cache; `prefill(limit)` feeds up to `limit` more of its uncached prompt, returning how many
    remain; `pending` says how many remain without a model call (0: a prefill has nothing to do)."""

    @property
    def cached(self) -> int: ...

    @property
    def pending(self) -> int: ...

    def prefill(self, limit: int) -> int: ...


class ScoringSession(TargetSession, Protocol):
    """A session of a target with `capabilities.scores_positions`."""

    def scores(self, new: list[int], keep: int) -> torch.Tensor:
        """Append `new` and return the logits (keep, V) after the sequence's last `keep` tokens."""
        ...


class BatchingTarget(Target, Protocol):
    """A target with `capabilities.batches_sessions`, as a server's draft budget reads it:
    `batch_costs` (seconds of an engine step by rows, across sessions) and `verify_tail` (tokens a
    verify recomputes besides its own); its metrics read `prefix_cache_counters`."""

    verify_tail: int

    def batch_costs(self) -> dict[int, float]: ...

    def prefix_cache_counters(self) -> tuple[int, int]:
        """(prompt tokens of the engine's finished requests, those of them read from its prefix
        cache) so far: the engine's own count."""
        ...


def judge(
    logits: torch.Tensor,
    proposal: torch.Tensor,
    rule: Rule,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
    base: int,
    *,
    topk: int = 0,
    relax: tuple[torch.Tensor, int] | None = None,
) -> V.Verdict:
    """The verdict on `proposal` (M,) from the target's logits (M + 1, V) after the pending token
    and after each proposed one; `base` is the proposal's first position. Every in-process target
    (PyTorch, llama.cpp) verifies through this one function. Logits on an accelerator stay there
    for greedy verification; the sampling rules, whose generators live on the CPU, read them there."""
    if logits.device != proposal.device:
        if rule.mode == "greedy" and relax is None:
            proposal = proposal.to(logits.device)
        else:
            logits = logits.float().cpu()
    if relax is not None:
        if rule.mode != "greedy":
            raise ValueError(f"relaxed verification is a greedy rule; got mode {rule.mode!r}")
        verdict = V.relaxed(logits, proposal, relax[0], relax[1])
    else:
        verdict = _judge(logits, proposal, rule, q, generator, base)
    if topk > 0:
        full = torch.log_softmax(logits[: verdict.accepted + 1].float(), -1)
        logp, ids = full.topk(topk, dim=-1)
        committed = proposal[: verdict.accepted].tolist() + [verdict.token]
        chosen = full.gather(-1, torch.tensor(committed, device=full.device)[:, None])[:, 0]
        verdict = replace(verdict, topk=(ids.cpu(), logp.cpu()), chosen=chosen.cpu())
    return verdict


def _judge(
    logits: torch.Tensor,
    proposal: torch.Tensor,
    rule: Rule,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
    base: int = 0,
) -> V.Verdict:
    if rule.mode == "greedy":
        return V.greedy(logits, proposal)
    probs = V.probabilities(logits, rule.temperature, top_k=rule.top_k, top_p=rule.top_p, min_p=rule.min_p)
    if rule.mode == "match" and rule.seed is not None:  # position-keyed: independent of the round split
        return V.match(probs, proposal, keys=[(rule.seed, base + i) for i in range(len(proposal) + 1)])
    if rule.mode == "match" or len(proposal) == 0:
        return V.match(probs, proposal, generator)
    if q is None:
        raise ValueError(f"mode {rule.mode!r} needs the draft rows q")
    return V.rejection(probs, q, proposal, generator)
