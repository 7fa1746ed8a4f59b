"""The engine-step seam (target.py: `EngineSession`, `StreamingSession`, `EngineStream`, `ProposalSource`)
is all a second in-engine target needs: `ToyEngine`, one class pair in this file, verifies each
step's drafts in a loop of its own, and both a pairing's engine rounds (decode/engine_proposals.py)
and a server's device path (server/device_proposals.py, through a RemoteTarget) run on it, their
output the target's own greedy output."""

from __future__ import annotations

import queue
import threading
from typing import Any, Generator, Iterator

import torch

from omnidraft.decode.verify import Verdict
from omnidraft.target import (
    Capabilities,
    EngineStream,
    ProposalSource,
    Rule,
    SessionBase,
    StreamingSession,
    TargetBase,
)

STEP_DRAFT = 4  # draft tokens one engine step verifies at most


class ToyEngine(TargetBase):
    """An in-engine target over a LocalTarget's model: each step asks `source` for a draft after
    the committed ids and verifies it, all in the engine's loop (here, a thread or the caller's)."""

    capabilities = Capabilities(decodes_alone=True, batches_sessions=True, drafts_in_engine=True)
    verify_tail = 0

    def __init__(self, local: Any) -> None:
        self.local, self.name, self.tokenizer = local, "toy-engine", local.tokenizer
        self.token_bytes, self.codec, self.eos_ids = local.token_bytes, local.codec, local.eos_ids
        self.proposed = 0  # draft tokens the engine's steps were given

    def begin(self, prompt_ids: list[int]) -> ToySession:
        return ToySession(self, list(prompt_ids))

    def verify_costs(self, context: int | None = None) -> dict[int, float]:
        return {n: 0.01 + 0.001 * n for n in range(1, 9)}  # drafting pays: a verify of 8 costs ~1.3 steps

    def batch_costs(self) -> dict[int, float]:
        return {16: 0.02, 64: 0.022, 128: 0.025}

    def prefix_cache_counters(self) -> tuple[int, int]:
        return 0, 0


class _Output:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens


class ToySession(SessionBase):
    def __init__(self, owner: ToyEngine, ids: list[int]) -> None:
        self.owner, self.ids = owner, ids
        self._inner = owner.local.begin(list(ids))

    def verify(
        self,
        proposal: torch.Tensor,
        rule: Rule,
        q: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        *,
        topk: int = 0,
    ) -> Verdict:
        verdict = self._inner.verify(proposal, rule, q, generator, topk=topk)
        self.ids = list(self._inner.ids)
        return verdict

    def _run(
        self, max_tokens: int, source: ProposalSource | None, drafter_ids: list[int] | None, eos: bool
    ) -> Iterator[list[int]]:
        """The engine's loop: a draft from `source` a step, verified; the ids each step commits."""
        inner, produced = self.owner.local.begin(list(self.ids)), 0
        if source is not None:
            source.open(list(inner.ids), drafter_ids)
        try:
            while produced < max_tokens:
                draft: list[int] = []
                if source is not None:
                    source.prepare(list(inner.ids))
                    draft = source.next(list(inner.ids), STEP_DRAFT, max_tokens - produced)
                self.owner.proposed += len(draft)
                before = len(inner.ids)
                inner.verify(torch.tensor(draft, dtype=torch.long), Rule())
                new = inner.ids[before:][: max_tokens - produced]
                if eos and any(t in self.owner.eos_ids for t in new):
                    new = new[: next(i for i, t in enumerate(new) if t in self.owner.eos_ids) + 1]
                produced += len(new)
                yield new
                if new and new[-1] in self.owner.eos_ids and eos:
                    return
        finally:
            inner.close()

    def steps(
        self,
        max_tokens: int,
        source: ProposalSource | None = None,
        drafter_ids: list[int] | None = None,
        *,
        eos: bool = True,
        rule: Rule | None = None,
    ) -> Iterator[list[int]]:
        assert rule is None, "the toy engine decodes greedily"
        for new in self._run(max_tokens, source, drafter_ids, eos):
            self.ids = self.ids + new
            yield new

    def decode(self, max_tokens: int, rule: Rule | None = None) -> Generator[int, None, None]:
        for new in self.steps(max_tokens):
            yield from new

    def start(
        self,
        max_tokens: int,
        source: ProposalSource | None = None,
        drafter_ids: list[int] | None = None,
        *,
        eos: bool = True,
        outputs: queue.Queue | None = None,
        rule: Rule | None = None,
    ) -> ToyStream:
        return ToyStream(self, self._run(max_tokens, source, drafter_ids, eos), outputs or queue.Queue())

    def close(self) -> None:
        self._inner.close()


class ToyStream:
    """The engine's loop on a thread of its own, its outputs on the caller's queue, then None."""

    def __init__(self, session: ToySession, run: Iterator[list[int]], outputs: queue.Queue) -> None:
        self.session, self._stop = session, threading.Event()
        self._error: BaseException | None = None

        def loop() -> None:
            try:
                for new in run:
                    if self._stop.is_set():
                        return
                    outputs.put(_Output(new))
            except BaseException as exc:  # noqa: BLE001 - the engine's error, for the reader
                self._error = exc
            finally:
                outputs.put(None)

        threading.Thread(target=loop, daemon=True).start()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def take(self, out: _Output) -> list[int]:
        self.session.ids = self.session.ids + out.tokens
        return out.tokens

    def end(self, done: bool) -> None:
        self._stop.set()


def _typed(session: ToySession, stream: ToyStream) -> tuple[StreamingSession, EngineStream]:
    return session, stream  # mypy checks the toy against the seam's protocols


PROMPT = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?"


def target_greedy(local: Any, prompt: str, n: int) -> list[int]:
    """The target decoding alone, greedy: what every pairing must reproduce."""
    return list(local.begin(local.tokenizer(prompt)["input_ids"]).decode(n))


def test_a_pairing_on_a_second_in_engine_target_runs_engine_rounds_losslessly(tiny_target, tiny_drafter):
    toy = ToyEngine(tiny_target)
    pair = tiny_drafter.pair(toy, k=3)
    assert pair.speculator.serving(Rule(), 0) == "engine"
    out = pair.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == target_greedy(tiny_target, PROMPT, 24)[: len(out.token_ids)]
    assert len(out.token_ids) == 24 or out.token_ids[-1] in toy.eos_ids
    assert toy.proposed > 0 and out.stats.mean_accepted_length > 1  # its steps verified the drafts


def test_a_server_on_a_second_in_engine_target_serves_a_devices_drafts_losslessly(tiny_target, tiny_drafter):
    from omnidraft.bench.remote import serve_in_thread
    from omnidraft.server.app import ServerConfig, create_app
    from omnidraft.targets.remote import RemoteTarget

    toy = ToyEngine(tiny_target)
    url, stop = serve_in_thread(create_app(toy, ServerConfig(api_key="k")))
    try:
        remote = RemoteTarget(url, api_key="k", tokenizer=tiny_target.tokenizer)
        assert remote.capabilities.drafts_in_engine  # the server says its engine verifies drafts
        pair = tiny_drafter.pair(remote, k=3)
        out = pair.generate(PROMPT, max_new_tokens=24)
        assert out.token_ids == target_greedy(tiny_target, PROMPT, 24)[: len(out.token_ids)]
        assert len(out.token_ids) == 24 or out.token_ids[-1] in toy.eos_ids
        # the engine's steps took drafts (the device's, or the server's lookup where they came late)
        assert out.stats.served == "engine" and toy.proposed > 0
        remote.close()
    finally:
        stop()
