"""`OpenVINOTarget`: a causal LM exported to OpenVINO IR (optimum-intel's stateful export, see
export/openvino.py), run by OpenVINO's CPU plugin in this process, as a target.

OpenVINO's kernels read each weight once for the many rows of a verify, so verifying a few tokens
costs little more than one decoding step (docs/openvino.md measures it), where llama.cpp's CPU
kernels pay nearly a step a token. The engine keeps one sequence's KV cache in the compiled model's
state; a verify feeds the tokens after the cached prefix and asks for logits of the last M + 1 rows
only (the LM head is cut to those rows, so a prompt's prefill does not compute a row per token), and
a rejected tail is trimmed from the state.

Exactness: a forward of many rows and one of a single row give logits that differ in the last bits,
so a greedy verify could pick another token than decoding one token at a time would. The engine
measures once per machine and model the largest such difference (`margin`); a verified position
whose top two logits are closer than the margin is decided again by a one-row step, so greedy
output is the engine's own one-token-at-a-time output. What this module is not: the exporter
(export/openvino.py) or the verification rule (`omnidraft.target.judge`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..decode.verify import Verdict
from ..target import Capabilities, Rule, SessionBase, TargetBase, judge
from ..translate.codec import ByteCodec
from ..translate.token_bytes import build_token_bytes
from .openvino_engine import OpenVINOEngine

__all__ = ["OpenVINOEngine", "OpenVINOTarget"]  # the engine re-exported (openvino_engine.py)


class _OpenVINOSession(SessionBase):
    """One generation: `ids` committed, of which the engine's state holds `cached` (all but the
    last committed token, once a call has run)."""

    def __init__(self, owner: OpenVINOTarget, prompt_ids: list[int]) -> None:
        self.owner, self.ids = owner, list(prompt_ids)
        self.cached = 0
        self.prefilled = False  # the last call read the prompt: its first row is decoding's own

    def _rows(self, draft: list[int]) -> np.ndarray:
        """Logits after the pending token and after each drafted one, (len(draft) + 1, V). A first
        call reads the prompt alone first, as decoding alone does, so its rows match."""
        engine = self.owner.engine
        if not engine.claim(self) or engine.cached != self.cached:  # another's sequence was there
            engine.reset()
            self.cached = 0  # read afresh
        self.prefilled = self.cached == 0
        if self.prefilled:
            started = time.perf_counter()
            first = engine.forward(self.ids, 1)
            self.prefill_s = time.perf_counter() - started
            self.cached = len(self.ids)
            return first if not draft else np.concatenate([first, engine.forward(draft, len(draft))])
        tail = self.ids[self.cached :] + draft
        return engine.forward(tail, len(draft) + 1)

    def verify(
        self,
        proposal: torch.Tensor,
        rule: Rule,
        q: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        *,
        topk: int = 0,
        relax: tuple[torch.Tensor, int] | None = None,
    ) -> Verdict:
        draft = [int(t) for t in proposal.tolist()]
        base = len(self.ids)
        logits = torch.from_numpy(self._rows(draft))
        verdict = judge(logits, proposal, rule, q, generator, base, topk=topk, relax=relax)
        if rule.mode == "greedy" and relax is None:
            verdict = self._exact(logits, draft, verdict)
        self._settle(draft[: verdict.accepted], verdict.token, base)
        return verdict

    def _exact(self, logits: torch.Tensor, draft: list[int], verdict: Verdict) -> Verdict:
        """The greedy verdict as one-token-at-a-time decoding gives it: the first consulted row whose
        top two logits are within the engine's margin is decided again by a one-row step."""
        if self.owner.margin <= 0:  # no two logits are closer than nothing: the verdict stands
            return verdict
        top = logits[: verdict.accepted + 1].topk(2, dim=-1).values
        close = ((top[:, 0] - top[:, 1]) < self.owner.margin).nonzero()[:, 0]
        close = close[close > 0] if self.prefilled else close  # (the prompt's row is decoding's own)
        if not len(close):
            return verdict
        j = int(close[0])  # row j follows the token at position len(ids) - 1 + j of ids + draft
        at = len(self.ids) - 1 + j
        self.owner.engine.trim(at)
        row = self.owner.engine.forward([(self.ids + draft)[at]], 1)[0]
        return Verdict(j, int(row.argmax()))

    def _settle(self, accepted: list[int], token: int, base: int) -> None:
        """Commit `accepted` and `token`; the state keeps every committed position but the last."""
        self.ids = self.ids[:base] + accepted + [token]
        self.cached = len(self.ids) - 1
        self.owner.engine.trim(self.cached)

    def decode(self, max_tokens: int) -> Iterator[int]:
        """Greedy-decode up to `max_tokens` tokens one at a time (stopping after an end-of-generation
        token): the engine's own decoding, which verification reproduces."""
        for _ in range(max_tokens):
            token = int(self._rows([])[0].argmax())
            self.ids.append(token)
            self.cached = len(self.ids) - 1
            yield token
            if token in self.owner.eos_ids:
                return

    def close(self) -> None:
        """The generation is over: the engine's state may be taken over."""
        if self.owner.engine.owner is self:
            self.owner.engine.owner = None


def _eos_ids(directory: Path, tokenizer: Any) -> frozenset[int]:
    """The ids a generation ends on: the tokenizer's EOS and the generation config's (an instruct
    model's end-of-turn token among them), as HF's `generate` stops."""
    import json

    found = {tokenizer.eos_token_id} if isinstance(tokenizer.eos_token_id, int) else set()
    config = directory / "generation_config.json"
    if config.exists():
        eos = json.loads(config.read_text()).get("eos_token_id")
        found |= set(eos) if isinstance(eos, list) else {eos} if isinstance(eos, int) else set()
    return frozenset(found)


class OpenVINOTarget(TargetBase):
    """A model exported to OpenVINO IR (a directory with openvino_model.xml and its tokenizer) on
    OpenVINO's CPU plugin, verifying in this process. `margin`: logits closer than this at a
    verified position are decided by a one-row step (default: measured once on this machine for
    this model, runtime/openvino_margin.py); `threads`: OpenVINO's inference threads (default:
    every core; fewer leave the others to a drafter drafting beside the verifies, decode/overlap.py)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        tokenizer: Any = None,
        threads: int | None = None,
        margin: float | None = None,
        name: str | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        from ..llamacpp.loading import cpu_threads

        threads = threads or cpu_threads()
        self.engine = OpenVINOEngine(path, threads=threads)
        self.capabilities = Capabilities(in_process=True, decodes_alone=True, verifies_beside=threads)
        self.name = name or self.engine.path.name
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(str(path))
        self.token_bytes = build_token_bytes(self.tokenizer, self.engine.n_vocab)
        self.token_bytes.require_byte_coverage(self.name)
        self.codec = ByteCodec(self.tokenizer, self.token_bytes)
        self.eos_ids = _eos_ids(self.engine.xml.parent, self.tokenizer)
        self.margin = margin if margin is not None else self._measured_margin()
        self._costs: dict[int, float] | None = None

    @classmethod
    def load(cls, spec: str, *, weights: str = "int8", **options: Any) -> OpenVINOTarget:
        """`spec` as OpenVINO IR: an exported directory, or a preset, .gguf file or HF model exported
        once into the cache (export/openvino.py; the export needs `$OMNIDRAFT_OPENVINO_PYTHON`)."""
        from ..export.openvino import exported

        path = exported(spec, weights=weights)
        name = options.pop("name", None) or (spec if not Path(spec).expanduser().is_dir() else None)
        return cls(path, name=name, **options)

    def _measured_margin(self) -> float:
        from ..runtime.openvino_margin import measured_margin

        return measured_margin(self.engine, self.tokenizer)

    def verify_costs(self, context: int | None = None) -> dict[int, float] | None:
        from ..runtime.openvino_margin import measured_costs

        if self._costs is None:  # measured once a machine; read once a target (planning asks a round)
            self._costs = measured_costs(self.engine, self.tokenizer)
        return dict(self._costs)

    def begin(self, prompt_ids: list[int]) -> _OpenVINOSession:
        if not prompt_ids:
            raise ValueError("the prompt must have at least one token")
        if any(not 0 <= int(i) < self.engine.n_vocab for i in prompt_ids):
            raise ValueError(f"prompt ids must be in [0, {self.engine.n_vocab})")
        return _OpenVINOSession(self, list(prompt_ids))

    def __repr__(self) -> str:
        return f"OpenVINOTarget({self.name!r}, vocab {self.engine.n_vocab})"
