"""The verification server's OpenAI surface for plain clients: `/v1/models`, `/v1/completions` and
`/v1/chat/completions` with temperature, top_p, top_k, seed, stop, max_tokens and streaming (SSE),
so one deployment serves devices that draft and clients that do not (the official `openai` client
included). The target decodes alone here: greedy at temperature 0, else lossless sampling from its
own (filtered) distribution, one token a step through the session's verify with no proposal, so
other sessions' verifies interleave. `logprobs` (completions) and `logprobs` / `top_logprobs`
(chat) return each generated token's log-prob and alternatives from the target's own
distribution. Errors take OpenAI's shape (`error_body`). Echo and prompt log-probabilities (and a
greedy, unstreamed completion's log-probabilities) stay with completions.py's scoring path (what
OpenAICompletionsTarget reads).
"""

from __future__ import annotations

import json
import time
import uuid
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator

from pydantic import BaseModel, ConfigDict, Field

from ..decode.generation import TokenLogprob
from ..wire import CompletionRequest, SamplingFields

if TYPE_CHECKING:
    from ..target import Target

__all__ = ["ChatRequest", "chat_prompt", "error_body", "models_reply", "respond"]

OPENAI_PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    role: str
    content: str
    name: str | None = None


class ChatRequest(SamplingFields):
    """The part of OpenAI's chat completion request this server implements."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=4096)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 256

    @property
    def top_logprob_count(self) -> int | None:
        """Alternatives per token the reply lists; None: no log-probabilities asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def models_reply(name: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": 0, "owned_by": "omnidraft"}],
    }


def chat_prompt(tokenizer: Any, request: ChatRequest, name: str) -> list[int]:
    """The conversation through the target's chat template, as token ids (its special tokens once);
    a ValueError names a target without a template."""
    from ..decode.chat import render_chat

    text = render_chat(tokenizer, [{"role": m.role, "content": m.content} for m in request.messages], name)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def respond(
    tokens: Iterator[int],
    request: CompletionRequest | ChatRequest,
    target: Target,
    prompt_tokens: int,
    logprobs: list[TokenLogprob] | None = None,
) -> Any:
    """The reply for `tokens` (the target's, as it decodes them): one JSON object, or the SSE chunks
    of a streamed reply. Text is cut before the first stop string. `logprobs`, filled as the tokens
    come (one `TokenLogprob` each), go into the reply in OpenAI's shape for the route."""
    chat = isinstance(request, ChatRequest)
    rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    pieces = _texts(tokens, target.tokenizer, stops, target.eos_ids)
    base = {"id": rid, "created": created, "model": request.model or target.name}
    as_ids = bool(getattr(request, "return_tokens_as_token_ids", False))
    shape = partial(_logprobs, logprobs, target.token_bytes, chat, as_ids) if logprobs is not None else None
    if request.stream:
        return _then_close(_sse(pieces, base, chat, shape), tokens)
    text, reason, count = "", "length", 0
    for piece, reason, count in pieces:
        text += piece
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    choice["logprobs"] = shape(0, count) if shape is not None else None
    return {
        **base,
        "object": "chat.completion" if chat else "text_completion",
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": count,
            "total_tokens": prompt_tokens + count,
        },
    }


def _logprobs(
    found: list[TokenLogprob], token_bytes: Any, chat: bool, as_ids: bool, start: int, end: int
) -> dict[str, Any]:
    """Tokens start..end's log-probabilities in OpenAI's shape: chat's `content` entries, or the
    completion's parallel lists."""
    from .completions import token_string

    entries = found[start:end]
    name = partial(token_string, token_bytes, as_ids=as_ids)
    if chat:
        return {
            "content": [
                {
                    "token": name(e.token),
                    "logprob": e.logprob,
                    "bytes": list(token_bytes.table[e.token] or b""),
                    "top_logprobs": [
                        {"token": name(t), "logprob": v, "bytes": list(token_bytes.table[t] or b"")}
                        for t, v in e.top.items()
                    ],
                }
                for e in entries
            ]
        }
    return {
        "tokens": [name(e.token) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{name(t): v for t, v in e.top.items()} for e in entries],
    }


def _texts(
    tokens: Iterator[int], tokenizer: Any, stops: list[str], eos_ids: frozenset[int]
) -> Iterator[tuple[str, str, int]]:
    """(new text, finish reason so far, tokens so far) as tokens arrive; holds back text a stop
    string may begin in, and ends at a stop string ("stop") or when the tokens end."""
    ids: list[int] = []
    shown, reason = 0, "length"
    hold = max(map(len, stops), default=1) - 1
    text = ""
    for token in tokens:
        ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        hit = min((i for i in (text.find(s, max(0, shown - hold)) for s in stops) if i >= 0), default=None)
        if hit is not None:
            yield text[shown:hit], "stop", len(ids)
            if hasattr(tokens, "close"):
                tokens.close()  # stops the decoding behind it
            return
        if token in eos_ids:
            reason = "stop"
        upto = len(text) - hold if not text.endswith("\ufffd") else shown
        if upto > shown:
            yield text[shown:upto], reason, len(ids)
            shown = upto
    yield text[shown:], reason, len(ids)


def _then_close(chunks: Iterator[bytes], source: Iterator[int]) -> Iterator[bytes]:
    """`chunks`, with `source` (the decoding behind them) closed as soon as they end or are closed:
    its clean-up (an engine request aborted) runs then, not whenever it is garbage-collected."""
    try:
        yield from chunks
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


def _sse(
    pieces: Iterator[tuple[str, str, int]],
    base: dict[str, Any],
    chat: bool,
    shape: Callable[[int, int], dict[str, Any]] | None,
) -> Iterator[bytes]:
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(doc: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(doc).encode() + b"\n\n"

    if chat:
        yield event(
            {
                **base,
                "object": kind,
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                ],
            }
        )
    reason, sent = "length", 0
    for piece, reason, count in pieces:
        if piece:
            body: dict[str, Any] = {"delta": {"content": piece}} if chat else {"text": piece}
            body["logprobs"] = shape(sent, count) if shape is not None else None
            sent = count
            yield event({**base, "object": kind, "choices": [{"index": 0, **body, "finish_reason": None}]})
    last: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
    last["logprobs"] = shape(sent, sent) if shape is not None else None
    yield event({**base, "object": kind, "choices": [{"index": 0, **last, "finish_reason": reason}]})
    yield b"data: [DONE]\n\n"
