"""How a pairing decodes: `DecodeConfig`, every knob of the Algorithm 1 loop in one frozen value."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..adaptive.acceptance_head import HeadConfig
from ..adaptive.policy import Hysteresis
from ..retrieve import DRAFT_SOURCES, RetrievalConfig
from ..target import Rule
from ..translate.ngram_cache import NgramCacheConfig

if TYPE_CHECKING:
    from ..target import Target

__all__ = ["K_START", "RELAXED", "DecodeConfig", "warn_relaxed"]

log = logging.getLogger(__name__)


K_START = 6  # a cost-driven pairing's first draft length, before any cost is measured
RELAXED = "relaxed-lossy"  # the one verification mode whose output may differ from the target's own


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """How a pairing decodes. `k`: drafter tokens per round; None (default) lets the pairing choose
    each round's length in [0, `k_max`] from its measured costs and acceptance (adaptive/policy.py
    `CostPolicy`); an int fixes it (and is where `adaptive` and `head` start). `objective`:
    "latency" (default) serves each greedy request of a pairing with the default `k` either
    speculatively or with the target decoding alone (a remote target: the server generating the
    whole completion), whichever measured faster (adaptive/policy.py `ServingChooser`), so such a
    pairing is never much slower than its target alone; "compute" always speculates, which spends
    fewer target forwards per token.
    `mode`/`temperature`: see verify.py; `top_k`/`top_p`/`min_p` filter the target distribution that
    sampling modes reproduce (target.Rule). `mode="relaxed-lossy"` (LOSSY, in-process targets, greedy):
    ReSpec's relaxed verification, a retrieved token is accepted within the target's top
    `relaxed_top_r` when the target carries the copy on (verify.relaxed); model drafts stay
    greedy. Its output may differ from the target's own: docs/retrieval.md measures by how much.
    `strategy`: draft-to-target translation ("text" or "ngram", see translator.py).
    `stop_confidence`: end a draft early after a token the drafter gives less probability than this.
    `adaptive`: a Hysteresis policy that moves the draft length (starting at k) with acceptance;
    None keeps k fixed. `head`: an acceptance head per pairing decides each draft's length (see
    adaptive/acceptance_head.py); until it has seen `head.warmup` labelled tokens the hysteresis fallback
    (or `adaptive`) does. `heal`: token healing of the drafter's context (translate/healing.py);
    it acts where it is lossless and the translation re-tokenizes text: greedy and `match`
    verification with the "text" strategy (`healing` says whether it acts).
    `drafts`: where proposals come from. "hybrid" (default): the drafter model, or a continuation
    retrieved from the request's context (and the user's past outputs, with a profile) where that
    is expected to commit more tokens per second, and a model draft may run on into a retrieved
    continuation (retrieve/, `retrieval` configures it); "model": the drafter only; "retrieval":
    retrieved drafts only, no drafter forward at all. Every mode verifies them the same way.
    `overlap`: where the target verifies on threads of its own and leaves a core free (OpenVINO
    given fewer threads than the machine has), a greedy request's drafter drafts the next proposal
    on that core while the target verifies this one (decode/overlap.py); off by default, since on
    two cores the target's second thread is worth more (docs/overlap.md measures it)."""

    k: int | None = None
    k_max: int = 12
    objective: str = "latency"
    mode: str = "greedy"
    temperature: float = 0.0
    strategy: str = "text"
    stop_confidence: float = 0.3
    adaptive: Hysteresis | None = None
    head: HeadConfig | None = None
    ngram: NgramCacheConfig = field(default_factory=NgramCacheConfig)
    heal: bool = True
    drafts: str = "hybrid"
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    relaxed_top_r: int = 3
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.mode == "greedy" and isinstance(self.temperature, (int, float)) and self.temperature > 0:
            object.__setattr__(self, "mode", "match")  # a temperature alone asks for lossless sampling
        if self.drafts not in DRAFT_SOURCES:
            raise ValueError(f"drafts must be one of {DRAFT_SOURCES}, got {self.drafts!r}")
        if self.k is not None and (not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1):
            raise ValueError(
                f"draft length k must be None (chosen from measured costs) or an integer >= 1, got {self.k!r}"
            )
        if self.objective not in ("latency", "compute"):
            raise ValueError(f"objective must be 'latency' or 'compute', got {self.objective!r}")
        if not isinstance(self.k_max, int) or self.k_max < 1:
            raise ValueError(f"k_max must be an integer >= 1, got {self.k_max!r}")
        if self.strategy not in ("text", "ngram"):
            raise ValueError(f"translation strategy must be 'text' or 'ngram', got {self.strategy!r}")
        if not 0.0 <= self.stop_confidence < 1.0:
            raise ValueError(f"stop_confidence must be in [0, 1), got {self.stop_confidence}")
        if self.mode == RELAXED:
            if self.drafts == "model":
                raise ValueError(
                    "relaxed-lossy verification relaxes retrieved drafts only; drafts='model' has none"
                )
            if not isinstance(self.relaxed_top_r, int) or self.relaxed_top_r < 2:
                raise ValueError(f"relaxed_top_r must be an integer >= 2, got {self.relaxed_top_r!r}")
        _ = self.rule  # validates mode, temperature and the sampling filters

    @property
    def lossy(self) -> bool:
        """Whether outputs may differ from the target's own (greedy) or its distribution (sampling)."""
        return self.mode in (RELAXED, "omnidraft")

    @property
    def rule(self) -> Rule:
        """The target's acceptance rule; relaxed verification is greedy's, relaxed for retrieved tokens."""
        return Rule(
            mode="greedy" if self.mode == RELAXED else self.mode,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
        )

    def request_rule(self, **sampling: Any) -> Rule:
        """The rule of one request with per-call `temperature`, `top_k`, `top_p`, `min_p` (None:
        the config's) and `seed`. A temperature > 0 on a greedy config samples losslessly (`match`);
        0 is greedy."""
        given = {k: v for k, v in sampling.items() if v is not None}
        unknown = set(given) - {"temperature", "top_k", "top_p", "min_p", "seed"}
        if unknown:
            hint = (
                "; the length is max_new_tokens"
                if unknown & {"max_tokens", "max_length", "n_predict"}
                else ""
            )
            raise TypeError(
                f"unknown sampling options {sorted(unknown)}: a request takes temperature, top_k, top_p, "
                f"min_p and seed (and logprobs, generation_config){hint}"
            )
        base = self.rule
        temperature = given.get("temperature", base.temperature)
        mode = (
            base.mode
            if temperature > 0 and base.mode != "greedy"
            else ("match" if temperature > 0 else "greedy")
        )
        return Rule(
            mode=mode,
            temperature=temperature,
            top_k=given.get("top_k", base.top_k),
            top_p=given.get("top_p", base.top_p),
            min_p=given.get("min_p", base.min_p),
            seed=given.get("seed"),
        )

    @property
    def start_k(self) -> int:
        """The first round's draft length (and the fixed one when `k` is set)."""
        return self.k if self.k is not None else min(K_START, self.k_max)

    @property
    def cost_driven(self) -> bool:
        """Whether the pairing chooses each round's draft length from its measured costs."""
        return self.k is None and self.adaptive is None and self.head is None and self.drafts != "retrieval"

    @property
    def healing(self) -> bool:
        """Whether token healing acts under this config (see `heal`)."""
        return self.heal and self.strategy == "text" and self.mode in ("greedy", "match")


def warn_relaxed(drafter: Any, target: Target) -> None:
    """Relaxed-lossy verification: refused on a remote target, warned of elsewhere."""
    if not target.capabilities.in_process:
        raise ValueError(
            f"relaxed-lossy verification needs an in-process target; {target!r} verifies remotely"
        )
    log.warning(
        "%s -> %s: relaxed-lossy verification; outputs may differ from the target's own greedy output",
        drafter.name,
        target.name,
    )
