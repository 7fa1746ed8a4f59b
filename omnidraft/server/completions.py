"""The server's side of OpenAI's `/v1/completions`: `complete`, one greedy completion with echo and
log-probabilities on a target that scores positions (the request models are in wire.py). The
routes are server/text_routes.py and server/openai_api.py; the client of such an endpoint is
`OpenAICompletionsTarget` (targets/openai_client.py)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, cast

import torch

from ..errors import Cancelled

if TYPE_CHECKING:
    from ..target import ChunkedSession, ScoringSession, Target
    from ..wire import CompletionRequest

__all__ = ["ECHO_CHUNK", "MAX_PROMPT_CHARS", "Cancelled", "complete", "token_string"]


def token_string(token_bytes: Any, token: int, as_ids: bool) -> str:
    """How a token is named in a reply: "token_id:N", its text, or "bytes:\\xNN" for a UTF-8 fragment."""
    if as_ids:
        return f"token_id:{token}"
    data = token_bytes.table[token] or b""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


ECHO_CHUNK = 64  # prompt positions scored per forward when echoing: bounds a request's logits memory
MAX_PROMPT_CHARS = 1 << 19  # a text prompt longer than this is refused before it is tokenized


def complete(
    target: Target,
    request: CompletionRequest,
    max_tokens_total: int,
    *,
    max_prompt: int = 32_768,
    context: int | None = None,
    lock: Any = None,
    cancel: Any = None,
) -> dict[str, Any]:
    """Run one greedy completion on `target` (one that `scores_positions`) and shape the OpenAI reply.

    Memory is bounded whatever the request: an echoed prompt is scored ECHO_CHUNK positions per
    forward, and every row of logits is reduced at once to the token's log-probability and its
    top-k, so at most ECHO_CHUNK rows of the vocabulary are alive. `lock` (the server's model lock)
    is held per forward only, so other sessions' verifies interleave with a long completion."""
    ids = _prompt_ids(target, request, max_tokens_total, max_prompt, context)
    k, lock = request.logprobs, lock or contextlib.nullcontext()
    session = cast("ScoringSession", target.begin(ids[:1] if request.echo else ids))  # (scores_positions)
    scored, last = _read_prompt(target, session, ids, request, lock)
    generated = []
    for step in range(request.max_tokens):
        token = int(last.argmax())
        generated.append(token)
        scored.append(_score(last, token, k))
        if token in target.eos_ids or step == request.max_tokens - 1:
            break
        if cancel is not None and cancel.is_set():
            raise Cancelled("the client went away")
        with lock:
            last = session.scores([token], 1).float()[-1]
    return {
        "object": "text_completion",
        "model": request.model or target.name,
        "choices": [_choice(target, request, ids, generated, scored)],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": len(generated)},
    }


def _prompt_ids(
    target: Target, request: CompletionRequest, max_tokens_total: int, max_prompt: int, context: int | None
) -> list[int]:
    """The request's prompt as target ids, refused (ValueError, naming the limit) where this
    endpoint cannot serve it."""
    if request.stream:
        raise ValueError("stream=true is not supported by this endpoint")
    if request.temperature != 0:
        raise ValueError("only greedy completions (temperature 0) are served on this endpoint")
    if isinstance(request.prompt, str) and len(request.prompt) > MAX_PROMPT_CHARS:
        raise ValueError(
            f"a text prompt may have at most {MAX_PROMPT_CHARS} characters, got {len(request.prompt)}"
        )
    ids = (
        list(request.prompt)
        if isinstance(request.prompt, list)
        else target.tokenizer(request.prompt)["input_ids"]
    )
    vocab = len(target.token_bytes)
    if not ids or any(not 0 <= i < vocab for i in ids):
        raise ValueError(f"prompt must be a non-empty list of token ids in [0, {vocab})")
    if len(ids) > max_prompt:
        raise ValueError(f"the prompt has {len(ids)} tokens; this server takes at most {max_prompt}")
    if len(ids) + request.max_tokens > max_tokens_total:
        raise ValueError(f"prompt plus max_tokens exceeds this server's limit of {max_tokens_total} tokens")
    if context is not None and len(ids) + request.max_tokens > context:
        raise ValueError(
            f"prompt plus max_tokens ({len(ids) + request.max_tokens}) is past the target's context of "
            f"{context}"
        )
    return ids


def _read_prompt(
    target: Target, session: ScoringSession, ids: list[int], request: CompletionRequest, lock: Any
) -> tuple:
    """(the prompt's scored positions, the last position's logits): with `echo`, position i's row
    scores token i + 1, fed ECHO_CHUNK at a time and each row reduced at once; without, a long
    prompt is read a chunk at a time where the engine prefills in chunks."""
    k = request.logprobs
    scored: list[tuple[float, torch.Tensor, torch.Tensor] | None] = [None] if request.echo else []
    if request.echo:
        for start in range(0, len(ids), ECHO_CHUNK):
            chunk = ids[start : start + ECHO_CHUNK]
            with lock:
                rows = session.scores(chunk[1:] if start == 0 else chunk, len(chunk)).float()
            last = rows[-1]
            scored += [
                _score(rows[j], ids[start + j + 1], k) for j in range(len(rows)) if start + j + 1 < len(ids)
            ]
        return scored, last
    while target.capabilities.prefills_in_chunks:  # a long prompt holds the model a chunk at a time
        with lock:
            if cast("ChunkedSession", session).prefill(ECHO_CHUNK) == 0:
                break
    with lock:
        return scored, session.scores([], 1).float()[-1]


def _choice(
    target: Target, request: CompletionRequest, ids: list[int], generated: list[int], scored: list
) -> dict[str, Any]:
    """The reply's one choice: the text (the prompt too with `echo`) and, if asked, log-probabilities."""
    shown = (ids if request.echo else []) + generated
    choice: dict[str, Any] = {
        "index": 0,
        "text": target.tokenizer.decode(shown),
        "finish_reason": "stop" if generated and generated[-1] in target.eos_ids else "length",
    }
    k = request.logprobs
    if k is not None:
        name = lambda t: token_string(target.token_bytes, t, request.return_tokens_as_token_ids)  # noqa: E731
        choice["logprobs"] = {
            "tokens": [name(t) for t in shown],
            "token_logprobs": [None if p is None else p[0] for p in scored],
            "top_logprobs": [
                None if p is None or k == 0 else {name(int(i)): float(v) for v, i in zip(p[1], p[2])}
                for p in scored
            ],
        }
    return choice


def _score(row: torch.Tensor, token: int, k: int | None) -> tuple[float, torch.Tensor, torch.Tensor]:
    """row (V,) logits -> (log p(token), top-k log-probs (k,), their ids (k,))."""
    logp = torch.log_softmax(row, -1)
    top = logp.topk(k) if k else (logp[:0], torch.zeros(0, dtype=torch.long))
    return float(logp[token]), top[0], top[1]
