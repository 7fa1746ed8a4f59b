"""The server's stateless text routes (the OpenAI-compatible ones, server/openai_api.py): a whole
completion, or the target alone sampling a prompt; mixed into `Service`."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, cast

import torch

from ..target import Rule
from ..wire import MAX_PROMPT
from .config import HTTPError, ServerConfig
from .metrics import Metrics
from .sessions import Session, release_session

if TYPE_CHECKING:
    from ..target import Target

__all__ = ["TextRoutes"]


class TextRoutes:
    """`complete` and `sample`, over the state and checks `Service` provides."""

    target: Target
    config: ServerConfig
    metrics: Metrics
    batches: bool
    context: int | None  # None: unbounded
    model_lock: Any
    _hold: Callable[[int, int], Callable[[], None]]
    _check_context: Callable[[int, str], None]
    _check_ids: Callable[[Any, str], None]
    _engine_decode: Callable[..., Iterator[int]]
    _stepwise: Callable[..., Iterator[int]]

    def complete(self, request: Any, key: int = 0, cancel: threading.Event | None = None) -> dict[str, Any]:
        """The OpenAI-compatible /v1/completions (greedy, stateless; see server/completions.py)."""
        from .completions import MAX_PROMPT_CHARS, complete

        if not self.target.capabilities.scores_positions:
            raise HTTPError(
                400,
                f"/v1/completions with echo or log-probabilities is not served on {self.target.name}'s "
                "engine (its sessions return no rows of logits): use /v1/generate, or the engine's own "
                "OpenAI server",
            )
        if isinstance(request.prompt, str):  # reserved by its tokens, not its characters
            if len(request.prompt) > MAX_PROMPT_CHARS:
                raise HTTPError(422, f"a text prompt may have at most {MAX_PROMPT_CHARS} characters")
            prompt_tokens = len(self.target.tokenizer(request.prompt)["input_ids"])
        else:
            prompt_tokens = len(request.prompt)
        budget = min(prompt_tokens, MAX_PROMPT) + request.max_tokens
        self._check_context(budget, "the completion")
        release = self._hold(budget, key)
        started = time.perf_counter()
        try:
            reply = complete(
                self.target,
                request,
                self.config.max_tokens,
                max_prompt=MAX_PROMPT,
                context=self.context,
                lock=self.model_lock,
                cancel=cancel,
            )
        except ValueError as exc:
            raise HTTPError(422, str(exc)) from None
        finally:
            release()
        self.metrics.observe(time.perf_counter() - started)
        self.metrics.rounds += 1
        return reply

    def sample(
        self,
        ids: list[int],
        rule: Rule,
        max_tokens: int,
        seed: int | None,
        key: int = 0,
        cancel: threading.Event | None = None,
        logprobs: list | None = None,
        top: int = 0,
    ) -> Iterator[int]:
        """The target alone on `ids` (the OpenAI routes): up to `max_tokens` tokens under `rule`,
        one step at a time (other sessions' verifies interleave), stopping after an EOS; the KV
        budget is held while it runs. Checked now, decoded as the iterator is read; `cancel` set
        (the client went away) stops it at its next token with `Cancelled`. With `logprobs` (a
        list), each token's `TokenLogprob` (its `top` alternatives) is appended as it comes."""
        from .completions import Cancelled

        self._check_ids(ids, "prompt")
        budget = len(ids) + max_tokens
        self._check_context(budget, "the completion")
        if max_tokens <= 0:  # OpenAI's max_tokens 0: nothing to decode (an engine refuses a request of 0)
            return iter(())
        in_engine = self.batches and logprobs is None  # the engine's own loop: greedy or sampled in its step
        if not in_engine:
            try:
                self.target.check_rule(rule)
            except ValueError as exc:
                raise HTTPError(422, str(exc)) from None
        release = self._hold(budget, key)
        session = Session(self.target.begin(list(ids)), time.monotonic(), key)
        generator = torch.Generator().manual_seed(
            seed if seed is not None else int(torch.randint(0, 2**62, (1,)))
        )

        def tokens() -> Iterator[int]:
            try:
                if in_engine:
                    seeded = rule if rule.mode == "greedy" or seed is None else replace(rule, seed=seed)
                    steps = self._engine_decode(session, max_tokens, seeded)
                else:
                    steps = self._stepwise(session, max_tokens, rule, generator, logprobs, top)
                with contextlib.closing(cast(Generator[int, None, None], steps)):  # aborts an engine request
                    for token in steps:
                        yield token
                        if token in self.target.eos_ids:
                            return
                        if cancel is not None and cancel.is_set():
                            raise Cancelled("the client went away")
            finally:
                release()
                release_session(session)

        return tokens()
