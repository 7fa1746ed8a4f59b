"""The target protocol: `Target` and `TargetSession` (what every target implements: vLLM, llama.cpp,
a remote server, an HF model in this process; targets/__init__.py lists where each lives), the
acceptance `Rule` of a request and `judge`, which applies it to the target's logits (verify.py has
the maths).

A target session holds the committed target tokens and the target's KV cache. `verify` scores the
pending token and the proposal, applies the rule, keeps the accepted tokens (rollback of the rest)
and appends the emitted token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch

from . import verify as V
from .translate.codec import ByteCodec
from .translate.token_bytes import TokenBytes

__all__ = ["MODES", "Rule", "Target", "TargetSession", "judge"]

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


@runtime_checkable
class TargetSession(Protocol):
    """One generation on a target. `ids` are the committed target tokens (prompt included)."""

    ids: list[int]

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
    """Anything that can verify: a tokenizer's byte view plus sessions."""

    name: str
    tokenizer: Any
    token_bytes: TokenBytes
    codec: ByteCodec
    eos_ids: frozenset[int]

    def begin(self, prompt_ids: list[int]) -> TargetSession: ...


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
