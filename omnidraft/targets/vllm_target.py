"""`VLLMTarget`: a target served by vLLM's engine in this process, verifying from its prefix cache.

    target = od.VLLMTarget.load("qwen2.5-coder-0.5b", dtype="float32")
    pair = od.Drafter.load("smollm2-135m").pair(target)

A verify is one engine request: the session's committed ids plus the proposal, `max_tokens=1`.
The prefix cache serves the context, so only the uncached tail is computed; the request returns
prompt log-probabilities for the positions it computed and the bonus token's. Positions served
from the cache carry no valid log-probabilities, so only rows at or past `num_cached_tokens` are
read (`tail_rows`); when the cache covered a row the verify needs (another request computed the
same block), the request is repeated without reading the cache. Every session salts its blocks
(`cache_salt`): with its own salt, or on a server with its API key's (`share_prefix_cache`), so
one key's sessions reuse a shared prompt prefix and two keys never share a page or its timing.

Greedy verification is lossless against vLLM's own greedy decoding with the same engine. `match`
sampling is lossless too when the target's distribution is known from the top log-probabilities
vLLM returns: with `top_k` set within the engine's `max_logprobs` and `top_p` = 1. The rejection
modes need the full distribution and are refused with an error saying so. The engine's sessions
keep no pages pinned: a request's pages return to the cache's free list when it finishes, so
closing a session frees nothing more. How this compares with vLLM alone: docs/vllm.md.
"""

from __future__ import annotations

import os
import queue
import threading
from functools import partial
from typing import Any

from ..target import Capabilities, Rule, TargetBase
from ..translate.codec import ByteCodec
from ..translate.token_bytes import build_token_bytes
from .vllm_costs import time_batches, time_verifies
from .vllm_engine import EngineLoop, Handle, engine_defaults, require_vllm
from .vllm_proposer import EngineProposer, built_count, built_since, proposer_config
from .vllm_session import PrefixRecord, VLLMSession, tail_rows

__all__ = ["VLLMTarget", "tail_rows"]


class VLLMTarget(TargetBase):
    """A vLLM engine in this process, used as a target (see the module docstring).

    `engine`: a vLLM `LLMEngine` (or anything with its add_request / step / abort_request);
    `tokenizer`: the HF tokenizer of the same vocabulary. Use `load` to build both from a preset,
    a local directory or an HF id."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        name: str = "target",
        key: str | None = None,
        proposer: EngineProposer | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.name = engine, tokenizer, name
        self.proposer = proposer  # omnidraft's drafts inside the engine's step (vllm_proposer.py)
        config = engine.model_config
        self.vocab = int(config.get_vocab_size())
        self.context_length = int(config.max_model_len)
        self.max_logprobs = int(config.max_logprobs)
        cache = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
        # tokens a verify recomputes on average besides its own: the context's last, partial block
        self.block_size = int(getattr(cache, "block_size", 0) or 0)
        self.verify_tail = self.block_size // 2
        self.token_bytes = build_token_bytes(tokenizer, self.vocab)
        self.token_bytes.require_byte_coverage(name)
        self.codec = ByteCodec(tokenizer, self.token_bytes)
        self.eos_ids = frozenset(_eos_ids(config, tokenizer))
        self.key = key or name  # what the measured verify costs are remembered under
        self.loop = EngineLoop(engine)
        self.prefixes = PrefixRecord(self.block_size)  # what its requests put in the cache, by salt
        self._costs: dict[int, float] | None = None
        self._batch: dict[int, float] | None = None

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """Sessions decode alone on vLLM; concurrent sessions share engine steps (no lock around
        them; the engine's scheduler bounds a long prefill's tokens per step, so a server feeds a
        prompt whole); with omnidraft's proposer a pairing's drafts are verified in the engine's
        own step.
        Not in process: a round on the engine is a request, not a forward, so each request either
        speculates or lets vLLM decode alone, whichever measured faster."""
        return Capabilities(
            decodes_alone=True, batches_sessions=True, drafts_in_engine=self.proposer is not None
        )

    def engine_counters(self) -> tuple[int, float]:
        """(engine steps, seconds the engine was busy) so far."""
        return self.loop.steps, self.loop.busy

    def prefix_cache_counters(self) -> tuple[int, int]:
        """(prompt tokens of finished requests, those read from the prefix cache) so far."""
        return self.loop.prompt_tokens, self.loop.cached_tokens

    @classmethod
    def load(cls, spec: str, *, draft_tokens: int = 8, **engine_args: Any) -> VLLMTarget:
        """A preset name, .gguf path (served from its converted safetensors), local directory or HF
        id, with vLLM engine arguments passed through (dtype, max_model_len, tensor_parallel_size,
        enforce_eager, ...). Defaults: see `engine_defaults`. `draft_tokens` > 0 (and no
        `speculative_config` of the caller's): the engine asks omnidraft's proposer for drafts of up
        to that many tokens and verifies them in its own step (vllm_proposer.py; a server's
        streaming device sessions use it too); 0: a plain engine, where a verify is a request of
        its own."""
        require_vllm()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from ..store.models import hf_directory, load_tokenizer

        os.environ.setdefault(
            "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
        )  # in this process: no __main__ guard needed
        path = hf_directory(spec)
        if draft_tokens < 0:
            raise ValueError(f"draft_tokens must be >= 0, got {draft_tokens}")
        if draft_tokens and "speculative_config" not in engine_args:
            engine_args = {**engine_args, "speculative_config": proposer_config(draft_tokens)}
        args = engine_defaults(engine_args)
        before = built_count()
        engine = LLMEngine.from_engine_args(EngineArgs(model=path, **args))
        key = f"{spec}|{sorted(args.items())}"
        proposer = built_since(before) if draft_tokens else None
        return cls(
            engine, load_tokenizer(spec), name=spec.rstrip("/").rsplit("/", 1)[-1], key=key, proposer=proposer
        )

    def begin(self, prompt_ids: list[int]) -> VLLMSession:
        if not prompt_ids:
            raise ValueError("the prompt must have at least one token")
        if any(not 0 <= int(i) < self.vocab for i in prompt_ids):
            raise ValueError(f"prompt ids must be in [0, {self.vocab})")
        return VLLMSession(self, list(prompt_ids))

    def check_rule(self, rule: Rule) -> None:
        """Refuse, naming why, a rule this target cannot verify losslessly."""
        if rule.mode == "greedy":
            return
        if rule.mode != "match":
            raise ValueError(
                f"VLLMTarget verifies greedy and match only, not {rule.mode!r}: the rejection modes "
                "need the target's whole distribution, and vLLM returns its top log-probabilities"
            )
        if not 0 < rule.top_k <= self.max_logprobs or rule.top_p < 1.0:
            raise ValueError(
                f"match sampling on VLLMTarget needs 0 < top_k <= {self.max_logprobs} and top_p = 1 "
                f"(got top_k={rule.top_k}, top_p={rule.top_p}): the distribution is known exactly "
                "only over the top log-probabilities vLLM returns"
            )

    def submit(
        self,
        ids: list[int],
        salt: str,
        *,
        tag: str | None = None,
        outputs: queue.Queue | None = None,
        **options: Any,
    ) -> Handle:
        """Queue one request on the engine loop (`options`: `sampling_params`'); returns its handle.
        `tag` (default: the salt): the session asking; `outputs`: as for `EngineLoop.submit`."""
        prompt = {"prompt_token_ids": list(ids), "cache_salt": salt}
        return self.loop.submit(prompt, self.sampling_params(**options), tag=tag or salt, outputs=outputs)

    def sampling_params(
        self,
        max_tokens: int,
        *,
        stream: bool = False,
        logprobs: int = 0,
        prompt_logprobs: bool = False,
        cached: bool = True,
        eos: bool | None = None,
        rule: Rule | None = None,
    ) -> Any:
        """vLLM's SamplingParams of one request: greedy, or sampled under `rule`'s temperature and
        filters (its seed, if any, seeds the request's own generator); `stream`: the committed ids
        step by step; `eos`: stop after an EOS (default: a stream does, a verify does not);
        `cached`: the prompt may be read from the prefix cache."""
        eos = stream if eos is None else eos
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sampled = rule is not None and rule.mode != "greedy"
        sampling: dict[str, Any] = {}
        if rule is not None and sampled:
            sampling = {
                "top_p": rule.top_p,
                "top_k": rule.top_k or -1,
                "min_p": rule.min_p,
                "seed": rule.seed,
            }
        return SamplingParams(
            temperature=rule.temperature if rule is not None and sampled else 0.0,
            **sampling,
            max_tokens=max_tokens,
            detokenize=False,
            skip_reading_prefix_cache=not cached,
            logprobs=logprobs or None,
            prompt_logprobs=logprobs if prompt_logprobs else None,
            ignore_eos=not eos,
            stop_token_ids=sorted(self.eos_ids) if eos else None,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )

    def request(
        self,
        ids: list[int],
        salt: str,
        cancel: threading.Event | None = None,
        *,
        tag: str | None = None,
        **options: Any,
    ) -> Any:
        """One request, waited for: its final RequestOutput; aborted (Cancelled) once `cancel` is set.
        Its prompt's whole blocks are recorded as cached under `salt` (`prefixes`)."""
        out = self.submit(ids, salt, tag=tag, **options).result(cancel=cancel)
        self.prefixes.add(salt, ids)
        return out

    def verify_costs(self, context: int | None = None) -> dict[int, float]:
        """Seconds to verify n tokens (n = 1 .. 8) after a context, measured on this machine once
        and remembered (measured.py): what a pairing reads to decide whether drafting can
        pay here. A verify costs about the same at any context (the cache serves it)."""
        if self._costs is None:
            from ..runtime.measured import remembered

            costs = remembered("vllm-verify-costs", self.key, partial(time_verifies, self))
            self._costs = {int(n): float(s) for n, s in costs.items()}
        return dict(self._costs)

    def batch_costs(self) -> dict[int, float]:
        """Seconds of an engine step over BATCH_ROWS sequences verifying d drafted tokens each
        (d = 0, 3, 7 up to the engine's speculative width with omnidraft's proposer; 0 on a plain
        one), by the tokens the step holds, measured on this machine once and remembered
        (measured.py): with `verify_costs`, the step costs a server's draft budget reads
        (server/budget.py)."""
        if self._batch is None:
            from ..runtime.measured import remembered

            key = f"{self.key}|{self.capabilities.drafts_in_engine}"
            value = remembered("vllm-batch-costs", key, partial(time_batches, self))
            self._batch = {int(n): float(s) for n, s in value.items()}
        return dict(self._batch)

    def generate(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """vLLM's own greedy decoding of `prompt_ids` (the reference a verify must reproduce)."""
        return list(self.begin(prompt_ids).decode(max_tokens))

    def close(self) -> None:
        self.loop.close()

    def __repr__(self) -> str:
        return f"VLLMTarget({self.name!r}, vocab {self.vocab})"


def _eos_ids(config: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    hf = getattr(config, "hf_config", None)
    values = [getattr(hf, "eos_token_id", None), tokenizer.eos_token_id]
    try:
        from transformers import GenerationConfig

        values.append(GenerationConfig.from_pretrained(config.model).eos_token_id)
    except (OSError, ValueError):
        pass
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
