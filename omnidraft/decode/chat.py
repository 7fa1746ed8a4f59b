"""A chat request: messages rendered in the target's chat template, and the end of an assistant's
turn as a stop string where the model's EOS does not write it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from ..target import Target

__all__ = ["chat_stops", "render_chat", "turn_end"]


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
