"""`Speculator`: a pairing's speculation machinery, kept from one request to the next.

What it holds: the translator (direct map + n-gram cache), the drafting plan (which kinds of draft
can pay here), the cost model, the draft-length policy or acceptance head, the retriever and the
proposer, shared by the pairing's requests, which change them only through its methods (each
takes the speculator's own lock; no caller holds it). A request's rounds are a
`Speculation` of it (speculation.py), driven by the round loop (round_loop.py) or an engine adapter
(engine_proposals.py), as `serving` says (the pairing runs the one it names). What it is not: the user's
facade (`Pairing`, pairing.py: generate, stream, chat, the profile and its saving), or a place
that reads a profile's files (store/profiles.py).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from ..adaptive.costs import CostModel
from ..adaptive.floor import Floor, Ledger
from ..adaptive.lengths import DraftLengths, plan_drafting
from ..retrieve.retriever import Retriever
from ..translate.ngram_cache import NgramCache
from ..translate.tables import pair_tables
from ..translate.translator import Translator

if TYPE_CHECKING:
    from ..adaptive.acceptance_head import AcceptanceHead, Stopper
    from ..adaptive.policy import CostPolicy
    from ..distill.learner import Learner
    from ..draft.interface import PairedDrafter
    from ..retrieve import ContextIndex
    from ..retrieve.retriever import PromptRead, Used
    from ..store.profiles import PairingProfile
    from ..target import Rule, Target
    from ..translate.translator import Proposal
    from .config import DecodeConfig
    from .contract import Proposer
    from .stats import GenerationStats, RoundRecord

__all__ = ["Speculator", "pair_fingerprint"]


def pair_fingerprint(drafter: PairedDrafter, target: Target) -> str:
    """What a profile of this drafter and target is valid for: both tokenizers' fingerprints."""
    return f"{drafter.token_bytes.fingerprint}:{target.token_bytes.fingerprint}"


class Speculator:
    """The speculation machinery of `drafter` paired with `target` under `config`: with a `user`,
    their `profile`'s n-gram cache, past outputs and acceptance head; `adapter`: the drafter's
    LoRA adapter to draft with (None: the base weights); `learn`: an adapter is being trained (the
    pairing sets `learner`); `proposer`: builds, from the speculator, the proposer each round's
    proposal comes from (the pairing's default: proposers.default_proposer)."""

    def __init__(
        self,
        drafter: PairedDrafter,
        target: Target,
        config: DecodeConfig,
        *,
        proposer: Callable[[Speculator], Proposer],
        user: str | None = None,
        profile: PairingProfile | None = None,
        adapter: str | None = None,
        learn: bool = False,
    ) -> None:
        self.drafter, self.target, self.config, self.adapter = drafter, target, config, adapter
        vmap, self.healer = pair_tables(drafter, target, healing=config.healing)
        self.translator = self._translator(vmap, user, profile)
        # drafter ids with a target id of the same bytes (exact mode drafts only these)
        self.shared_vocab = vmap.d2t >= 0
        self.plan = plan = plan_drafting(drafter, target, config, learn)
        self.best_speedup, self.chooser = plan.best_speedup, plan.chooser
        self.model_drafts, self.free_drafts = plan.model, plan.free
        # measured costs, from the target's own where it has them
        self.cost = CostModel(verify=plan.best_speedup.verify if plan.best_speedup else None)
        # no request slower than the target alone (adaptive/floor.py), where latency is the objective
        self.floor = Floor(on=config.objective == "latency")
        if plan.best_speedup is not None and plan.model:  # a first model draft's read, before measured
            from ..runtime.backends import reading_cost

            self.floor.read = reading_cost(drafter)
        self.retriever: Retriever | None = None
        if config.drafts != "model":
            self.retriever = Retriever.for_user(
                config.retrieval,
                user,
                profile.history if profile else None,
                target.token_bytes.fingerprint,
                model=config.drafts == "hybrid" and plan.model,
            )
        self.lengths = DraftLengths(
            config,
            self.cost,
            may_idle=plan.may_idle,
            hidden_size=drafter.hidden_size if config.head else None,
            saved_head=profile.tensors.get("head") if profile else None,
            shared=self.shared_vocab,
            label=f"{drafter.name} -> {target.name}",
        )
        self.learner: Learner | None = None  # the online distillation the rounds feed (learn=True)
        self._lock = threading.RLock()  # the state requests share: costs, policies, caches, stats
        self.proposer: Proposer = proposer(self)

    def _translator(self, vmap: Any, user: str | None, profile: PairingProfile | None) -> Translator:
        """The translator: the direct map, and the n-gram cache (the user's profile's, if saved)."""
        config, fingerprint = self.config, pair_fingerprint(self.drafter, self.target)
        cache = NgramCache(config.ngram, fingerprint=fingerprint)
        if profile is not None and profile.ngram is not None:
            cache = NgramCache.from_doc(
                profile.ngram, where=f"profile of {user!r}", fingerprint=fingerprint, config=config.ngram
            )
        return Translator(self.drafter.codec, self.target.codec, vmap, cache, strategy=config.strategy)

    @property
    def policy(self) -> CostPolicy | None:
        """The cost policy that picks draft lengths (None with a fixed k, a head or hysteresis)."""
        return self.lengths.policy

    @property
    def head(self) -> AcceptanceHead | None:
        """The acceptance head (None without one)."""
        return self.lengths.head

    @property
    def drafting(self) -> bool:
        """Whether any draft can pay here."""
        return self.model_drafts or self.free_drafts

    @property
    def speculating(self) -> bool:
        """Whether this pairing drafts: False once its measured costs say drafting cannot pay."""
        if not self.drafting or (self.chooser is not None and not self.chooser.speculating):
            return False
        return self.lengths.speculating if self.model_drafts else True

    def serving(self, rule: Rule, logprobs: int) -> str:
        """How a request is served: "engine" (the target's engine verifies the drafts in its own
        step: vLLM with omnidraft's proposer, greedy or sampled without a seed), "alone" (the
        target decodes it alone: drafting cannot pay, or the serving chooser measured it faster) or
        "speculate" (the round loop). A request for per-token log-probabilities speculates: each
        round's verify returns its rows; so does a seeded sampled one (the round loop keys each
        sample by seed and position, so the output depends on the seed alone, not on which drafts
        reached the engine)."""
        if logprobs:
            return "speculate"
        greedy = rule.mode == "greedy"
        can = self.target.capabilities
        if greedy and not self.drafting and can.decodes_alone:
            return "alone"
        in_engine = greedy or (rule.mode == "match" and rule.seed is None)
        if in_engine and self.learner is None and can.drafts_in_engine:
            return "engine"
        with self._lock:
            return self.chooser.choose() if self.chooser is not None and greedy else "speculate"

    def why(self, served: str, stats: GenerationStats) -> str:
        """Why a request served `served` drafted as it did (empty where it simply speculated)."""
        if served == "alone":
            if not self.drafting:
                seen = f": {self.best_speedup.reason()}" if self.best_speedup is not None else ""
                return f"drafting cannot pay on this machine{seen}"
            return "decoding alone measured faster for this pairing here"
        if stats.rounds and stats.speculating == 0:
            if self.target.capabilities.decodes_alone and not self.target.capabilities.in_process:
                return "no round drafted: the server's budget took no drafts"
            return "no round drafted: the measured costs said a draft would not pay"
        return ""

    def finish(
        self, served: str, out: list[int], rounds: list[RoundRecord], stats: GenerationStats
    ) -> dict[str, Any] | None:
        """A finished request's bookkeeping: the user's datastore, the serving chooser, the head.
        Returns the metrics row of a head update, if one ran."""
        with self._lock:
            if self.retriever is not None:
                self.retriever.finish(out)
            if self.chooser is not None and len(rounds) > 1:  # decode-phase rate: round 1 also prefills
                self.chooser.observe(
                    served,
                    len(out) - rounds[0].emitted,
                    stats.seconds - rounds[0].seconds,
                    label=f"{self.drafter.name} -> {self.target.name}",
                )
            return self.lengths.end_request(self.learner)

    # What a request changes in the state its pairing's requests share, each under the lock.

    def begin_request(self, drafter_tokens: int) -> tuple[int, Stopper | None, Ledger]:
        """A request begins: its first draft length, its acceptance head's stopper (None: none) and
        its ledger against the target alone (`drafter_tokens`: the prompt the drafter reads)."""
        with self._lock:  # (the draft lengths' begin also moves the shared acceptance history)
            k, stopper = self.lengths.begin_request()
            return k, stopper, self.floor.begin(self.cost.verify.get(1), drafter_tokens)

    def read_prompt(self, ledger: Ledger, tokens: int, seconds: float) -> None:
        """The drafter read the request's prompt of `tokens` in `seconds` (the floor books it)."""
        with self._lock:
            self.floor.read_prompt(ledger, tokens, seconds)

    def end_request(self, ledger: Ledger) -> None:
        """A request is over: the floor takes its ledger."""
        with self._lock:
            self.floor.end(ledger)

    def observe_costs(
        self, drafted: int, t_draft: float, verified: int, t_verify: float, t_other: float
    ) -> None:
        """A round's costs, for the cost model (adaptive/costs.py)."""
        with self._lock:
            self.cost.observe(drafted, t_draft, verified, t_verify, t_other)

    def settle_read(
        self,
        read: PromptRead,
        deferred: bool,
        committed: int,
        seconds: float | None,
        drafted: int,
        t_draft: float,
        produced: int,
    ) -> None:
        """What a round says about deferring the drafter's read of the prompt (retrieve/retriever.py)."""
        with self._lock:
            read.settle(deferred, committed, seconds, drafted, t_draft, self.cost.draft, produced)

    def translate(self, draft: list[int], only: str, skip: int) -> Proposal:
        """A drafter draft in the target's ids (translate/translator.py)."""
        with self._lock:
            return self.translator.translate(draft, only=only, skip=skip)

    def resync(self, draft: list[int], held: bytes, new: list[int]) -> tuple[int, list[int]]:
        """How many of `draft`'s tokens the drafter keeps and the drafter ids of the rest, after the
        target committed `new` (`held`: the bytes of the drafter token the draft began by
        replacing); the n-gram cache learns the pair."""
        with self._lock:
            keep, tail = self.translator.resync(draft, held + self.target.token_bytes.join(new))
            self.translator.learn(draft[:keep] + tail, new, skip=len(held))
            return keep, tail

    def next_length(
        self, k: int, stopper: Stopper | None, drafted: int, modeled: int, accepted: int, kept: int
    ) -> int:
        """The next model draft length after a round (adaptive/lengths.py)."""
        with self._lock:
            return self.lengths.next(k, stopper, drafted, modeled, accepted, kept)

    def begin_retrieval(self, prompt_ids: list[int]) -> ContextIndex | None:
        """A request's retrieval index (None: this pairing retrieves nothing at this target)."""
        if self.retriever is None or not self.free_drafts:
            return None
        with self._lock:  # (begin also moves the shared acceptance history)
            return self.retriever.begin(prompt_ids)

    def retrieve(self, index: ContextIndex, limit: int, drafting: bool) -> Used | None:
        """A retrieved continuation where the planner expects it to pay (None: none)."""
        if self.retriever is None:
            return None
        with self._lock:
            rates = self.policy.last_rates if self.policy else {}
            return self.retriever.plan(index, self.cost, rates, limit, drafting=drafting)

    def run_on(self, index: ContextIndex, proposal: Proposal, limit: int) -> tuple[Proposal, Used | None]:
        """`proposal` run on into a retrieved continuation where its end matches one."""
        if self.retriever is None:
            return proposal, None
        with self._lock:
            return self.retriever.extend(index, proposal, limit)

    def commit_retrieval(
        self, index: ContextIndex, new: list[int], used: Used | None, proposed: int, accepted: int
    ) -> None:
        """The index reads the committed ids `new` (it walks the user's datastore, which a request's
        end extends); the retrieval statistics see the round: `accepted` of `proposed`."""
        with self._lock:
            index.commit(new)
            if self.retriever is not None:
                self.retriever.observe(used, proposed, accepted)
