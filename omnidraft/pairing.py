"""A drafter paired with a target, and OmniDraft's Algorithm 1 loop: draft, translate, verify,
re-sync, learn. Streaming, EOS, stop strings and `max_new_tokens` live here; the acceptance maths
live in verify.py and the vocabulary work in translate/.
"""

from __future__ import annotations

import codecs
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from .adaptive.head import CostModel, Stopper
from .adaptive.lengths import DraftLengths, plan_drafting
from .backends import drafting_twin
from .config import K_START, RELAXED, DecodeConfig
from .distill.attach import attach_adapter
from .draft import NO_DRAFT, Adaptable
from .errors import TargetError
from .retrieve import ContextIndex
from .retrieve.planner import NO_RENT, Retriever
from .rounds import (Generation, check_request, decode_alone, draft_rows, first_stop, make_generator, relaxation,
                     render_chat, verified, within_budget)
from .stats import GenerationStats, RoundRecord
from .translate.ngram_cache import NgramCache
from .translate.tables import TABLES_KEPT, pair_tables
from .translate.translator import Source, Translator

if TYPE_CHECKING:
    from .distill.adapters import AdapterConfig
    from .distill.trainer import TrainConfig
    from .drafter import Drafter
    from .profiles import ProfileStore
    from .target import Target

__all__ = ["K_START", "TABLES_KEPT", "DecodeConfig", "Generation", "Pairing", "pair", "pair_tables"]

log = logging.getLogger(__name__)


class Pairing:
    """A drafter and a target with their translator (direct map + n-gram cache) and, per user, a
    profile: the n-gram cache, a LoRA adapter on the drafter and metrics (see profiles.py)."""

    def __init__(self, drafter: Drafter, target: Target, config: DecodeConfig, *, user: str | None = None,
                 learn: bool = False, train: TrainConfig | None = None, adapter: AdapterConfig | str | None = None,
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
        self.adapter = attach_adapter(drafter, target.name, user, learn=learn, adapter=adapter,
                                      saved=profile.tensors.get("adapter") if profile else None)
        self.plan = plan = plan_drafting(drafter, target, config, learn)
        self.outlook, self.model_drafts, self.free_drafts, self.modes = plan.outlook, plan.model, plan.free, plan.modes
        self.cost = CostModel(verify=plan.outlook.verify if plan.outlook else None)  # measured costs, if the target has them
        self.retriever = (Retriever.for_user(config.retrieval, user, profile.history if profile else None,
                                             target.token_bytes.fingerprint, model=config.drafts == "hybrid" and plan.model)
                          if config.drafts != "model" else None)
        self.lengths = DraftLengths(config, self.cost, may_idle=plan.may_idle,
                                    hidden_size=getattr(drafter, "hidden_size", None) if config.head else None,
                                    saved_head=profile.tensors.get("head") if profile else None, shared=self._shared,
                                    label=f"{drafter.name} -> {target.name}")
        self.learner = None
        if learn:
            from .distill.learner import Learner
            from .distill.trainer import TrainConfig

            self.learner = Learner(drafter, self.adapter, vmap.t2d, target.token_bytes, train or TrainConfig(),
                                   start_step=self._steps0)
        self.last: Generation | None = None
        self._book = threading.RLock()  # the state requests share: costs, policies, caches, stats

    policy = property(lambda self: self.lengths.policy,
                      doc="The cost policy that picks draft lengths (None with a fixed k, a head or hysteresis).")
    head = property(lambda self: self.lengths.head, doc="The acceptance head (None without one).")
    head_trainer = property(lambda self: self.lengths.trainer, doc="The head's trainer (None without a head).")
    head_ready = property(lambda self: self.lengths.head_ready, doc="Whether the head (not its fallback) decides.")
    drafting = property(lambda self: self.model_drafts or self.free_drafts, doc="Whether any draft can pay here.")

    @property
    def speculating(self) -> bool:
        """Whether this pairing drafts: False once its measured costs say drafting cannot pay here
        (greedy requests then decode with the target alone, see `DecodeConfig.k` and `objective`)."""
        if not self.drafting or (self.modes is not None and not self.modes.speculating):
            return False
        return self.lengths.speculating if self.model_drafts else True

    @property
    def steps(self) -> int:
        """Optimizer steps this pairing's adapter has had, over every session of its profile."""
        return self._steps0 + (self.learner.steps if self.learner else 0)

    def save_adapter(self, directory: str | os.PathLike[str]) -> Path:
        """This pairing's LoRA adapter as a peft adapter directory (`PeftModel.from_pretrained` reads
        it; `pair(..., adapter=directory)` brings it back). Atomic."""
        from .distill.adapters import save_peft

        if self.adapter is None:
            raise ValueError("this pairing has no adapter: pair(target, learn=True) or pair(target, adapter=DIR) gives one")
        if self.learner is not None:
            self.learner.wait()
        with self.drafter.lock:
            return save_peft(self.drafter.trainable, self.adapter, directory, base=self.drafter.name)

    def save(self) -> Path:
        """Write this user's profile (adapter, head, n-gram cache, datastore, metrics) atomically; its directory."""
        from .profiles import pairing_profile

        if self.user is None:
            raise ValueError("this pairing has no user profile: pair(target, user=...) to save one")
        if self.learner is not None:
            self.learner.wait()
        return self.store.save(pairing_profile(self))

    def generate(self, prompt: str | list[str], max_new_tokens: int = 128, *, stop: str | Sequence[str] = (),
                 seed: int | None = None, generator: torch.Generator | None = None, **sampling: Any) -> Any:
        """Decode `prompt` speculatively; greedy output equals the target's own greedy output. A list
        of prompts gives a list of Generations (decoded one after another). `sampling`: this call's
        `temperature`, `top_k`, `top_p`, `min_p` (DecodeConfig.request_rule); sampling draws from
        `generator`, or from a fresh one seeded with `seed`."""
        if isinstance(prompt, list):
            return [self.generate(p, max_new_tokens, stop=stop, seed=seed, generator=generator, **sampling) for p in prompt]
        done: list[Generation] = []
        for _ in self._stream(prompt, max_new_tokens, stop, make_generator(seed, generator), True, done, {**sampling, "seed": seed}):
            pass
        return done[0]

    def chat(self, messages: list[dict[str, str]], max_new_tokens: int = 128, *, stop: str | Sequence[str] = (),
             seed: int | None = None, generator: torch.Generator | None = None, **sampling: Any) -> Generation:
        """Answer a conversation ([{"role": "user", "content": ...}, ...]) in the target's chat
        template, rendered once; the target reads it as rendered (no second BOS) and the drafter
        reads the same text."""
        done: list[Generation] = []
        for _ in self._stream(self.render_chat(messages), max_new_tokens, stop, make_generator(seed, generator), False,
                              done, {**sampling, "seed": seed}):
            pass
        return done[0]

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The conversation as the target's chat template writes it, ready for the assistant's turn."""
        return render_chat(self.target.tokenizer, messages, self.target.name)

    def stream(self, prompt: str, max_new_tokens: int = 128, *, stop: str | Sequence[str] = (), seed: int | None = None,
               generator: torch.Generator | None = None, **sampling: Any) -> Iterator[str]:
        """Yield text as it is committed; afterwards `self.last` holds the full `Generation` (with
        threads sharing the pairing, the last one any of them finished)."""
        return self._stream(prompt, max_new_tokens, stop, make_generator(seed, generator), True, [], {**sampling, "seed": seed})

    def _stream(self, prompt: str, max_new_tokens: int, stop: str | Sequence[str], generator: torch.Generator | None,
                special: bool, done: list[Generation], sampling: dict[str, Any]) -> Iterator[str]:
        """`special`: the tokenizers add their special tokens (BOS) to `prompt`; False for text that
        has them already (a rendered chat). The finished Generation is appended to `done`."""
        stop = check_request(prompt, max_new_tokens, stop)
        rule = self.config.request_rule(**sampling)
        started = time.perf_counter()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        hold = max(map(len, stop), default=1) - 1  # a stop string may begin in text not yet shown
        out: list[int] = []
        rounds: list[RoundRecord] = []
        rows: list[tuple[torch.Tensor, torch.Tensor]] = []  # the target's top-k rows, for distillation
        text, shown, reason = "", 0, "length"
        tts = self.learner.config.tts_every if self.learner is not None else 0
        if tts:
            self.learner.begin_request()
        with self._book:
            mode = self.modes.choose() if self.modes is not None and rule.mode == "greedy" else "speculate"
            if not self.drafting and rule.mode == "greedy" and getattr(self.target, "generates_alone", False):
                mode = "alone"
        try:
            for new, record in self._rounds(prompt, rule, max_new_tokens, generator, mode == "alone", special, rows):
                rounds.append(record)
                out += new
                if tts and len(rounds) % tts == 0:
                    self.learner.within_request(verified(prompt, out, rounds, rows))
                text += decoder.decode(self.target.token_bytes.join(new))
                if stop and (cut := first_stop(text, max(0, shown - hold), stop)) is not None:
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
        self.last = result = Generation(text, out, stats, rounds, reason)
        done.append(result)
        with self._book:
            self._finish(mode, out, rounds, stats)
        if self.learner is not None and out:
            self.learner.observe(verified(prompt, out, rounds, rows), stats.acceptance_rate, stats.mean_accepted_length)

    def _finish(self, mode: str, out: list[int], rounds: list[RoundRecord], stats: GenerationStats) -> None:
        """A finished request's bookkeeping: the user's datastore, the mode chooser, the head."""
        if self.retriever is not None:
            self.retriever.finish(out)
        if self.modes is not None and len(rounds) > 1:  # decode-phase rate: the first round also prefills
            self.modes.observe(mode, len(out) - rounds[0].emitted, stats.seconds - rounds[0].seconds,
                               label=f"{self.drafter.name} -> {self.target.name}")
        if (row := self.lengths.end_request(self.learner)) is not None:
            self.metrics.append(row)

    def _rounds(self, prompt: str, rule: Any, max_new_tokens: int, generator: torch.Generator | None, alone: bool,
                special: bool, rows: list) -> Iterator[tuple[list[int], RoundRecord]]:
        prompt_ids = self.target.tokenizer(prompt, add_special_tokens=special)["input_ids"]
        tsession = self.target.begin(prompt_ids)
        try:
            if alone:  # the target decodes the whole request on its side: no draft at all
                yield from decode_alone(tsession, max_new_tokens)
                return
            dsession, index, last = self.open_drafts(prompt_ids, self.drafter.tokenizer(prompt, add_special_tokens=special)["input_ids"])
            topk = self.learner.config.topk if self.learner is not None else 0
            yield from self._loop(tsession, dsession, rule, max_new_tokens, generator, topk, last, index, rows)
        finally:
            if (close := getattr(tsession, "close", None)) is not None:
                close()  # a remote session frees its server-side KV cache now

    def open_drafts(self, prompt_ids: list[int], drafter_ids: list[int]) -> tuple[Any, ContextIndex | None, int]:
        """A request's drafting side: (drafter session, retrieval index, the drafter context's last
        token). With `propose_round` and `settle_round`, what llamacpp/hook.py's verifier needs."""
        with self._book:  # begin() also moves the shared acceptance history
            index = self.retriever.begin(prompt_ids) if self.retriever is not None and self.free_drafts else None
        if isinstance(self.drafter, Adaptable):  # a fake or an exported graph has no adapters
            self.drafter.activate(self.adapter)
        return self.drafter.begin(drafter_ids), index, drafter_ids[-1] if drafter_ids else -1

    def first_k(self) -> tuple[int, Stopper | None]:
        """A request's first draft length (0: no model draft) and the head's stopping rule."""
        with self._book:
            k, stopper = self.lengths.begin_request()
        return (k if self.model_drafts else 0), stopper

    def _loop(self, tsession: Any, dsession: Any, rule: Any, max_new_tokens: int, generator: torch.Generator | None,
              topk: int, last: int, index: ContextIndex | None, rows: list) -> Iterator[tuple[list[int], RoundRecord]]:
        """Algorithm 1's rounds: propose (retrieve, or draft and translate), verify, settle (re-sync
        the drafter, learn, observe costs and acceptance). `last`: the drafter context's last token,
        which token healing may let the next draft replace (translate/healing.py). `index`: the
        request's retrieval index (None: model drafts only). `rows`: the target's top-k rows, kept
        for distillation when `topk` > 0."""
        k, stopper = self.first_k()
        produced, first, previous, idle = 0, True, None, False  # idle: the last round did not draft
        deferral = self.retriever.deferral if index is not None else None  # the drafter's read, deferred
        rent = deferral.begin(len(tsession.ids)) if deferral is not None else NO_RENT
        while produced < max_new_tokens:
            t0 = time.perf_counter()
            if previous is not None:  # the round's whole wall time beyond drafting and verifying is overhead
                drafted, t_draft, verified, t_verify, started = previous
                with self._book:
                    self.cost.observe(drafted, t_draft, verified, t_verify, (t0 - started) - t_draft - t_verify)
            model, free = self.plan.at(self.target, len(tsession.ids))  # what can pay at this context
            defer = model and k > 0 and rent.defer(self.policy.last_rates if self.policy else {}, produced)
            room, ask = within_budget(tsession, max_new_tokens - produced - 1, k if model and not defer else 0)
            if room == 0 < max_new_tokens - produced - 1:  # the server takes no draft now: it decodes the rest
                yield from decode_alone(tsession, max_new_tokens - produced)
                return
            draft, proposal, used, q, t1 = self.propose_round(tsession, dsession, rule, index if free else None,
                                                              ask, stopper, last, room, generator)
            t2 = time.perf_counter()
            context = len(tsession.ids)
            verdict = tsession.verify(proposal.ids, rule, q, generator, topk=topk, **relaxation(self.config, rule, proposal))
            t3 = time.perf_counter()
            new = tsession.ids[context:]
            eos = next((i for i, t in enumerate(new) if t in self.target.eos_ids), None)
            if eos is not None:
                new = new[: eos + 1]
            if topk:
                rows.append((verdict.topk[0][: len(new)], verdict.topk[1][: len(new)]))
            retrieved_accepted = sum(1 for s in proposal.sources[: verdict.accepted] if s == Source.RETRIEVED)
            with self._book:
                last, k = self.settle_round(dsession, index, draft, proposal, used, new, verdict.accepted,
                                       retrieved_accepted, last, k, stopper)
                rent.settle(defer, len(new), None if first else t3 - t0, len(draft.ids), t1 - t0, self.cost.draft, produced)
            t4 = time.perf_counter()
            produced += len(new)
            # the first verification also prefills the prompt: not a verification cost. A round is observed
            # when the next starts, so its overhead includes the head's bookkeeping, the caller's handling of
            # the yielded tokens and all else between two rounds. A draft after rounds without one first
            # catches the drafter up on every token committed meanwhile: its time is not a drafting cost
            drafted = 0 if idle else len(draft.ids)
            previous = None if first else (drafted, t1 - t0, len(proposal) + 1, t3 - t2, t0)
            first, idle = False, not draft.ids
            yield new, RoundRecord(
                context=context, drafted=len(draft.ids), proposed=len(proposal), accepted=verdict.accepted,
                emitted=len(new), from_cache=sum(1 for s in proposal.sources[: verdict.accepted] if s == Source.NGRAM),
                t_draft=t1 - t0, t_translate=t2 - t1, t_verify=t3 - t2, t_resync=t4 - t3,
                retrieved=proposal.retrieved, retrieved_accepted=retrieved_accepted,
            )
            if new and new[-1] in self.target.eos_ids:
                return

    def propose_round(self, tsession: Any, dsession: Any, rule: Any, index: ContextIndex | None, k: int,
                 stopper: Stopper | None, last: int, room: int, generator: torch.Generator | None) -> tuple[Any, ...]:
        """This round's proposal in target ids, from retrieval or from a model draft (translated,
        and run on into a retrieved continuation), and the rows rejection sampling needs. Returns
        (draft, proposal, retrieval used, q rows, time the draft was done)."""
        translator, mode = self.translator, rule.mode
        only = {"exact": "direct", "omnidraft": "aligned"}.get(mode, "any")
        used = None
        if index is not None:
            with self._book:
                used = self.retriever.plan(index, self.cost, self.policy.last_rates if self.policy else {}, room, drafting=k > 0)
        table = self.drafter.token_bytes.table
        if used is not None:  # a retrieved draft: no drafter forward this round
            draft, t1 = NO_DRAFT, time.perf_counter()
            with self._book:
                proposal = translator.translate([], only=only).then(used.candidate.ids[: used.length])
        else:
            draft = NO_DRAFT if k == 0 else self._draft(dsession, rule, k, stopper, last,
                                                         tsession.ids[-1] if tsession.ids else None,
                                                         self._shared if mode == "exact" else None, generator)
            t1 = time.perf_counter()
            with self._book:
                proposal = translator.translate(draft.ids, only=only, skip=len(table[last]) if draft.healed else 0)
                proposal = proposal.cut(min(len(proposal), room))
                if index is not None:
                    proposal, used = self.retriever.extend(index, proposal, room)
        modeled = len(proposal) - proposal.retrieved  # proposed tokens that came from the model
        q = draft_rows(translator, proposal, modeled, draft) if only != "any" and len(proposal) else None
        return draft, proposal, used, q, t1

    def settle_round(self, dsession: Any, index: ContextIndex | None, draft: Any, proposal: Any, used: Any, new: list[int],
                accepted: int, retrieved_accepted: int, last: int, k: int, stopper: Stopper | None) -> tuple[int, int]:
        """After the verdict: the drafter keeps what matches the committed text and re-encodes the
        rest, the n-gram cache learns, the retrieval index and stats see the round, and the next
        draft length is chosen. Returns (the drafter context's last token, the next k)."""
        held = self.drafter.token_bytes.table[last] if draft.healed else b""  # committed bytes the draft starts with
        keep, tail = self.translator.resync(draft.ids, held + self.target.token_bytes.join(new))
        self.translator.learn(draft.ids[:keep] + tail, new, skip=len(held))
        dsession.commit(keep, tail)
        if index is not None:
            index.commit(new)
            self.retriever.observe(used, len(proposal), accepted)
        if self.model_drafts:
            modeled = len(proposal) - proposal.retrieved
            k = self.lengths.next(k, stopper, len(draft.ids), modeled, accepted - retrieved_accepted, keep)
        return (draft.ids[:keep] + tail or [last])[-1], k

    def _draft(self, dsession: Any, rule: Any, k: int, stopper: Stopper | None, last: int, committed: int | None,
               allowed: torch.Tensor | None, generator: torch.Generator | None) -> Any:
        """One draft: up to k tokens (k_max once the head decides), stopped by the head or, until it
        decides, by the drafter's confidence; healed when the target's last committed token
        `committed` lets a longer drafter token replace the drafter context's `last`."""
        k, stop_confidence, extra = self.lengths.for_draft(k, stopper)
        if self.healer is not None and committed is not None and rule.mode in ("greedy", "match"):  # where it is lossless
            heal = self.healer.candidates(last, self.target.token_bytes.table[committed])
            if heal is not None:
                extra["heal"] = heal
        return dsession.propose(k, temperature=rule.temperature, allowed=allowed, generator=generator,
                                stop_confidence=stop_confidence, **extra)


def pair(drafter: Any, target: Any, config: DecodeConfig | None = None, *, user: str | None = None,
         learn: bool = False, train: TrainConfig | None = None, adapter: AdapterConfig | None = None,
         store: ProfileStore | None = None, **overrides: Any) -> Pairing:
    """Pair `drafter` (any backend) with `target`; keyword overrides go into `DecodeConfig`.

    `user` loads (and `Pairing.save` writes) that user's profile for this target: n-gram cache,
    datastore of past outputs, LoRA adapter, metrics. `learn=True` distils every verified request
    into the pairing's adapter (see distill/trainer.py; `train` sets its knobs, `adapter` the LoRA
    shape); only a PyTorch drafter can learn. It may draft through a faster llama.cpp twin (backends.py)."""
    if config is not None and overrides:
        raise ValueError(f"pass a DecodeConfig or keyword overrides, not both (got {sorted(overrides)})")
    config = config or DecodeConfig(**overrides)
    return Pairing(drafting_twin(drafter, config, learn=learn, adapter=adapter, user=user), target, config, user=user,
                   learn=learn, train=train, adapter=adapter, store=store)
