"""The pieces of a pairing's requests that need no pairing: a request's checks, its chat rendering
and random generator, where a stop string cuts the text, the draft rows rejection sampling
verifies against, a target decoding alone, and a finished request as distillation input."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from ..target import Rule
from ..translate.translator import Proposal, Source, Translator
from .config import RELAXED
from .stats import GenerationStats, RoundRecord, round_record

if TYPE_CHECKING:
    from ..target import DecodingSession, Target, TargetSession

__all__ = [
    "Call",
    "Generation",
    "TokenLogprob",
    "check_logprobs",
    "check_request",
    "decode_alone",
    "draft_rows",
    "first_stop",
    "from_generation_config",
    "make_generator",
    "relaxation",
    "through_eos",
    "render_chat",
    "token_logprobs",
    "within_budget",
    "verified",
]


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one generated token (None where the target did not give
    it: a remote or vLLM target sampling a token outside its top rows) and its `top` alternatives
    {token id: log-prob}, from the target's own distribution (temperature 1, no filtering)."""

    token: int
    logprob: float | None
    top: dict[int, float]


@dataclass(frozen=True)
class Generation:
    """Result of `Pairing.generate`: the text, the target token ids generated, stats and rounds;
    with `logprobs=N` asked for, one TokenLogprob per generated token (else None)."""

    text: str
    token_ids: list[int]
    stats: GenerationStats
    rounds: list[RoundRecord]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Call:
    """One request as its rounds read it: the prompt (the tokenizers add their special tokens, BOS,
    when `special`; not to a rendered chat, which has them), the verification rule, the length, the
    random generator and how many log-probabilities a token the caller asked for; `after`: target
    ids already generated after the prompt (a cut request continued from its `Generation.token_ids`),
    which the target reads as they are and the drafter reads as their text, `after_text`."""

    prompt: str
    rule: Rule
    max_new_tokens: int
    generator: torch.Generator | None = None
    special: bool = True
    logprobs: int = 0
    after: tuple[int, ...] = ()
    after_text: str = ""

    def ids_for(self, model: Any) -> list[int]:
        """The prompt, and `after` as text, in the drafter `model`'s tokenizer."""
        text = self.prompt + self.after_text
        return list(model.tokenizer(text, add_special_tokens=self.special)["input_ids"])

    def target_ids(self, target: Target) -> list[int]:
        """The prompt in `target`'s tokenizer, then `after` exactly."""
        return list(target.tokenizer(self.prompt, add_special_tokens=self.special)["input_ids"]) + list(
            self.after
        )


def draft_rows(translator: Translator, proposal: Proposal, modeled: int, draft: Any) -> torch.Tensor | None:
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


def relaxation(config: Any, rule: Any, proposal: Proposal) -> dict[str, Any]:
    """The verify's keyword for relaxed-lossy verification (greedy requests only): which proposed
    tokens were retrieved, and the top-r they may be accepted within; empty otherwise."""
    if config.mode != RELAXED or rule.mode != "greedy" or not proposal.retrieved:
        return {}
    mask = torch.tensor([s == Source.RETRIEVED for s in proposal.sources], dtype=torch.bool)
    return {"relax": (mask, config.relaxed_top_r)}


def decode_alone(tsession: DecodingSession, max_new_tokens: int) -> Iterator[tuple[list[int], RoundRecord]]:
    """The target session decodes alone (greedy); one record per token, as one forward each."""
    context, last = len(tsession.ids), time.perf_counter()
    for token in tsession.decode(max_new_tokens):
        now = time.perf_counter()
        yield [token], round_record(None, context, [token], 0, now - last)
        context, last = context + 1, now


def through_eos(new: list[int], eos_ids: frozenset[int]) -> list[int]:
    """`new` up to and with its first end-of-generation token (all of it where none is)."""
    return new[: next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))]


def within_budget(tsession: TargetSession, limit: int, k: int) -> tuple[int, int]:
    """(limit, k) for this round's proposal, each capped by the draft budget the target session's
    server gave in its last reply (server/budget.py: a server under load takes fewer draft tokens)."""
    cap = tsession.budget
    return (limit, k) if cap is None else (min(limit, cap), min(k, cap))


def check_request(prompt: str, max_new_tokens: int, stop: str | Sequence[str]) -> tuple[str, ...]:
    """Refuse a malformed request, naming the field; returns the stop strings as a tuple (`stop`
    may be one string or a list or tuple of them, as OpenAI's API takes it)."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty string, got {prompt!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, (list, tuple)) else None
    if stops is None or any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return stops


MAX_NEW_TOKENS = 128  # a request's default length
# GenerationConfig fields a speculative pairing cannot reproduce exactly, at their neutral values
NEUTRAL = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "penalty_alpha": None,
    "bad_words_ids": None,
    "force_words_ids": None,
}


def from_generation_config(
    config: Any, target: Target, max_new_tokens: int, stop: str | Sequence[str]
) -> tuple[dict[str, Any], int, str | Sequence[str]]:
    """(sampling options, max_new_tokens, stop) of a request from a `transformers.GenerationConfig`,
    or from the target's own when `config` is "target": greedy unless `do_sample`, then its
    temperature, top_k, top_p and min_p as HF applies them; its `max_new_tokens` where the call left
    the default, its `stop_strings` where the call gave none. A field the pairing cannot reproduce
    exactly (beams, repetition penalties, ...) away from its neutral value is refused by name."""
    if isinstance(config, str) and config == "target":
        config = target.generation_config
        if config is None:
            raise ValueError(f"generation_config='target': {target.name} carries no generation_config")
    if not hasattr(config, "do_sample") or not hasattr(config, "to_dict"):
        raise TypeError(
            "generation_config must be a transformers.GenerationConfig or 'target', "
            f"got {type(config).__name__}"
        )
    for name, neutral in NEUTRAL.items():
        value = getattr(config, name, neutral)
        unset = not value if neutral is None else value in (neutral, None)
        if not unset:
            raise ValueError(
                f"generation_config.{name}={value!r} is not supported (a pairing decodes one sequence)"
            )
    sampling: dict[str, Any] = {"temperature": 0.0}
    if config.do_sample:
        sampling = {
            "temperature": config.temperature if config.temperature is not None else 1.0,
            "top_k": config.top_k or 0,
            "top_p": config.top_p if config.top_p is not None else 1.0,
            "min_p": config.min_p or 0.0,
        }
    if config.max_new_tokens is not None and max_new_tokens == MAX_NEW_TOKENS:
        max_new_tokens = config.max_new_tokens
    if not stop and getattr(config, "stop_strings", None):
        stop = config.stop_strings
    return sampling, max_new_tokens, stop


def first_stop(text: str, start: int, stop: tuple[str, ...]) -> int | None:
    """Where the earliest stop string found at or after `start` begins in `text`, or None."""
    hits = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(hits) if hits else None


def verified(prompt: str, out: list[int], rounds: list[RoundRecord], rows: list, width: int) -> Any:
    """A finished request as distillation input (committed tokens with the target's top `width` rows)."""
    from ..distill.buffer import VerifiedRequest

    ids, logp = (torch.cat([row[part] for row in rows])[: len(out), :width] for part in (0, 1))
    positions = [j + 1 for r in rounds for j in range(r.emitted)][: len(out)]
    return VerifiedRequest(prompt, out, ids, logp, positions)


def check_after(target: Target, after: Any) -> tuple[tuple[int, ...], str]:
    """(the ids, their text) of a request's `after` (target ids generated already: a list or
    tuple of ints in the target's vocabulary), refused by name otherwise."""
    if not isinstance(after, (list, tuple)) or any(
        isinstance(t, bool) or not isinstance(t, int) for t in after
    ):
        raise ValueError(
            f"after must be a list of target token ids (a Generation's token_ids), got {after!r:.80}"
        )
    vocab = len(target.token_bytes.table)
    if any(not 0 <= t < vocab for t in after):
        raise ValueError(f"after holds ids outside the target's vocabulary [0, {vocab})")
    return tuple(after), target.token_bytes.join(list(after)).decode("utf-8", errors="replace")


MAX_LOGPROBS = 20  # as OpenAI's API


def check_logprobs(logprobs: Any) -> int:
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}")
    return logprobs


def token_logprobs(out: list[int], rows: list, n: int) -> list[TokenLogprob]:
    """Per generated token: its log-prob and the top `n` alternatives, from the rounds' rows; a
    token no row covers (the target decoded it alone, a server's budget) gets None and {}."""
    found: list[TokenLogprob] = []
    for ids, logp, chosen in rows:
        for i in range(len(ids)):
            if len(found) == len(out):
                break
            top = dict(zip(ids[i, :n].tolist(), logp[i, :n].tolist()))
            token = out[len(found)]
            exact = float(chosen[i]) if chosen is not None else top.get(token)
            found.append(TokenLogprob(token, exact, top))
    return found + [TokenLogprob(t, None, {}) for t in out[len(found) :]]


def make_generator(seed: int | None, generator: torch.Generator | None) -> torch.Generator | None:
    if seed is None:
        return generator
    if generator is not None:
        raise ValueError("pass seed or generator, not both")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return torch.Generator().manual_seed(seed)


def render_chat(tokenizer: Any, messages: list[dict[str, str]], name: str) -> str:
    """`messages` in `tokenizer`'s chat template, ready for the assistant's turn (`name` for errors)."""
    if (
        not isinstance(messages, list)
        or not messages
        or any(
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{name}'s tokenizer has no chat template: use generate() with your own prompt")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def turn_end(tokenizer: Any) -> str | None:
    """The text `tokenizer`'s chat template closes an assistant's turn with ("<|im_end|>",
    "<|eot_id|>", "<end_of_turn>"), or None where it writes none: a chat answer ends there."""
    marker = "\u2063omnidraft-turn\u2063"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False
        )
    except Exception:  # a template that wants other roles or arguments: no end to read
        return None
    after = text.split(marker, 1)[1].split() if marker in text else []
    return after[0] if after else None


def chat_stops(target: Target, stop: str | Sequence[str]) -> str | Sequence[str]:
    """`stop`, and `target`'s chat template's end of an assistant turn where no EOS token writes it
    (a chat answer ends at its turn's end whatever the model's EOS)."""
    end = turn_end(target.tokenizer)
    if end is None or any(target.token_bytes.table[i] == end.encode() for i in target.eos_ids):
        return stop
    given = [stop] if isinstance(stop, str) else list(stop)
    return given if end in given else [*given, end]
