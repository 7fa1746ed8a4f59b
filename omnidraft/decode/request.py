"""A request as the caller asks it (`Request`: one generate, stream or chat call, as its rounds
read it) and the checks of what it asks: the prompt, length and stop strings, a
`transformers.GenerationConfig`, ids already generated, log-probabilities, the seed; and where a
stop string cuts the text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from ..target import Rule, Target

__all__ = [
    "MAX_LOGPROBS",
    "MAX_NEW_TOKENS",
    "Request",
    "check_after",
    "check_logprobs",
    "check_request",
    "first_stop",
    "from_generation_config",
    "make_generator",
]


@dataclass(frozen=True)
class Request:
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


MAX_NEW_TOKENS = 128  # a request's default length


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


def make_generator(seed: int | None, generator: torch.Generator | None) -> torch.Generator | None:
    if seed is None:
        return generator
    if generator is not None:
        raise ValueError("pass seed or generator, not both")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return torch.Generator().manual_seed(seed)


def first_stop(text: str, start: int, stop: tuple[str, ...]) -> int | None:
    """Where the earliest stop string found at or after `start` begins in `text`, or None."""
    hits = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(hits) if hits else None
