"""A drafter paired with a target, and OmniDraft's Algorithm 1 loop: draft, translate, verify,
re-sync, learn. Streaming, EOS, stop strings and `max_new_tokens` live here; the acceptance maths
live in verify.py and the vocabulary work in translate/.
"""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from .adaptive.policy import Hysteresis
from .stats import GenerationStats, RoundRecord
from .target import Rule
from .translate.ngram_cache import NgramCache, NgramCacheConfig
from .translate.translator import Source, Translator
from .translate.vocab_map import build_vocab_map

if TYPE_CHECKING:
    from .drafter import Drafter
    from .target import Target

__all__ = ["DecodeConfig", "Generation", "Pairing"]


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """How a pairing decodes. `k`: drafter tokens per round. `mode`/`temperature`: see verify.py.
    `strategy`: draft-to-target translation ("text" or "ngram", see translator.py).
    `stop_confidence`: end a draft early after a token the drafter gives less probability than this.
    `adaptive`: a Hysteresis policy that moves the draft length (starting at k) with acceptance;
    None keeps k fixed."""

    k: int = 6
    mode: str = "greedy"
    temperature: float = 0.0
    strategy: str = "text"
    stop_confidence: float = 0.3
    adaptive: Hysteresis | None = None
    ngram: NgramCacheConfig = field(default_factory=NgramCacheConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"draft length k must be an integer >= 1, got {self.k!r}")
        if self.strategy not in ("text", "ngram"):
            raise ValueError(f"translation strategy must be 'text' or 'ngram', got {self.strategy!r}")
        if not 0.0 <= self.stop_confidence < 1.0:
            raise ValueError(f"stop_confidence must be in [0, 1), got {self.stop_confidence}")
        Rule(mode=self.mode, temperature=self.temperature)  # validates mode and temperature

    @property
    def rule(self) -> Rule:
        return Rule(mode=self.mode, temperature=self.temperature)


@dataclass(frozen=True)
class Generation:
    """Result of `Pairing.generate`: the text, the target token ids generated, stats and rounds."""

    text: str
    token_ids: list[int]
    stats: GenerationStats
    rounds: list[RoundRecord]
    finish_reason: str


class Pairing:
    """A drafter and a target with their translator (direct map + n-gram cache)."""

    def __init__(self, drafter: Drafter, target: Target, config: DecodeConfig) -> None:
        self.drafter, self.target, self.config = drafter, target, config
        vmap = build_vocab_map(drafter.token_bytes, target.token_bytes, drafter.tokenizer, target.tokenizer)
        fingerprint = f"{drafter.token_bytes.fingerprint}:{target.token_bytes.fingerprint}"
        self.translator = Translator(drafter.codec, target.codec, vmap, NgramCache(config.ngram, fingerprint=fingerprint),
                                     strategy=config.strategy)
        self._shared = vmap.d2t >= 0
        self.last: Generation | None = None

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
        for new, record in self._rounds(prompt, max_new_tokens, generator):
            rounds.append(record)
            out += new
            text += decoder.decode(self.target.token_bytes.join(new))
            if stop and (cut := _first_stop(text, max(0, shown - hold), stop)) is not None:
                text, reason = text[:cut], "stop"
                break
            if out[-1:] and out[-1] in self.target.eos_ids:
                reason = "eos"
            if len(text) - hold > shown:
                yield text[shown : len(text) - hold]
                shown = len(text) - hold
        if reason != "stop":
            text += decoder.decode(b"", final=True)
        if len(text) > shown:
            yield text[shown:]
        stats = GenerationStats.from_rounds(rounds, len(out), time.perf_counter() - started)
        self.last = Generation(text, out, stats, rounds, reason)

    def _rounds(self, prompt: str, max_new_tokens: int,
                generator: torch.Generator | None) -> Iterator[tuple[list[int], RoundRecord]]:
        target, translator, rule = self.target, self.translator, self.config.rule
        tsession = target.begin(target.tokenizer(prompt)["input_ids"])
        dsession = self.drafter.begin(self.drafter.tokenizer(prompt)["input_ids"])
        only = {"exact": "direct", "omnidraft": "aligned"}.get(rule.mode, "any")
        aligned = only != "any"
        allowed = self._shared if rule.mode == "exact" else None
        produced, k = 0, self.config.k
        while produced < max_new_tokens:
            t0 = time.perf_counter()
            draft = dsession.propose(k, temperature=rule.temperature, allowed=allowed, generator=generator,
                                     stop_confidence=self.config.stop_confidence)
            t1 = time.perf_counter()
            proposal = translator.translate(draft.ids, only=only)
            proposal = proposal.cut(min(len(proposal), max_new_tokens - produced - 1))
            q = translator.draft_probs(proposal, draft.ids, draft.q) if aligned and draft.q is not None else None
            t2 = time.perf_counter()
            context = len(tsession.ids)
            verdict = tsession.verify(proposal.ids, rule, q, generator)
            t3 = time.perf_counter()
            new = tsession.ids[context:]
            eos = next((i for i, t in enumerate(new) if t in target.eos_ids), None)
            if eos is not None:
                new = new[: eos + 1]
            committed = target.token_bytes.join(new)
            keep, tail = translator.resync(draft.ids, committed)
            dsession.commit(keep, tail)
            translator.learn(draft.ids[:keep] + tail, new)
            t4 = time.perf_counter()
            produced += len(new)
            if self.config.adaptive is not None:
                k = self.config.adaptive.next_k(k, len(proposal), verdict.accepted)
            yield new, RoundRecord(
                context=context, drafted=len(draft.ids), proposed=len(proposal), accepted=verdict.accepted,
                emitted=len(new), from_cache=sum(1 for s in proposal.sources[: verdict.accepted] if s == Source.NGRAM),
                t_draft=t1 - t0, t_translate=t2 - t1, t_verify=t3 - t2, t_resync=t4 - t3,
            )
            if new and new[-1] in target.eos_ids:
                return


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
