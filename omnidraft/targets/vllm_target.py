"""`VLLMTarget`: a target served by vLLM's engine in this process, verifying from its prefix cache.

    target = od.VLLMTarget.load("qwen2.5-coder-0.5b", dtype="float32")
    pair = od.Drafter.load("smollm2-135m").pair(target)

A verify is one engine request: the session's committed ids plus the proposal, `max_tokens=1`.
The prefix cache serves the context, so only the uncached tail is computed; the request returns
prompt log-probabilities for the positions it computed and the bonus token's. Positions served
from the cache carry no valid log-probabilities, so only rows at or past `num_cached_tokens` are
read (`tail_rows`); when the cache covered a row the verify needs (another request computed the
same block), the request is repeated without reading the cache. Every session salts its blocks
(`cache_salt`), so one session never reuses another's pages or learns their timing.

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
import uuid
from functools import partial
from typing import Any, Iterator

import torch

from ..target import Capabilities, Rule, SessionBase, TargetBase, judge
from ..translate.codec import ByteCodec
from ..translate.token_bytes import build_token_bytes
from ..verify import Verdict
from .vllm_costs import time_batches, time_verifies
from .vllm_engine import EngineLoop, engine_defaults, require_vllm
from .vllm_proposer import EngineProposer, built_count, built_since, proposer_config

__all__ = ["VLLMTarget", "tail_rows"]


def tail_rows(prompt_len: int, num_cached: int, base: int) -> bool:
    """Whether a request over `prompt_len` tokens, `num_cached` of them read from the prefix cache,
    computed the rows a verify reads: the logits after positions base - 1 .. prompt_len - 1."""
    return base >= 1 and num_cached <= base - 1 < prompt_len


class _VLLMSession(SessionBase):
    def __init__(self, owner: VLLMTarget, prompt_ids: list[int]) -> None:
        self.owner, self.ids = owner, list(prompt_ids)
        self.salt = uuid.uuid4().hex  # this session's own prefix-cache pages
        self.forwards = 0
        self.recomputed = 0  # verifies that had to recompute rows the cache had served
        self.cached = 0  # prompt tokens a `prefill` put in the prefix cache (it may evict them: no matter)
        self.started = False  # whether a verify or a stream of this session reached the engine

    def prefill(self, most: int) -> int:
        """Put up to `most` more prompt tokens (whole cache blocks) into the engine's prefix cache,
        as one request of its own that `cancel` stops; returns how many remain. vLLM computes a
        request running alone in one step however long: a server feeds a long prompt this way so
        that a client that left, or a waiting session, never waits for the whole of it."""
        if self.started:  # past its first request the engine has read the prompt
            return 0
        block = max(1, self.owner.block_size)
        last = len(self.ids) - 1  # the last prompt token stays for the verify (its rows are asked)
        end = min(last, self.cached + max(block, most))
        if end < last:
            end -= end % block
        if end > self.cached:
            self.owner.request(self.ids[:end], self.salt, self.cancel, max_tokens=1)
            self.cached = end
        return last - self.cached

    def verify(
        self,
        proposal: torch.Tensor,
        rule: Rule,
        q: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        *,
        topk: int = 0,
    ) -> Verdict:
        """proposal (M,) int64 target ids. All or nothing: the session changes only once the
        verdict is known."""
        owner = self.owner
        owner.check_rule(rule)
        draft = [int(t) for t in proposal.tolist()]
        base, m = len(self.ids), len(draft)
        self.started = True
        width = max(1, topk, rule.top_k if rule.mode == "match" else 1)
        out = owner.request(
            self.ids + draft, self.salt, self.cancel, max_tokens=1, logprobs=width, prompt_logprobs=m > 0
        )
        if m and not tail_rows(len(out.prompt_token_ids), out.num_cached_tokens or 0, base):
            self.recomputed += 1
            out = owner.request(
                self.ids + draft,
                self.salt,
                self.cancel,
                max_tokens=1,
                logprobs=width,
                prompt_logprobs=True,
                cached=False,
            )
        dicts = [out.prompt_logprobs[base + i] for i in range(m)] + [out.outputs[0].logprobs[0]]
        ids, logp = _top(dicts, width)
        if rule.mode == "greedy":
            best = ids[:, 0].clone()
            best[m] = out.outputs[0].token_ids[0]  # vLLM's own greedy choice after the whole proposal
            ok = (best[:m] == proposal).long().cumprod(0)
            verdict = Verdict(int(ok.sum()), int(best[int(ok.sum())]))
        else:  # match, on the distribution the top log-probabilities describe exactly (check_rule)
            dense = torch.full((m + 1, owner.vocab), float("-inf"))
            dense.scatter_(1, ids, logp)
            verdict = judge(dense, proposal, rule, None, generator, base)
        if topk:
            n = verdict.accepted + 1
            verdict = Verdict(verdict.accepted, verdict.token, (ids[:n, :topk], logp[:n, :topk]))
        self.ids = self.ids + draft[: verdict.accepted] + [verdict.token]
        self.forwards += 1
        return verdict

    def decode(self, max_tokens: int, rule: Rule | None = None) -> Iterator[int]:
        """Decode up to `max_tokens` tokens with vLLM alone (stopping after an EOS), greedy or
        sampled under `rule`, committing each as the engine streams it: vLLM's own decoding loop."""
        for tokens in self.steps(max_tokens, rule=rule):
            yield from tokens

    def steps(
        self,
        max_tokens: int,
        rounds: Any = None,
        drafter_ids: list[int] | None = None,
        *,
        eos: bool = True,
        rule: Rule | None = None,
    ) -> Iterator[list[int]]:
        """Decode up to `max_tokens` tokens (stopping after an EOS), one list of committed ids per
        engine step: greedy, or sampled under `rule` (a `match` rule: temperature, top_k, top_p,
        min_p, seed). With `rounds` (an `EngineRounds`) and an engine built with omnidraft's
        proposer, the engine's speculative step verifies the drafts `rounds` proposes
        (targets/vllm_proposer.py), so a step may commit several tokens; a sampled request is
        verified by vLLM's rejection sampler, which takes a proposal as one-hot (accepted with the
        target's probability of it, else a token drawn from the rest): the output follows the
        target's own distribution whatever is proposed."""
        stream, done = self.start(max_tokens, rounds, drafter_ids, eos=eos, rule=rule), False
        try:
            for out in stream.handle.stream():
                yield stream.take(out)
            done = True
        finally:
            stream.end(done)

    def start(
        self,
        max_tokens: int,
        rounds: Any = None,
        drafter_ids: list[int] | None = None,
        *,
        eos: bool = True,
        outputs: queue.Queue | None = None,
        rule: Rule | None = None,
    ) -> Stream:
        """Submit what `steps` reads, for a caller that reads the engine's outputs itself (from
        `outputs`, a queue it also waits on for other news); it passes each to `Stream.take`.
        A seeded sampled request on a CPU has its prompt read first (`prefill`): vLLM's CPU
        sampler cannot rewind a seeded generator after a prefill piece (it fails the whole engine
        step), so such a request must reach the engine with its prompt already cached."""
        if rule is not None and rule.seed is not None and not torch.cuda.is_available():
            while self.prefill(4096) > 0:
                pass
        self.started = True
        proposer = self.owner.proposer if rounds is not None else None
        seq = proposer.expect(self.ids, rounds, max_tokens, drafter_ids) if proposer is not None else None
        submit = self.owner.submit
        handle = submit(
            self.ids, self.salt, max_tokens=max_tokens, stream=True, eos=eos, outputs=outputs, rule=rule
        )
        return Stream(self, handle, proposer, seq)

    def close(self) -> None:
        """Nothing is pinned: the session's pages are ordinary cache entries, evicted as needed."""


class Stream:
    """One streamed request of a session (`_VLLMSession.start`): `take` commits an output's ids,
    `end` finishes it (aborting the engine's work when the reader stopped early)."""

    def __init__(self, session: _VLLMSession, handle: Any, proposer: Any, seq: Any) -> None:
        self.session, self.handle, self.proposer, self.seq = session, handle, proposer, seq

    def take(self, out: Any) -> list[int]:
        tokens = [int(t) for t in out.outputs[0].token_ids]
        self.session.ids.extend(tokens)
        self.session.forwards += 1
        return tokens

    def end(self, done: bool) -> None:
        if not done:
            self.session.owner.loop.abort(self.handle)  # the caller stopped reading: free the engine's work
        if self.seq is not None:
            self.proposer.forget(self.seq)


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
        self._costs: dict[int, float] | None = None
        self._batch: dict[int, float] | None = None

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """Sessions decode alone on vLLM; concurrent sessions share engine steps (no lock around
        them); with omnidraft's proposer a pairing's drafts are verified in the engine's own step.
        Not in process: a round on the engine is a request, not a forward, so each request either
        speculates or lets vLLM decode alone, whichever measured faster."""
        return Capabilities(
            decodes_alone=True,
            batches_sessions=True,
            prefills_in_chunks=True,
            drafts_in_engine=self.proposer is not None,
        )

    def engine_counters(self) -> tuple[int, float]:
        """(engine steps, seconds the engine was busy) so far."""
        return self.loop.steps, self.loop.busy

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

        from ..models import hf_directory, load_tokenizer

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

    def begin(self, prompt_ids: list[int]) -> _VLLMSession:
        if not prompt_ids:
            raise ValueError("the prompt must have at least one token")
        if any(not 0 <= int(i) < self.vocab for i in prompt_ids):
            raise ValueError(f"prompt ids must be in [0, {self.vocab})")
        return _VLLMSession(self, list(prompt_ids))

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
        max_tokens: int,
        stream: bool = False,
        logprobs: int = 0,
        prompt_logprobs: bool = False,
        cached: bool = True,
        eos: bool | None = None,
        outputs: queue.Queue | None = None,
        rule: Rule | None = None,
    ) -> Any:
        """Queue one request on the engine loop, greedy or sampled under `rule`'s temperature and
        filters (its seed, if any, seeds the request's own generator); returns its handle. `eos`:
        stop after an EOS (default: a stream does, a verify does not); `outputs`: as for
        `EngineLoop.submit`."""
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
        params = SamplingParams(
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
        prompt = {"prompt_token_ids": list(ids), "cache_salt": salt}
        return self.loop.submit(prompt, params, tag=salt, outputs=outputs)

    def request(
        self, ids: list[int], salt: str, cancel: threading.Event | None = None, **options: Any
    ) -> Any:
        """One request, waited for: its final RequestOutput; aborted (Cancelled) once `cancel` is set."""
        return self.submit(ids, salt, **options).result(cancel=cancel)

    def verify_costs(self, context: int | None = None) -> dict[int, float]:
        """Seconds to verify n tokens (n = 1 .. 8) after a context, measured on this machine once
        and remembered (measured.py): what a pairing reads to decide whether drafting can
        pay here. A verify costs about the same at any context (the cache serves it)."""
        if self._costs is None:
            from ..measured import remembered

            costs = remembered("vllm-verify-costs", self.key, partial(time_verifies, self))
            self._costs = {int(n): float(s) for n, s in costs.items()}
        return dict(self._costs)

    def batch_costs(self) -> dict[int, float]:
        """Seconds of an engine step over BATCH_ROWS sequences verifying d drafted tokens each
        (d = 0, 3, 7 up to the engine's speculative width with omnidraft's proposer; 0 on a plain
        one), by the tokens the step holds, measured on this machine once and remembered
        (measured.py): with `verify_costs`, the step costs a server's draft budget reads
        (remote/budget.py)."""
        if self._batch is None:
            from ..measured import remembered

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


def _top(dicts: list[dict[int, Any]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probs), each (rows, width), most probable first, from vLLM's per-position dicts
    (which may hold one extra entry: the token actually at that position)."""
    rows = [sorted(d.items(), key=lambda kv: -kv[1].logprob)[:width] for d in dicts]
    ids = torch.tensor([[t for t, _ in row] for row in rows], dtype=torch.long)
    logp = torch.tensor([[lp.logprob for _, lp in row] for row in rows], dtype=torch.float32)
    return ids, logp


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
