"""A drafter paired with a target, and OmniDraft's Algorithm 1 loop: draft, translate, verify,
re-sync, learn. Streaming, EOS, stop strings and `max_new_tokens` live here; the acceptance maths
live in verify.py and the vocabulary work in translate/.
"""

from __future__ import annotations

import codecs
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from .adaptive.head import AcceptanceHead, CostModel, HeadConfig, Stopper, head_state
from .adaptive.policy import CostPolicy, Hysteresis, ModeChooser
from .draft import NO_DRAFT
from .errors import TargetError
from .retrieve import DRAFT_SOURCES, ContextIndex, Datastore, RetrievalConfig
from .retrieve.planner import Retriever, Used
from .stats import GenerationStats, RoundRecord
from .target import Rule
from .translate.healing import Healer
from .translate.ngram_cache import NgramCache, NgramCacheConfig
from .translate.translator import Proposal, Source, Translator
from .translate.vocab_map import ROLES, VocabMap, build_vocab_map

if TYPE_CHECKING:
    from .distill.adapters import AdapterConfig
    from .distill.trainer import TrainConfig
    from .drafter import Drafter
    from .profiles import ProfileStore
    from .target import Target

__all__ = ["K_START", "DecodeConfig", "Generation", "Pairing", "TABLES_KEPT", "pair_tables"]

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
    whole completion), whichever measured faster (adaptive/policy.py `ModeChooser`), so such a
    pairing is never much slower than its target alone; "compute" always speculates, which spends
    fewer target forwards per token.
    `mode`/`temperature`: see verify.py. `mode="relaxed-lossy"` (LOSSY, in-process targets, greedy):
    ReSpec's relaxed verification, a retrieved token is accepted within the target's top
    `relaxed_top_r` when the target carries the copy on (verify.relaxed); model drafts stay
    greedy. Its output may differ from the target's own: docs/retrieval.md measures by how much.
    `strategy`: draft-to-target translation ("text" or "ngram", see translator.py).
    `stop_confidence`: end a draft early after a token the drafter gives less probability than this.
    `adaptive`: a Hysteresis policy that moves the draft length (starting at k) with acceptance;
    None keeps k fixed. `head`: an acceptance head per pairing decides each draft's length (see
    adaptive/head.py); until it has seen `head.warmup` labelled tokens the hysteresis fallback
    (or `adaptive`) does. `heal`: token healing of the drafter's context (translate/healing.py);
    it acts where it is lossless and the translation re-tokenizes text: greedy and `match`
    verification with the "text" strategy (`healing` says whether it acts).
    `drafts`: where proposals come from. "hybrid" (default): the drafter model, or a continuation
    retrieved from the request's context (and the user's past outputs, with a profile) where that
    is expected to commit more tokens per second, and a model draft may run on into a retrieved
    continuation (retrieve/, `retrieval` configures it); "model": the drafter only; "retrieval":
    retrieved drafts only, no drafter forward at all. Every mode verifies them the same way."""

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

    def __post_init__(self) -> None:
        if self.drafts not in DRAFT_SOURCES:
            raise ValueError(f"drafts must be one of {DRAFT_SOURCES}, got {self.drafts!r}")
        if self.k is not None and (not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1):
            raise ValueError(f"draft length k must be None (chosen from measured costs) or an integer >= 1, got {self.k!r}")
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
                raise ValueError("relaxed-lossy verification relaxes retrieved drafts only; drafts='model' has none")
            if not isinstance(self.relaxed_top_r, int) or self.relaxed_top_r < 2:
                raise ValueError(f"relaxed_top_r must be an integer >= 2, got {self.relaxed_top_r!r}")
        Rule(mode="greedy" if self.mode == RELAXED else self.mode, temperature=self.temperature)  # validates both

    @property
    def lossy(self) -> bool:
        """Whether outputs may differ from the target's own (greedy) or its distribution (sampling)."""
        return self.mode in (RELAXED, "omnidraft")

    @property
    def rule(self) -> Rule:
        """The target's acceptance rule; relaxed verification is greedy's, relaxed for retrieved tokens."""
        return Rule(mode="greedy" if self.mode == RELAXED else self.mode, temperature=self.temperature)

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


@dataclass(frozen=True)
class Generation:
    """Result of `Pairing.generate`: the text, the target token ids generated, stats and rounds."""

    text: str
    token_ids: list[int]
    stats: GenerationStats
    rounds: list[RoundRecord]
    finish_reason: str


TABLES_KEPT = 8  # tokenizer pairs whose vocabulary map and healer stay built (a few MB each)
_tables: OrderedDict[tuple[Any, ...], tuple[VocabMap, Healer | None]] = OrderedDict()
_tables_lock = threading.Lock()


def _tokenizer_key(side: Any) -> tuple[Any, ...]:
    """What a vocabulary map and a healer are functions of: the token bytes and the special tokens."""
    tb = side.token_bytes
    return tb.fingerprint, tuple(sorted(tb.special.items())), tuple(getattr(side.tokenizer, r, None) for r in ROLES)


def pair_tables(drafter: Any, target: Any, *, healing: bool = True) -> tuple[VocabMap, Healer | None]:
    """The vocabulary map and (with `healing`) the token healer of a drafter-target tokenizer pair.

    Both are read-only and take ~0.4 s to build against Gemma's 262k vocabulary, so every pairing
    of the same two tokenizers shares one copy (the last TABLES_KEPT pairs are kept): a second
    `drafter.pair(target)` costs milliseconds, not a rebuild.
    """
    key = (_tokenizer_key(drafter), _tokenizer_key(target))
    with _tables_lock:
        hit = _tables.get(key)
        if hit is not None:
            _tables.move_to_end(key)
    if hit is None or (healing and hit[1] is None):
        vmap = hit[0] if hit is not None else build_vocab_map(drafter.token_bytes, target.token_bytes,
                                                              drafter.tokenizer, target.tokenizer)
        hit = (vmap, Healer(drafter.token_bytes, target.token_bytes) if healing else None)
        with _tables_lock:
            _tables[key] = hit
            while len(_tables) > TABLES_KEPT:
                _tables.popitem(last=False)
    return hit[0], hit[1] if healing else None


class Pairing:
    """A drafter and a target with their translator (direct map + n-gram cache) and, per user, a
    profile: the n-gram cache, a LoRA adapter on the drafter and metrics (see profiles.py)."""

    def __init__(self, drafter: Drafter, target: Target, config: DecodeConfig, *, user: str | None = None,
                 learn: bool = False, train: TrainConfig | None = None, adapter: AdapterConfig | None = None,
                 store: ProfileStore | None = None) -> None:
        from .profiles import ProfileStore

        self.drafter, self.target, self.config, self.user = drafter, target, config, user
        if config.mode == RELAXED:
            if not getattr(target, "in_process", False):
                raise ValueError(f"relaxed-lossy verification needs an in-process target; {target!r} verifies remotely")
            log.warning("%s -> %s: relaxed-lossy verification; outputs may differ from the target's own greedy output",
                        drafter.name, target.name)
        vmap, healer = pair_tables(drafter, target, healing=config.healing)
        self.fingerprint = f"{drafter.token_bytes.fingerprint}:{target.token_bytes.fingerprint}"
        self.store = store or ProfileStore()
        profile = self.store.load(drafter.name, target.name, user, fingerprint=self.fingerprint) if user else None
        cache = NgramCache(config.ngram, fingerprint=self.fingerprint)
        if profile is not None and profile.ngram is not None:
            cache = NgramCache.from_doc(profile.ngram, where=f"profile of {user!r}", fingerprint=self.fingerprint,
                                        config=config.ngram)
        self.translator = Translator(drafter.codec, target.codec, vmap, cache, strategy=config.strategy)
        self.healer = healer
        self._shared = vmap.d2t >= 0
        self.metrics: list[dict[str, Any]] = list(profile.metrics) if profile else []
        self._steps0 = profile.steps if profile else 0
        self.adapter: str | None = None
        saved = profile.tensors.get("adapter") if profile else None
        if (learn or saved is not None) and not hasattr(drafter, "add_adapter"):
            if learn:
                raise ValueError(f"{drafter!r} cannot learn (no adapters): pair a PyTorch Drafter to learn")
            saved = None  # an exported drafter carries the adapter it was exported with
        if learn or saved is not None:
            from .distill.adapters import config_from_state

            self.adapter = drafter.adapter_name(target.name, user)
            drafter.add_adapter(self.adapter, config_from_state(saved) if saved is not None else adapter, saved)
        self.cost = CostModel()
        self.retriever: Retriever | None = None
        if config.drafts != "model":
            history = None
            if user is not None:  # the user's past outputs are drafts too, kept in their profile
                where, tfp = f"profile of {user!r}", target.token_bytes.fingerprint
                history = (Datastore.from_doc(profile.history, where=where, fingerprint=tfp)
                           if profile is not None and profile.history is not None else Datastore(fingerprint=tfp))
            self.retriever = Retriever(config.retrieval, history, model=config.drafts == "hybrid")
        # with a mode chooser, whether to draft at all is decided per request from measured throughput. With
        # retrieval drafts, whose worth depends on each request's context, an in-process target decides it
        # round by round instead (a round without a draft costs it no more than decoding alone)
        per_round = config.drafts != "model" and getattr(target, "in_process", False)
        self.modes = (ModeChooser() if config.objective == "latency" and config.mode == "greedy" and config.k is None
                      and not per_round and not learn and getattr(target, "generates_alone", False) else None)
        self.policy = (CostPolicy(self.cost, k_max=config.k_max, start=config.start_k, may_idle=self.modes is None)
                       if config.cost_driven else None)
        self.head: AcceptanceHead | None = None
        self.head_trainer: Any = None
        if config.head is not None:
            self._init_head(config.head, profile.tensors.get("head") if profile else None)
        self.learner = None
        if learn:
            from .distill.learner import Learner
            from .distill.trainer import TrainConfig

            self.learner = Learner(drafter, self.adapter, vmap.t2d, target.token_bytes, train or TrainConfig(),
                                   start_step=self._steps0)
        self.last: Generation | None = None

    def _init_head(self, config: HeadConfig, saved: dict[str, torch.Tensor] | None) -> None:
        from .adaptive.trainer import HeadTrainer

        size = getattr(self.drafter, "hidden_size", None)
        if size is None:
            raise ValueError(f"an acceptance head needs a drafter that exposes hidden states; {self.drafter!r} does not")
        self.head = AcceptanceHead(size, config.width, config.depth, seed=config.seed).eval()
        self.head_trainer = HeadTrainer(self.head, config)
        if saved is not None:
            saved = dict(saved)
            self.head_trainer.trained = self.head_trainer.seen = int(saved.pop("meta.trained", torch.tensor(0)))
            try:
                self.head.load_state_dict(saved)
            except RuntimeError as exc:
                raise ValueError(f"the saved acceptance head does not fit this drafter or head config: {exc}") from None
        self._fallback = self.config.adaptive or Hysteresis(k_min=max(2, config.k_min), k_max=config.k_max)

    @property
    def head_ready(self) -> bool:
        """Whether the acceptance head (not the fallback) decides draft lengths now."""
        return self.head is not None and self.head_trainer.trained >= self.config.head.warmup

    @property
    def speculating(self) -> bool:
        """Whether this pairing drafts: False once its measured costs say drafting cannot pay here
        (greedy requests then decode with the target alone, see `DecodeConfig.k` and `objective`)."""
        if self.modes is not None and not self.modes.speculating:
            return False
        return self.policy.speculating if self.policy is not None else True

    @property
    def steps(self) -> int:
        """Optimizer steps this pairing's adapter has had, over every session of its profile."""
        return self._steps0 + (self.learner.steps if self.learner else 0)

    def save(self) -> Path:
        """Write this user's profile (adapter, n-gram cache, metrics) atomically; returns its directory."""
        from .distill.adapters import adapter_state
        from .profiles import PairingProfile

        if self.user is None:
            raise ValueError("this pairing has no user profile: pair(target, user=...) to save one")
        tensors = {}
        if self.learner is not None:
            self.learner.wait()
        if self.adapter is not None:
            with self.drafter.lock:
                alpha = self.drafter.trainable.peft_config[self.adapter].lora_alpha
                tensors["adapter"] = {**adapter_state(self.drafter.trainable, self.adapter), "meta.alpha": torch.tensor(alpha)}
        if self.head is not None:
            tensors["head"] = {**head_state(self.head), "meta.trained": torch.tensor(self.head_trainer.trained)}
        metrics = self.metrics + (self.learner.metrics if self.learner else [])
        profile = PairingProfile(drafter=self.drafter.name, target=self.target.name, user=self.user,
                                 fingerprint=self.fingerprint, steps=self.steps, metrics=metrics,
                                 ngram=self.translator.cache.to_doc(), tensors=tensors,
                                 history=self.retriever.history.to_doc() if self.retriever and self.retriever.history else None)
        return self.store.save(profile)

    def generate(self, prompt: str, max_new_tokens: int = 128, *, stop: tuple[str, ...] = (),
                 generator: torch.Generator | None = None) -> Generation:
        """Decode `prompt` speculatively; greedy output equals the target's own greedy output."""
        for _ in self.stream(prompt, max_new_tokens, stop=stop, generator=generator):
            pass
        assert self.last is not None
        return self.last

    def stream(self, prompt: str, max_new_tokens: int = 128, *, stop: tuple[str, ...] = (),
               generator: torch.Generator | None = None) -> Iterator[str]:
        """Yield text as it is committed; afterwards `self.last` holds the full `Generation`."""
        _check_request(prompt, max_new_tokens, stop)
        started = time.perf_counter()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        hold = max(map(len, stop), default=1) - 1  # a stop string may begin in text not yet shown
        out: list[int] = []
        rounds: list[RoundRecord] = []
        text, shown, reason = "", 0, "length"
        tts = self.learner.config.tts_every if self.learner is not None else 0
        if tts:
            self.learner.begin_request()
        mode = self.modes.choose() if self.modes is not None else "speculate"
        if self.policy is not None:
            self.policy.begin_request()
        try:
            for new, record in self._rounds(prompt, max_new_tokens, generator, alone=mode == "alone"):
                rounds.append(record)
                out += new
                if tts and len(rounds) % tts == 0:
                    self.learner.within_request(self._verified(prompt, out, rounds))
                text += decoder.decode(self.target.token_bytes.join(new))
                if stop and (cut := _first_stop(text, max(0, shown - hold), stop)) is not None:
                    text, reason = text[:cut], "stop"
                    break
                if out[-1:] and out[-1] in self.target.eos_ids:
                    reason = "eos"
                if len(text) - hold > shown:
                    yield text[shown : len(text) - hold]
                    shown = len(text) - hold
        except TargetError as exc:  # e.g. a remote target gone: keep what was committed
            stats = GenerationStats.from_rounds(rounds, len(out), time.perf_counter() - started)
            self.last = exc.partial = Generation(text + decoder.decode(b"", final=True), out, stats, rounds, "error")
            raise
        finally:
            if tts:
                self.learner.end_request()  # the request's fast steps end with it, however it ends
        if reason != "stop":
            text += decoder.decode(b"", final=True)
        if len(text) > shown:
            yield text[shown:]
        stats = GenerationStats.from_rounds(rounds, len(out), time.perf_counter() - started)
        self.last = Generation(text, out, stats, rounds, reason)
        if self.retriever is not None:
            self.retriever.finish(out)
        if self.modes is not None and len(rounds) > 1:  # decode-phase rate: the first round also prefills
            first, was = rounds[0], self.modes.speculating
            self.modes.observe(mode, len(out) - first.emitted, stats.seconds - first.seconds)
            if self.modes.speculating != was:
                log.info("%s -> %s: %s (measured %s)", self.drafter.name, self.target.name,
                         "speculating is faster again" if self.modes.speculating else
                         "the target alone is faster here; requests decode without drafts (re-measured now and then)",
                         ", ".join(f"{m} {r:.1f} tok/s" for m, r in self.modes.rates.items() if r is not None))
        if self.head_trainer is not None and self.config.head.train is not None:
            self._head_update()
        if self.learner is not None and out:
            self.learner.observe(self._verified(prompt, out, rounds), stats.acceptance_rate, stats.mean_accepted_length)

    def _rounds(self, prompt: str, max_new_tokens: int, generator: torch.Generator | None,
                alone: bool = False) -> Iterator[tuple[list[int], RoundRecord]]:
        prompt_ids = self.target.tokenizer(prompt)["input_ids"]
        tsession = self.target.begin(prompt_ids)
        try:
            if alone:  # the target decodes the whole request on its side: no draft at all
                yield from _decode_alone(tsession, max_new_tokens)
                return
            index = self.retriever.begin(prompt_ids) if self.retriever is not None else None
            if hasattr(self.drafter, "activate"):  # drafters without adapters (a fake, an exported graph) have none
                self.drafter.activate(self.adapter)
            ids = self.drafter.tokenizer(prompt)["input_ids"]
            dsession = self.drafter.begin(ids)
            topk = self.learner.config.topk if self.learner is not None else 0
            self._rows: list[tuple[torch.Tensor, torch.Tensor]] = []
            yield from self._loop(tsession, dsession, max_new_tokens, generator, topk, ids[-1] if ids else -1, index)
        finally:
            close = getattr(tsession, "close", None)
            if close is not None:
                close()  # a remote session frees its server-side KV cache now

    def _loop(self, tsession: Any, dsession: Any, max_new_tokens: int, generator: torch.Generator | None,
              topk: int, last: int, index: ContextIndex | None) -> Iterator[tuple[list[int], RoundRecord]]:
        """Algorithm 1's rounds. `last`: the drafter context's last token, which token healing may
        let the next draft replace (translate/healing.py). `index`: the request's retrieval index
        (None: model drafts only)."""
        target, translator, rule = self.target, self.translator, self.config.rule
        only = {"exact": "direct", "omnidraft": "aligned"}.get(rule.mode, "any")
        aligned = only != "any"
        allowed = self._shared if rule.mode == "exact" else None
        produced = 0
        k = self.policy.next_k() if self.policy is not None else self.config.start_k
        if self.config.drafts == "retrieval":
            k = 0
        hc = self.config.head
        stopper = Stopper(self.head, hc, self._shared, self.cost) if hc is not None else None
        first, previous, idle = True, None, False  # idle: the last round did not draft
        draft_table = self.drafter.token_bytes.table
        while produced < max_new_tokens:
            t0 = time.perf_counter()
            if previous is not None:  # the round's whole wall time beyond drafting and verifying is overhead
                drafted, t_draft, verified, t_verify, started = previous
                self.cost.observe(drafted, t_draft, verified, t_verify, (t0 - started) - t_draft - t_verify)
            room = max_new_tokens - produced - 1  # tokens a proposal may hold: the target adds one
            used = None
            if index is not None:
                used = self.retriever.plan(index, self.cost, self.policy.last_rates if self.policy else {}, room)
            if used is not None:  # a retrieved draft: no drafter forward this round
                draft, t1 = NO_DRAFT, time.perf_counter()
                proposal = translator.translate([], only=only).then(used.candidate.ids[: used.length])
            else:
                draft = NO_DRAFT if k == 0 else self._draft(dsession, k, stopper, last,
                                                             tsession.ids[-1] if tsession.ids else None, allowed, generator)
                t1 = time.perf_counter()
                proposal = translator.translate(draft.ids, only=only, skip=len(draft_table[last]) if draft.healed else 0)
                proposal = proposal.cut(min(len(proposal), room))
                if index is not None:
                    proposal, used = self.retriever.extend(index, proposal, room)
            held = draft_table[last] if draft.healed else b""  # committed bytes the draft starts with
            modeled = len(proposal) - proposal.retrieved  # proposed tokens that came from the model
            q = _draft_rows(translator, proposal, modeled, draft) if aligned and len(proposal) else None
            t2 = time.perf_counter()
            context = len(tsession.ids)
            relax = {}
            if self.config.mode == RELAXED and proposal.retrieved:
                mask = torch.tensor([s == Source.RETRIEVED for s in proposal.sources], dtype=torch.bool)
                relax = {"relax": (mask, self.config.relaxed_top_r)}
            verdict = tsession.verify(proposal.ids, rule, q, generator, topk=topk, **relax)
            t3 = time.perf_counter()
            new = tsession.ids[context:]
            eos = next((i for i, t in enumerate(new) if t in target.eos_ids), None)
            if eos is not None:
                new = new[: eos + 1]
            if topk:
                self._rows.append((verdict.topk[0][: len(new)], verdict.topk[1][: len(new)]))
            keep, tail = translator.resync(draft.ids, held + target.token_bytes.join(new))
            translator.learn(draft.ids[:keep] + tail, new, skip=len(held))
            dsession.commit(keep, tail)
            if index is not None:
                index.commit(new)
                self.retriever.observe(used, len(proposal), verdict.accepted)
            last = (draft.ids[:keep] + tail or [last])[-1]
            t4 = time.perf_counter()
            produced += len(new)
            # the first verification also prefills the prompt: not a verification cost. The round is
            # observed when the next one starts, so its overhead includes the head's bookkeeping, the
            # caller's handling of the yielded tokens and whatever else stands between two rounds.
            # A draft right after rounds without one first catches the drafter up on every token
            # committed meanwhile: a one-off, so its time does not enter the drafting cost line
            drafted = 0 if idle else len(draft.ids)
            previous = None if first else (drafted, t1 - t0, len(proposal) + 1, t3 - t2, t0)
            first, idle = False, not draft.ids
            retrieved_accepted = sum(1 for s in proposal.sources[: verdict.accepted] if s == Source.RETRIEVED)
            if self.config.drafts != "retrieval":
                k = self._next_length(k, stopper, len(draft.ids), modeled, verdict.accepted - retrieved_accepted, keep)
            yield new, RoundRecord(
                context=context, drafted=len(draft.ids), proposed=len(proposal), accepted=verdict.accepted,
                emitted=len(new), from_cache=sum(1 for s in proposal.sources[: verdict.accepted] if s == Source.NGRAM),
                t_draft=t1 - t0, t_translate=t2 - t1, t_verify=t3 - t2, t_resync=t4 - t3,
                retrieved=proposal.retrieved, retrieved_accepted=retrieved_accepted,
            )
            if new and new[-1] in target.eos_ids:
                return

    def _draft(self, dsession: Any, k: int, stopper: Stopper | None, last: int, committed: int | None,
               allowed: torch.Tensor | None, generator: torch.Generator | None) -> Any:
        """One draft: up to k tokens (k_max once the head decides), stopped by the head or, until it
        decides, by the drafter's confidence; healed when the target's last committed token
        `committed` lets a longer drafter token replace the drafter context's `last`."""
        extra: dict[str, Any] = {}
        stop_confidence = self.config.stop_confidence
        if stopper is not None:
            stopper.reset()
            stopper.decide = self.head_ready  # before warm-up it only records features; the fallback decides
            extra["stopper"] = stopper
            if stopper.decide:
                k, stop_confidence = self.config.head.k_max, 0.0
        if self.healer is not None and committed is not None:
            heal = self.healer.candidates(last, self.target.token_bytes.table[committed])
            if heal is not None:
                extra["heal"] = heal
        return dsession.propose(k, temperature=self.config.rule.temperature, allowed=allowed, generator=generator,
                                stop_confidence=stop_confidence, **extra)

    def _next_length(self, k: int, stopper: Stopper | None, drafted: int, proposed: int, accepted: int,
                     kept: int) -> int:
        """The next round's draft length: the cost policy's, or the fallback's (or `adaptive`'s);
        with a head, the round's features and the `kept` drafted tokens go to its trainer first."""
        if self.policy is not None:
            was = self.policy.speculating
            self.policy.observe(drafted, proposed, accepted)
            k = self.policy.next_k()
            if self.policy.speculating != was:
                rates = self.policy.last_rates
                log.info("%s -> %s: %s (measured: %.1f tok/s drafting %d a round, %.1f tok/s alone)", self.drafter.name,
                         self.target.name, "drafting pays again" if self.policy.speculating else
                         "drafting costs more than it saves; the target decodes alone, with a probe draft now and then",
                         max(v for key, v in rates.items() if key > 0), max((key for key in rates if key > 0),
                                                                             key=rates.__getitem__), rates[0])
            return k
        if stopper is not None:
            if self.config.head.train is not None:
                self.head_trainer.add(stopper.features(), kept)
            return self._fallback.next_k(k, proposed, accepted)
        if self.config.adaptive is not None:
            return self.config.adaptive.next_k(k, proposed, accepted)
        return k

    def _head_update(self) -> None:
        """Interleaved: the head's own cadence. Joint: in step with the adapter's updates."""
        trainer = self.head_trainer
        if self.config.head.train == "interleaved":
            row = trainer.end_request()
        else:
            trainer.requests += 1
            interval = self.learner.config.interval if self.learner is not None else self.config.head.interval
            row = trainer.update() if trainer.requests % interval == 0 else None
        if row is not None:
            self.metrics.append({"head_update": trainer.steps, **row})

    def _verified(self, prompt: str, out: list[int], rounds: list[RoundRecord]) -> Any:
        """The finished request as distillation input (committed tokens with the target's rows)."""
        from .distill.buffer import VerifiedRequest

        ids, logp = (torch.cat(parts)[: len(out)] for parts in zip(*self._rows))
        positions = [j + 1 for r in rounds for j in range(r.emitted)][: len(out)]
        return VerifiedRequest(prompt, out, ids, logp, positions)


def _draft_rows(translator: Translator, proposal: Proposal, modeled: int, draft: Any) -> torch.Tensor | None:
    """q' rows (M, Vt) for rejection sampling: the model tokens' from the drafter's distributions,
    a retrieved token's one-hot (it was proposed with certainty, so rejection sampling stays exact)."""
    parts = []
    if modeled:
        if draft.q is None:
            return None
        parts.append(translator.draft_probs(proposal.cut(modeled), draft.ids, draft.q))
    retrieved = proposal.ids[modeled:]
    if len(retrieved):
        parts.append(torch.nn.functional.one_hot(retrieved, len(translator.map.t2d)).float())
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _decode_alone(tsession: Any, max_new_tokens: int) -> Iterator[tuple[list[int], RoundRecord]]:
    """The target session decodes alone (greedy); one record per token, as one forward each."""
    context, last = len(tsession.ids), time.perf_counter()
    for token in tsession.decode(max_new_tokens):
        now = time.perf_counter()
        yield [token], RoundRecord(context=context, drafted=0, proposed=0, accepted=0, emitted=1, from_cache=0,
                                   t_draft=0.0, t_translate=0.0, t_verify=now - last, t_resync=0.0)
        context, last = context + 1, now


def _check_request(prompt: str, max_new_tokens: int, stop: tuple[str, ...]) -> None:
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty string, got {prompt!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if isinstance(stop, str) or any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"stop must be a tuple of non-empty strings, got {stop!r}")


def _first_stop(text: str, start: int, stop: tuple[str, ...]) -> int | None:
    """Where the earliest stop string found at or after `start` begins in `text`, or None."""
    hits = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(hits) if hits else None
