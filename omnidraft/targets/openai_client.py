"""Greedy verification through an OpenAI-compatible `/v1/completions` endpoint that returns prompt
log-probabilities (`echo` with `logprobs`: vLLM, `omnidraft serve`; not llama.cpp's `llama-server`
nor OpenAI's API, which refuse or ignore it), for targets already running on a serving engine.

One verify is one stateless completion request: the prompt is the committed ids plus the proposal
(token ids, not text), `echo` returns the prompt's own log-probabilities, `logprobs` the top
alternatives at every position, and `max_tokens=1` the token after the whole proposal. Position
base + j's top-1 alternative is the target's greedy choice for proposal token j: the accepted prefix
is where they agree, the correction is the first disagreement's top-1, and if all agree the
generated token is the bonus. Sampling modes need the target's full distributions, which these
endpoints do not return: only greedy verification is offered (a clear error otherwise).

Tokens come back as strings. Ask for `return_tokens_as_token_ids` (vLLM: "token_id:123"); servers
that ignore it return text, mapped back to ids through the tokenizer's byte view (ambiguous text is
refused with an error naming the option). The whole sequence is re-sent every round and
scored again: engines do not serve prompt log-probabilities from their prefix cache (vLLM
bypasses it for such requests; llama.cpp's server does not return prompt log-probabilities), so a
round costs O(context) there, and our own server recomputes it too. Prefer `RemoteTarget`, whose
sessions keep the KV cache; see docs/remote.md.
"""

from __future__ import annotations

from typing import Any

import torch

from ..decode.verify import Verdict
from ..errors import IncompatibleError, RemoteRequestError
from ..optional import require
from ..target import SessionBase, TargetBase
from ..translate.codec import ByteCodec
from ..translate.token_bytes import build_token_bytes
from ..wire import MAX_LOGPROBS, CompletionRequest
from .remote_http import call_json

__all__ = ["OpenAICompletionsTarget"]

PROBE_TEXT = "def f(x):\n    return x + 1  # caf\u00e9"


class OpenAICompletionsTarget(TargetBase):
    """A greedy-verifying `Target` over any OpenAI-compatible /v1/completions endpoint.

    `tokenizer` is the served model's tokenizer (these servers do not ship it); `model` the name the
    server knows the model by; `topk` the most alternatives it returns per position (OpenAI: 5,
    vLLM: 20) for the distillation signal. `probe` (default): one scoring request at construction
    checks that the server can verify at all, with this tokenizer (`probe()`).
    """

    def __init__(
        self,
        url: str,
        *,
        model: str,
        tokenizer: Any,
        api_key: str | None = None,
        vocab_size: int | None = None,
        eos_ids: set[int] | None = None,
        timeout: float = 60.0,
        retries: int = 2,
        topk: int = 5,
        client: Any = None,
        name: str | None = None,
        probe: bool = True,
    ) -> None:
        if not 1 <= topk <= MAX_LOGPROBS:
            raise ValueError(f"topk must be in [1, {MAX_LOGPROBS}], got {topk}")
        self.url, self.model, self.retries, self.topk = url, model, retries, topk
        self.http = (
            client
            if client is not None
            else require("httpx", "OpenAICompletionsTarget").Client(base_url=url, timeout=timeout)
        )
        if api_key:
            self.http.headers.update({"authorization": f"Bearer {api_key}"})
        self.tokenizer, self.name = tokenizer, name or model
        self.token_bytes = build_token_bytes(tokenizer, vocab_size)
        self.codec = ByteCodec(tokenizer, self.token_bytes)
        eos = eos_ids if eos_ids is not None else {tokenizer.eos_token_id}
        self.eos_ids = frozenset(i for i in eos if isinstance(i, int))
        if probe:
            self.probe()

    def score(self, ids: list[int], k: int) -> tuple[list[Any], list[str]]:
        """One scoring request: (top-k alternatives per position, the echoed token names) for the
        prompt `ids` and one generated token after it."""
        body = CompletionRequest(
            model=self.model,
            prompt=ids,
            max_tokens=1,
            echo=True,
            logprobs=k,
            temperature=0.0,
            return_tokens_as_token_ids=True,
        )
        reply = call_json(
            self.http, self.url, "POST", "/v1/completions", body.model_dump_json(), self.retries
        )
        try:
            top = reply["choices"][0]["logprobs"]["top_logprobs"]
            tokens = reply["choices"][0]["logprobs"]["tokens"]
        except (KeyError, IndexError, TypeError) as exc:
            raise RemoteRequestError(
                f"{self.url}/v1/completions reply lacks echoed logprobs ({exc!r})"
            ) from None
        if (
            not isinstance(top, list)
            or not isinstance(tokens, list)
            or len(top) < len(ids) + 1
            or len(tokens) < len(ids) + 1
        ):
            raise RemoteRequestError(
                f"{self.url}/v1/completions echoed {len(tokens or [])} tokens with "
                f"{len(top or [])} log-probability rows, expected {len(ids) + 1} of each"
            )
        return top, tokens

    def probe(self) -> None:
        """Check once that the server scores a prompt of token ids as verification needs, with this
        tokenizer: IncompatibleError naming what is missing otherwise (docs/llamacpp.md)."""
        ids = self.tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        try:
            top, tokens = self.score(ids, 1)
        except RemoteRequestError as exc:
            raise IncompatibleError(
                f"{self.url} cannot verify drafts: a completion of token ids with echo and logprobs (the "
                "prompt's own "
                f"log-probabilities) failed: {exc}. Servers that do not return prompt log-probabilities "
                "(llama.cpp's "
                "llama-server, OpenAI's API) cannot be targets; use `omnidraft serve` in front of the model "
                "(docs/llamacpp.md#support-matrix)"
            ) from None
        if any(row is None or not row for row in top[1 : len(ids) + 1]):
            raise IncompatibleError(
                f"{self.url} echoed the prompt without log-probability rows: it cannot verify drafts"
            )
        try:
            echoed = [self.token_id(name) for name in tokens[: len(ids)]]
        except RemoteRequestError as exc:
            raise IncompatibleError(
                f"{self.url} names tokens this tokenizer does not have ({exc}); pass the served "
                "model's tokenizer"
            ) from None
        if echoed != ids:
            raise IncompatibleError(
                f"{self.url} echoed other token ids than it was sent ({echoed[:8]}... vs {ids[:8]}...): "
                "the server re-tokenized the prompt or serves another vocabulary"
            )

    def begin(self, prompt_ids: list[int]) -> _CompletionSession:
        if not prompt_ids:
            raise ValueError("the prompt must have at least one token")
        return _CompletionSession(self, list(prompt_ids))

    def token_id(self, name: str) -> int:
        """The id a reply's token string names."""
        if name.startswith("token_id:"):
            return int(name[9:])
        data = (
            bytes.fromhex(name[6:].replace("\\x", "")) if name.startswith("bytes:") else name.encode("utf-8")
        )
        token = self.token_bytes.id_of(data)
        if token is None:
            raise RemoteRequestError(
                f"{self.url} named a token {name!r} that is no single token of this tokenizer; "
                "serve with return_tokens_as_token_ids support (vLLM) or check the tokenizer"
            )
        return token

    def close(self) -> None:
        self.http.close()

    def __repr__(self) -> str:
        return f"OpenAICompletionsTarget({self.model!r} at {self.url})"


class _CompletionSession(SessionBase):
    def __init__(self, owner: OpenAICompletionsTarget, ids: list[int]) -> None:
        self.owner, self.ids = owner, ids
        self.forwards = 0

    def verify(
        self,
        proposal: torch.Tensor,
        rule: Any,
        q: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        *,
        topk: int = 0,
    ) -> Verdict:
        if rule.mode != "greedy":
            raise ValueError(
                f"an OpenAI-compatible target verifies greedy drafts only, not mode {rule.mode!r}"
            )
        o, base, draft = self.owner, len(self.ids), [int(t) for t in proposal.tolist()]
        top, tokens = o.score(self.ids + draft, max(1, min(topk, o.topk)))
        rows = [{o.token_id(name): lp for name, lp in top[base + j].items()} for j in range(len(draft) + 1)]
        best = [max(row, key=row.__getitem__) for row in rows]
        accepted = next((j for j, t in enumerate(draft) if best[j] != t), len(draft))
        token = best[accepted] if accepted < len(draft) else o.token_id(tokens[base + len(draft)])
        self.ids += draft[:accepted] + [token]
        self.forwards += 1
        top_rows = None
        if topk > 0:
            kept = rows[: accepted + 1]
            width = min(len(r) for r in kept)
            ids = [sorted(r, key=r.__getitem__, reverse=True)[:width] for r in kept]
            top_rows = (
                torch.tensor(ids, dtype=torch.long),
                torch.tensor([[r[t] for t in row] for r, row in zip(kept, ids)]),
            )
        return Verdict(accepted, token, top_rows)
