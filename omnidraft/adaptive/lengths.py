"""How long each draft of a pairing is: the cost policy (the default), an acceptance head with its
hysteresis fallback, a hysteresis policy alone, or a fixed k. One object per pairing; the pairing
loop asks it for the first length, for the head's stopping rule, and for the next length after
each round, and hands it each finished request for the head's training cadence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .acceptance_head import AcceptanceHead, Stopper, head_state
from .costs import CostModel
from .policy import BestSpeedup, CostPolicy, Hysteresis, ServingChooser, best_speedup

if TYPE_CHECKING:
    from ..target import Target

__all__ = ["DraftLengths", "DraftingPlan", "plan_drafting"]

log = logging.getLogger("omnidraft.pairing")


@dataclass(frozen=True)
class DraftingPlan:
    """Which drafts a pairing uses and who decides when: `model` / `free` (retrieved) drafts, each
    on unless the config excludes it or the best speedup says it cannot pay here; `chooser`, the
    per-request chooser between speculating and the target decoding alone (None: every request
    speculates, or none can); `may_idle`, whether the cost policy may skip drafting a round."""

    best_speedup: BestSpeedup | None
    model: bool
    free: bool
    chooser: ServingChooser | None
    may_idle: bool

    def at(self, target: Target, context: int) -> tuple[bool, bool]:
        """(model, free): the drafts that can still pay after `context` tokens, by the target's
        verify costs there (`verify_costs(context)`: llama.cpp past its exact range verifies fewer
        tokens a call, so a verify of n costs more steps than where the best speedup was measured)."""
        if self.best_speedup is None or not (self.model or self.free):
            return self.model, self.free
        # only past that return: a target whose costs are not measured yet (vLLM) measures them on
        # this call, which inside its own engine's step would wait on that step
        costs = target.verify_costs(context)
        if costs is None:
            return self.model, self.free
        seen = best_speedup(
            costs,
            self.best_speedup.draft,
            acceptance=self.best_speedup.acceptance,
            need=self.best_speedup.need,
        )
        return self.model and seen.model_pays, self.free and seen.free_pays


def plan_drafting(drafter: Any, target: Target, config: Any, learn: bool) -> DraftingPlan:
    """The DraftingPlan of a new pairing. With retrieved drafts, whose worth depends on each
    request's context, an in-process target decides round by round whether to draft (a round
    without a draft costs it no more than decoding alone). Otherwise (model drafts only, or a
    remote target) a mode chooser decides it per request from measured throughput: per request it
    compared different prompts, and kept whole requests from retrieved drafts that paid
    (docs/benchmarks.md)."""
    from ..runtime.backends import pairing_best_speedup

    seen = None if learn else pairing_best_speedup(drafter, target, config)
    model = config.drafts != "retrieval" and (seen is None or seen.model_pays)
    free = config.drafts != "model" and (seen is None or seen.free_pays)
    if seen is not None and not (model or free):
        log.debug(
            "%s -> %s: drafting cannot pay on this machine; the target decodes alone (%s)",
            drafter.name,
            target.name,
            seen.reason(),
        )
    can = target.capabilities
    per_round = config.drafts != "model" and can.in_process
    chooser = (
        ServingChooser()
        if config.objective == "latency"
        and config.mode == "greedy"
        and config.k is None
        and not learn
        and can.decodes_alone
        and not can.drafts_in_engine  # its engine's step decides per round
        and (model or free)
        and not per_round
        else None
    )
    return DraftingPlan(seen, model, free, chooser, chooser is None)


class DraftLengths:
    """`config`: the pairing's DecodeConfig. `may_idle`: the cost policy may decide not to draft
    (False when a per-request ServingChooser decides that). `hidden_size`: the drafter's (an
    acceptance head reads its hidden states); `saved_head`: the head's tensors from the profile.
    `label` names the pairing in log lines."""

    def __init__(
        self,
        config: Any,
        cost: CostModel,
        *,
        may_idle: bool,
        hidden_size: int | None,
        saved_head: dict[str, torch.Tensor] | None,
        shared: torch.Tensor,
        label: str,
    ) -> None:
        self.config, self.cost, self.label, self.shared = config, cost, label, shared
        self.policy = (
            CostPolicy(cost, k_max=config.k_max, start=config.start_k, may_idle=may_idle)
            if config.cost_driven
            else None
        )
        self.head: AcceptanceHead | None = None
        self.trainer: Any = None
        self.fallback: Hysteresis | None = None
        if config.head is not None:
            self._init_head(config.head, hidden_size, saved_head)

    def _init_head(self, hc: Any, hidden_size: int | None, saved: dict[str, torch.Tensor] | None) -> None:
        from .head_trainer import HeadTrainer

        if hidden_size is None:
            raise ValueError(
                f"an acceptance head needs a drafter that exposes hidden states; {self.label} has none"
            )
        self.head = AcceptanceHead(hidden_size, hc.width, hc.depth, seed=hc.seed).eval()
        self.trainer = HeadTrainer(self.head, hc)
        if saved is not None:
            saved = dict(saved)
            self.trainer.trained = self.trainer.seen = int(saved.pop("meta.trained", torch.tensor(0)))
            try:
                self.head.load_state_dict(saved)
            except RuntimeError as exc:
                raise ValueError(
                    f"the saved acceptance head does not fit this drafter or head config: {exc}"
                ) from None
        self.fallback = self.config.adaptive or Hysteresis(k_min=max(2, hc.k_min), k_max=hc.k_max)

    @property
    def head_ready(self) -> bool:
        """Whether the acceptance head (not the fallback) decides draft lengths now."""
        return self.head is not None and self.trainer.trained >= self.config.head.warmup

    @property
    def speculating(self) -> bool:
        return self.policy.speculating if self.policy is not None else True

    def begin_request(self) -> tuple[int, Stopper | None]:
        """A request's first draft length and the head's stopping rule (None without a head)."""
        if self.policy is not None:
            self.policy.begin_request()
        k = self.policy.next_k() if self.policy is not None else self.config.start_k
        hc = self.config.head
        if hc is None or self.head is None:
            return k, None
        return k, Stopper(self.head, hc, self.shared, self.cost)

    def for_draft(self, k: int, stopper: Stopper | None) -> tuple[int, float, dict[str, Any]]:
        """(draft length, stop confidence, extra propose arguments) of this round's draft: up to k
        tokens stopped by the drafter's confidence, or k_max stopped by the head once it decides."""
        if stopper is None:
            return k, self.config.stop_confidence, {}
        stopper.reset()
        stopper.decide = self.head_ready  # before warm-up it only records features; the fallback decides
        if stopper.decide:
            return self.config.head.k_max, 0.0, {"stopper": stopper}
        return k, self.config.stop_confidence, {"stopper": stopper}

    def next(
        self, k: int, stopper: Stopper | None, drafted: int, proposed: int, accepted: int, kept: int
    ) -> int:
        """The next round's draft length: the cost policy's, or the fallback's (or `adaptive`'s);
        with a head, the round's features and the `kept` drafted tokens go to its trainer first."""
        if self.policy is not None:
            was = self.policy.speculating
            self.policy.observe(drafted, proposed, accepted)
            k = self.policy.next_k()
            if self.policy.speculating != was:
                rates = self.policy.last_rates
                best = max((key for key in rates if key > 0), key=rates.__getitem__)
                log.debug(
                    "%s: %s (measured: %.1f tok/s drafting %d a round, %.1f tok/s alone)",
                    self.label,
                    (
                        "drafting pays again"
                        if rates[best] >= rates[0]
                        else "drafting again: within the cost policy's margin of the target alone"
                    )
                    if self.policy.speculating
                    else "drafting costs more than it saves; the target decodes alone, with a probe draft "
                    "now and then",
                    rates[best],
                    best,
                    rates[0],
                )
            return k
        if stopper is not None and self.fallback is not None:  # (a head comes with its fallback)
            if self.config.head.train is not None:
                self.trainer.add(stopper.features(), kept)
            return self.fallback.next_k(k, proposed, accepted)
        if self.config.adaptive is not None:
            return self.config.adaptive.next_k(k, proposed, accepted)
        return k

    def end_request(self, learner: Any) -> dict[str, Any] | None:
        """A finished request: the head's training cadence (interleaved: its own; joint: in step with
        the adapter's updates). Returns the metrics row of an update, if one ran."""
        if self.trainer is None or self.config.head.train is None:
            return None
        if self.config.head.train == "interleaved":
            row = self.trainer.end_request()
        else:
            self.trainer.requests += 1
            interval = learner.config.interval if learner is not None else self.config.head.interval
            row = self.trainer.update() if self.trainer.requests % interval == 0 else None
        return None if row is None else {"head_update": self.trainer.steps, **row}

    def state(self) -> dict[str, torch.Tensor] | None:
        """The head's tensors for the profile (None without a head)."""
        if self.head is None:
            return None
        return {**head_state(self.head), "meta.trained": torch.tensor(self.trainer.trained)}
