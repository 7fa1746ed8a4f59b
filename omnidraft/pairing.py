"""A drafter paired with a target, as the user holds it: the request API (`generate`, `stream`,
`chat`: streaming, EOS, stop strings, `max_new_tokens`), the user's profile (adapter, learning,
metrics) and its saving. The speculation machinery it drives is a `Speculator`
(decode/speculator.py), with its own lock; the rounds are round_loop.py and engine_proposals.py, the
acceptance maths verify.py, the vocabulary work translate/.
"""

from __future__ import annotations

import codecs
import os
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence, overload

import torch

from .decode import engine_proposals, round_loop
from .decode.chat import chat_stops, render_chat
from .decode.config import K_START, RELAXED, DecodeConfig, warn_relaxed
from .decode.generation import Generation, token_logprobs, verified
from .decode.proposers import default_proposer
from .decode.request import (
    MAX_NEW_TOKENS,
    Request,
    check_after,
    check_logprobs,
    check_request,
    first_stop,
    from_generation_config,
    make_generator,
)
from .decode.speculator import Speculator, pair_fingerprint
from .decode.stats import GenerationStats, RoundRecord
from .distill.attach import attach_adapter, shared_adapter, shared_state
from .errors import TargetError
from .runtime.activity import REQUESTS
from .translate.tables import TABLES_KEPT, pair_tables

if TYPE_CHECKING:
    from .adaptive.acceptance_head import AcceptanceHead
    from .adaptive.policy import CostPolicy
    from .decode.contract import Proposer
    from .distill.adapters import AdapterConfig
    from .distill.learner import Learner
    from .distill.sharing import AdapterSharing
    from .distill.trainer import TrainConfig
    from .draft.interface import PairedDrafter
    from .store.profiles import ProfileStore
    from .target import Target

__all__ = ["K_START", "TABLES_KEPT", "DecodeConfig", "Generation", "Pairing", "pair", "pair_tables"]


class Pairing:
    """A drafter and a target with their translator (direct map + n-gram cache) and, per user, a
    profile: the n-gram cache, a LoRA adapter on the drafter and metrics (see profiles.py)."""

    def __init__(
        self,
        drafter: PairedDrafter,
        target: Target,
        config: DecodeConfig,
        *,
        user: str | None = None,
        learn: bool = False,
        train: TrainConfig | None = None,
        adapter: AdapterConfig | str | None = None,
        store: ProfileStore | None = None,
        proposer: Proposer | None = None,
        share: bool = False,
        share_every: int = 10,
    ) -> None:
        from .store.profiles import ProfileStore
        from .target import check_target

        check_target(target)
        self.drafter, self.target, self.config, self.user = drafter, target, config, user
        if config.mode == RELAXED:
            warn_relaxed(drafter, target)
        self.fingerprint = pair_fingerprint(drafter, target)
        self.store = store or ProfileStore()
        profile = (
            self.store.load(drafter.name, target.name, user, fingerprint=self.fingerprint) if user else None
        )
        self.metrics: list[dict[str, Any]] = list(profile.metrics) if profile else []
        self._steps0 = profile.steps if profile else 0
        saved = profile.tensors.get("adapter") if profile else None
        shared = shared_state(drafter, target.name, user, self.store, self.fingerprint) if learn else None
        self._adapter = attach_adapter(
            drafter, target.name, user, learn=learn, adapter=adapter, saved=saved, shared=shared
        )
        self.speculator = Speculator(
            drafter,
            target,
            config,
            proposer=default_proposer if proposer is None else lambda _: proposer,
            user=user,
            profile=profile,
            adapter=self._adapter,
            learn=learn,
        )
        baseline = shared_adapter(drafter, target.name, shared)
        self.learner = self._learner(train, baseline) if learn else None
        self.last: Generation | None = None
        self.sharing: AdapterSharing | None = None  # the adapter exchange with the target's server
        if share:
            from .distill.sharing import AdapterSharing

            self.sharing = AdapterSharing(self, every=share_every)

    def _learner(self, train: TrainConfig | None, baseline: str | None) -> Learner:
        """The online distillation into the pairing's adapter (`learn=True`)."""
        if self.adapter is None:
            raise ValueError(f"learn=True: {self.drafter.name} carries no adapter to learn into")
        from .distill import learner as learning
        from .distill.trainer import TrainConfig

        return learning.Learner(
            self.drafter,
            self.adapter,
            self.speculator.translator.map.t2d,
            self.target.token_bytes,
            train or TrainConfig(),
            start_step=self._steps0,
            baseline=baseline,
        )

    @property
    def adapter(self) -> str | None:
        """This pairing's adapter on its drafter (None: the base drafter); set, it also drafts."""
        return self._adapter

    @adapter.setter
    def adapter(self, name: str | None) -> None:
        self._adapter = self.speculator.adapter = name

    @property
    def learner(self) -> Learner | None:
        """The online distillation into this pairing's adapter (None without `learn=True`)."""
        return self.speculator.learner

    @learner.setter
    def learner(self, learner: Learner | None) -> None:
        self.speculator.learner = learner

    @property
    def policy(self) -> CostPolicy | None:
        """The cost policy that picks draft lengths (None with a fixed k, a head or hysteresis)."""
        return self.speculator.policy

    @property
    def head(self) -> AcceptanceHead | None:
        """The acceptance head (None without one)."""
        return self.speculator.head

    head_trainer = property(
        lambda self: self.speculator.lengths.trainer, doc="The head's trainer (None without one)."
    )
    head_ready = property(
        lambda self: self.speculator.lengths.head_ready, doc="Whether the head (not its fallback) decides."
    )

    @property
    def drafting(self) -> bool:
        """Whether any draft can pay here."""
        return self.speculator.drafting

    @property
    def speculating(self) -> bool:
        """Whether this pairing drafts: False once its measured costs say drafting cannot pay here."""
        return self.speculator.speculating

    @property
    def steps(self) -> int:
        """Optimizer steps this pairing's adapter has had, over every session of its profile."""
        return self._steps0 + (self.learner.steps if self.learner else 0)

    def save_adapter(self, directory: str | os.PathLike[str]) -> Path:
        """This pairing's LoRA adapter as a peft adapter directory (`PeftModel.from_pretrained` reads
        it; `pair(..., adapter=directory)` brings it back). Atomic."""
        from .distill.adapters import save_peft

        if self.adapter is None:
            raise ValueError("this pairing has no adapter: pair(target, learn=True) or adapter=DIR gives one")
        if self.learner is not None:
            self.learner.wait()
        with self.drafter.lock:
            return save_peft(self.drafter.trainable, self.adapter, directory, base=self.drafter.name)

    def save(self) -> Path:
        """Write this user's profile (adapter, head, n-gram cache, datastore, metrics) atomically."""
        from .store.profiles import pairing_profile

        if self.user is None:
            raise ValueError("this pairing has no user profile: pair(target, user=...) to save one")
        if self.learner is not None:
            self.learner.wait()
        return self.store.save(pairing_profile(self))

    @overload
    def generate(
        self,
        prompt: str,
        max_new_tokens: int = MAX_NEW_TOKENS,
        *,
        stop: str | Sequence[str] = (),
        seed: int | None = None,
        generator: torch.Generator | None = None,
        **sampling: Any,
    ) -> Generation: ...

    @overload
    def generate(
        self,
        prompt: list[str],
        max_new_tokens: int = MAX_NEW_TOKENS,
        *,
        stop: str | Sequence[str] = (),
        seed: int | None = None,
        generator: torch.Generator | None = None,
        **sampling: Any,
    ) -> list[Generation]: ...

    def generate(
        self,
        prompt: str | list[str],
        max_new_tokens: int = MAX_NEW_TOKENS,
        *,
        stop: str | Sequence[str] = (),
        seed: int | None = None,
        generator: torch.Generator | None = None,
        **sampling: Any,
    ) -> Generation | list[Generation]:
        """Decode `prompt` speculatively; greedy output equals the target's own greedy output. A list
        of prompts gives a list of Generations (decoded one after another). `sampling`: this call's
        `temperature`, `top_k`, `top_p`, `min_p` (DecodeConfig.request_rule), or a
        `generation_config` (a transformers.GenerationConfig, or "target" for the target's own;
        rounds.from_generation_config); sampling draws from `generator`, or from a fresh one seeded
        with `seed`. `logprobs=N` (up to 20) gives each token's log-prob and its top N alternatives
        (Generation.logprobs). `after=ids` continues a cut request from its `Generation.token_ids`
        (`TargetError.partial`): the target reads them as they are, the Generation holds what follows."""
        if isinstance(prompt, list):
            return [
                self.generate(p, max_new_tokens, stop=stop, seed=seed, generator=generator, **sampling)
                for p in prompt
            ]
        return self._whole(
            prompt, max_new_tokens, stop, make_generator(seed, generator), True, sampling, seed
        )

    def chat(
        self,
        messages: list[dict[str, str]],
        max_new_tokens: int = MAX_NEW_TOKENS,
        *,
        stop: str | Sequence[str] = (),
        seed: int | None = None,
        generator: torch.Generator | None = None,
        **sampling: Any,
    ) -> Generation:
        """Answer a conversation ([{"role": "user", "content": ...}, ...]) in the target's chat
        template, rendered once; the target reads it as rendered (no second BOS) and the drafter
        reads the same text."""
        text, rng = self.render_chat(messages), make_generator(seed, generator)
        return self._whole(text, max_new_tokens, chat_stops(self.target, stop), rng, False, sampling, seed)

    def _whole(
        self,
        text: str,
        limit: int,
        stop: str | Sequence[str],
        rng: torch.Generator | None,
        special: bool,
        sampling: dict[str, Any],
        seed: int | None,
    ) -> Generation:
        """One request run to its end: the finished Generation."""
        done: list[Generation] = []
        for _ in self._stream(text, limit, stop, rng, special, done, {**sampling, "seed": seed}):
            pass
        return done[0]

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The conversation as the target's chat template writes it, ready for the assistant's turn."""
        return render_chat(self.target.tokenizer, messages, self.target.name)

    def stream(
        self,
        prompt: str | list[dict[str, str]],
        max_new_tokens: int = MAX_NEW_TOKENS,
        *,
        stop: str | Sequence[str] = (),
        seed: int | None = None,
        generator: torch.Generator | None = None,
        **sampling: Any,
    ) -> Iterator[str]:
        """Yield text as it is committed; afterwards `self.last` holds the full `Generation` (with
        threads sharing the pairing, the last one any of them finished). `prompt` may be a
        conversation, streamed as `chat` answers it (the chat template rendered once, no second BOS)."""
        chat = isinstance(prompt, list)
        text = self.render_chat(prompt) if isinstance(prompt, list) else prompt
        stop = chat_stops(self.target, stop) if chat else stop
        rng = make_generator(seed, generator)
        return self._stream(text, max_new_tokens, stop, rng, not chat, [], {**sampling, "seed": seed})

    def _stream(
        self,
        prompt: str,
        max_new_tokens: int,
        stop: str | Sequence[str],
        generator: torch.Generator | None,
        special: bool,
        done: list[Generation],
        sampling: dict[str, Any],
    ) -> Iterator[str]:
        """`special`: the tokenizers add their special tokens (BOS) to `prompt`; False for text that
        has them already (a rendered chat). The finished Generation is appended to `done`."""
        if (given := sampling.pop("generation_config", None)) is not None:
            options, max_new_tokens, stop = from_generation_config(given, self.target, max_new_tokens, stop)
            sampling = {**options, **{k: v for k, v in sampling.items() if v is not None}}
        stop, logprobs, after = (
            check_request(prompt, max_new_tokens, stop),
            check_logprobs(sampling.pop("logprobs", 0)),
            check_after(self.target, sampling.pop("after", ())),
        )
        rule = self.config.request_rule(**sampling)
        started = time.perf_counter()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        hold = max(map(len, stop), default=1) - 1  # a stop string may begin in text not yet shown
        out: list[int] = []
        rounds: list[RoundRecord] = []
        rows: list[tuple] = []  # the target's top-k rows, for distillation and logprobs
        text, shown, reason = "", 0, "length"
        with self._serving() as learner:
            tts = learner.config.tts_every if learner is not None else 0
            try:
                served = self.speculator.serving(rule, logprobs)
                request = Request(prompt, rule, max_new_tokens, generator, special, logprobs, *after)
                for new, record in self._rounds(served, request, rows):
                    rounds.append(record)
                    out += new
                    if learner is not None and len(rounds) % tts == 0:
                        learner.within_request(verified(prompt, out, rounds, rows, learner.config.topk))
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
                stats = self._stats(served, rounds, len(out), time.perf_counter() - started)
                per_token = token_logprobs(out, rows, logprobs) if logprobs else None
                text += decoder.decode(b"", final=True)
                self.last = exc.partial = Generation(text, out, stats, rounds, "error", per_token)
                raise
        if reason != "stop":
            text += decoder.decode(b"", final=True)
        if len(text) > shown:
            yield text[shown:]
        stats = self._stats(served, rounds, len(out), time.perf_counter() - started)
        if (row := self.speculator.finish(served, out, rounds, stats)) is not None:
            self.metrics.append(row)
        if self.learner is not None and out:
            self.learner.observe(
                verified(prompt, out, rounds, rows, self.learner.config.topk),
                stats.acceptance_rate,
                stats.tau,
            )
            stats = replace(stats, adapter_steps=self.steps, adapter_note=self.learner.note())
            self.speculator.adapter = self.learner.drafting_adapter  # its own, or its baseline
            if self.sharing is not None:
                self.sharing.after_request()
        per_token = token_logprobs(out, rows, logprobs) if logprobs else None
        self.last = result = Generation(text, out, stats, rounds, reason, per_token)
        done.append(result)

    def _rounds(self, served: str, request: Request, rows: list) -> Iterator[tuple[list[int], RoundRecord]]:
        """A request's rounds, served as `served` says (`Speculator.serving`): each round's committed
        ids and its record; `rows` collects the target's top-k rows where a verify returns them."""
        if served == "engine":
            return engine_proposals.request_rounds(self.speculator, request, rows)
        if served == "alone":
            return round_loop.alone_rounds(self.speculator, request, rows)
        return round_loop.request_rounds(self.speculator, request, rows)

    @contextmanager
    def _serving(self) -> Iterator[Learner | None]:
        """One request, counted among the process's (runtime/activity.py: no learning beside it);
        yields the learner whose Test-Time Speculation steps it takes (undone as it ends) or None."""
        learning = self.learner
        tts = learning if learning is not None and learning.config.tts_every else None
        with REQUESTS.serving():
            if learning is not None:
                learning.pause()
            try:
                if tts is not None:
                    tts.begin_request()
                yield tts
            finally:
                if tts is not None:
                    tts.end_request()
                if learning is not None:
                    learning.resume()

    def _stats(
        self, served: str, rounds: list[RoundRecord], new_tokens: int, seconds: float
    ) -> GenerationStats:
        """A request's stats: how it was served and why, and (learning) the adapter's steps so far."""
        stats = GenerationStats.from_rounds(rounds, new_tokens, seconds)
        learner = self.learner
        return replace(
            stats,
            served=served,
            why=self.speculator.why(served, stats),
            adapter_steps=self.steps if learner is not None else None,
            adapter_note=learner.note() if learner is not None else "",
        )


def pair(
    drafter: PairedDrafter,
    target: Target,
    config: DecodeConfig | None = None,
    *,
    user: str | None = None,
    learn: bool = False,
    train: TrainConfig | None = None,
    adapter: AdapterConfig | None = None,
    store: ProfileStore | None = None,
    proposer: Proposer | None = None,
    share: bool = False,
    share_every: int = 10,
    **overrides: Any,
) -> Pairing:
    """Pair `drafter` (any backend) with `target`; keyword overrides go into `DecodeConfig`.

    `user` loads (and `Pairing.save` writes) that user's profile for this target: n-gram cache,
    datastore of past outputs, LoRA adapter, metrics. `learn=True` distils every verified request
    into the pairing's adapter (see distill/trainer.py; `train` sets its knobs, `adapter` the LoRA
    shape); only a PyTorch drafter can learn. It may draft through a faster llama.cpp copy of itself
    (backends.py). `proposer`: where each round's proposal comes from, in place of the drafter's
    model drafts and retrieved ones (decode/contract.py; docs/architecture.md has the recipe).
    `share=True` (with `learn=True`, for a `RemoteTarget` whose server runs `--share-adapters`)
    averages the adapter with the other devices' through the server, every `share_every` requests
    learned from; only the adapter's tensors leave the device (distill/sharing.py)."""
    from .runtime.backends import drafting_copy

    if config is not None and overrides:
        raise ValueError(f"pass a DecodeConfig or keyword overrides, not both (got {sorted(overrides)})")
    config = config or DecodeConfig(**overrides)
    return Pairing(
        drafting_copy(drafter, config, learn=learn, adapter=adapter, user=user),
        target,
        config,
        user=user,
        learn=learn,
        train=train,
        adapter=adapter,
        store=store,
        proposer=proposer,
        share=share,
        share_every=share_every,
    )
