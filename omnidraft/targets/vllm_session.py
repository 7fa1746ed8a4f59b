"""A `VLLMTarget` session: its committed ids, verified one engine request at a time from the
prefix cache (`tail_rows`: which rows a request computed), streamed in the engine's own loop
(`steps`, `Stream`); what its tenant's pages already hold (`PrefixRecord`) is not read again.
See vllm_target.py for the target.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Generator, Iterator, Protocol

import torch

from ..decode.verify import Verdict
from ..target import ProposalSource, Rule, SessionBase, judge

if TYPE_CHECKING:
    from .vllm_engine import EngineLoop, Handle
    from .vllm_proposer import EngineProposer

__all__ = ["PrefixRecord", "SessionEngine", "Stream", "VLLMSession", "tail_rows"]

INLINE_TAIL = 64  # uncached prompt tokens a first verify with a proposal reads itself (no prefill first)


def tail_rows(prompt_len: int, num_cached: int, base: int) -> bool:
    """Whether a request over `prompt_len` tokens, `num_cached` of them read from the prefix cache,
    computed the rows a verify reads: the logits after positions base - 1 .. prompt_len - 1."""
    return base >= 1 and num_cached <= base - 1 < prompt_len


class PrefixRecord:
    """Which whole-block prompt prefixes an engine's requests have put in its prefix cache, by
    cache salt: a hint, never a promise (the engine may have evicted them since), by which a
    session of a tenant whose pages hold its prompt's prefix skips prefilling it. A wrong hint costs
    time, never exactness: a verify reads only rows the engine computed (`tail_rows`). Bounded to
    `capacity` blocks, the least recently seen forgotten first."""

    def __init__(self, block: int, capacity: int = 1 << 14) -> None:
        self.block, self.capacity = max(1, block), capacity
        self._seen: OrderedDict[int, None] = OrderedDict()

    def _chain(self, salt: str, ids: list[int], upto: int) -> Iterator[tuple[int, int]]:
        """(tokens, key) of each whole-block prefix of ids[:upto]: a hash chained over the blocks."""
        key = hash(salt)
        for end in range(self.block, upto + 1, self.block):
            key = hash((key, tuple(ids[end - self.block : end])))
            yield end, key

    def add(self, salt: str, ids: list[int]) -> None:
        """A request over `ids` with `salt` finished: its whole blocks are in the cache."""
        for _, key in self._chain(salt, ids, len(ids)):
            self._seen[key] = None
            self._seen.move_to_end(key)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def longest(self, salt: str, ids: list[int], upto: int) -> int:
        """Tokens of the longest whole-block prefix of ids[:upto] recorded under `salt` (0: none)."""
        found = 0
        for end, key in self._chain(salt, ids, upto):
            if key not in self._seen:
                break
            found = end
        return found


class SessionEngine(Protocol):
    """What a session reads of its target (`VLLMTarget`): the engine loop and its requests, the
    cache's block size and what its requests put there, the vocabulary, the rules it verifies."""

    vocab: int
    block_size: int
    loop: EngineLoop
    prefixes: PrefixRecord
    proposer: EngineProposer | None

    def check_rule(self, rule: Rule) -> None: ...

    def submit(
        self,
        ids: list[int],
        salt: str,
        *,
        tag: str | None = None,
        outputs: queue.Queue | None = None,
        **options: Any,
    ) -> Handle: ...

    def request(
        self,
        ids: list[int],
        salt: str,
        cancel: threading.Event | None = None,
        *,
        tag: str | None = None,
        **options: Any,
    ) -> Any: ...


class VLLMSession(SessionBase):
    def __init__(self, owner: SessionEngine, prompt_ids: list[int]) -> None:
        self.owner, self.ids = owner, list(prompt_ids)
        self.tag = self.salt = (
            uuid.uuid4().hex
        )  # its engine requests' tag; its own cache pages (or its tenant's)
        self.forwards = 0
        self.recomputed = 0  # verifies that had to recompute rows the cache had served
        self.cached = 0  # prompt tokens a `prefill` put in the prefix cache (it may evict them: no matter)
        self.started = False  # whether a verify or a stream of this session reached the engine

    def share_prefix_cache(self, tenant: str) -> None:
        """Salt this session's pages with `tenant`'s salt: its sessions reuse each other's prompt
        prefixes (a shared system prompt is prefilled once), and a verify stays exact, since rows
        the cache served are computed again where a verify reads them (`tail_rows`)."""
        if self.started:
            raise ValueError("a session's cache salt is set before its first request")
        self.salt = tenant
        self.cached = self.owner.prefixes.longest(tenant, self.ids, len(self.ids) - 1)

    @property
    def pending(self) -> int:
        """Prompt tokens a prefill would still put in the prefix cache: none once the engine read
        the prompt, or where at most INLINE_TAIL remain (the first verify reads those itself)."""
        left = 0 if self.started else max(0, len(self.ids) - 1 - self.cached)
        return left if left > INLINE_TAIL else 0

    def prefill(self, limit: int) -> int:
        """Put up to `limit` more prompt tokens (whole cache blocks) into the engine's prefix cache,
        as one request of its own that `cancel` stops; returns how many remain (`pending`). A first
        verify with a proposal calls it, so that its prompt log-probabilities cover the tail only;
        a verify of nothing reads the prompt itself: one request before the first token."""
        if self.started:  # past its first request the engine has read the prompt
            return 0
        block = max(1, self.owner.block_size)
        last = len(self.ids) - 1  # the last prompt token stays for the verify (its rows are asked)
        end = min(last, self.cached + max(block, limit))
        if end < last:
            end -= end % block
        if end > self.cached:
            self.owner.request(self.ids[:end], self.salt, self.cancel, tag=self.tag, max_tokens=1)
            self.cached = end
        return self.pending

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
        if m and self.pending:
            self.prefill(len(self.ids))
        self.started = True
        width = max(1, topk, rule.top_k if rule.mode == "match" else 1)
        out = owner.request(
            self.ids + draft,
            self.salt,
            self.cancel,
            tag=self.tag,
            max_tokens=1,
            logprobs=width,
            prompt_logprobs=m > 0,
        )
        if m and not tail_rows(len(out.prompt_token_ids), out.num_cached_tokens or 0, base):
            self.recomputed += 1
            out = owner.request(
                self.ids + draft,
                self.salt,
                self.cancel,
                tag=self.tag,
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

    def decode(self, max_tokens: int, rule: Rule | None = None) -> Generator[int, None, None]:
        """Decode up to `max_tokens` tokens with vLLM alone (stopping after an EOS), greedy or
        sampled under `rule`, committing each as the engine streams it: vLLM's own decoding loop."""
        for tokens in self.steps(max_tokens, rule=rule):
            yield from tokens

    def steps(
        self,
        max_tokens: int,
        source: ProposalSource | None = None,
        drafter_ids: list[int] | None = None,
        *,
        eos: bool = True,
        rule: Rule | None = None,
    ) -> Iterator[list[int]]:
        """Decode up to `max_tokens` tokens (stopping after an EOS), one list of committed ids per
        engine step: greedy, or sampled under `rule` (a `match` rule: temperature, top_k, top_p,
        min_p, seed). With `source` (an `EngineProposals`) and an engine built with omnidraft's
        proposer, the engine's speculative step verifies the drafts `source` proposes
        (targets/vllm_proposer.py), so a step may commit several tokens; a sampled request is
        verified by vLLM's rejection sampler, which takes a proposal as one-hot (accepted with the
        target's probability of it, else a token drawn from the rest): the output follows the
        target's own distribution whatever is proposed."""
        stream, done = self.start(max_tokens, source, drafter_ids, eos=eos, rule=rule), False
        try:
            for out in stream.handle.stream():
                yield stream.take(out)
            done = True
        finally:
            stream.end(done)

    def start(
        self,
        max_tokens: int,
        source: ProposalSource | None = None,
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
            self.cached = 0  # the tenant's pages may have been evicted: read it all again, from the cache
            while self.prefill(4096) > 0:
                pass
        self.started = True
        proposer = self.owner.proposer if source is not None else None
        seq = (
            None
            if proposer is None or source is None
            else proposer.expect(self.ids, source, max_tokens, drafter_ids)
        )
        submit = self.owner.submit
        handle = submit(
            self.ids,
            self.salt,
            tag=self.tag,
            max_tokens=max_tokens,
            stream=True,
            eos=eos,
            outputs=outputs,
            rule=rule,
        )
        return Stream(self, handle, proposer, seq)

    def close(self) -> None:
        """Nothing is pinned: the session's pages are ordinary cache entries, evicted as needed; the
        engine loop stops waiting for its next request."""
        self.owner.loop.forget(self.tag)


class Stream:
    """One streamed request of a session (`VLLMSession.start`): `take` commits an output's ids,
    `end` finishes it (aborting the engine's work when the reader stopped early)."""

    def __init__(self, session: VLLMSession, handle: Any, proposer: Any, seq: Any) -> None:
        self.session, self.handle, self.proposer, self.seq = session, handle, proposer, seq

    @property
    def error(self) -> BaseException | None:
        """The engine's error, once its outputs ended (None: it finished or was aborted)."""
        return self.handle.error

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


def _top(dicts: list[dict[int, Any]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probs), each (rows, width), most probable first, from vLLM's per-position dicts
    (which may hold one extra entry: the token actually at that position)."""
    rows = [sorted(d.items(), key=lambda kv: -kv[1].logprob)[:width] for d in dicts]
    ids = torch.tensor([[t for t, _ in row] for row in rows], dtype=torch.long)
    logp = torch.tensor([[lp.logprob for _, lp in row] for row in rows], dtype=torch.float32)
    return ids, logp
