"""`LlamaCppTarget`: a GGUF model run by llama.cpp in this process, as a target.

A session holds the committed ids; the engine's KV cache holds what was evaluated last. A verify
feeds the pending token and the proposal after the cached prefix and asks for their M + 1 rows of
logits only, so it costs O(draft) whatever the context; the rejected tail is removed from the cache
at the next call (engine.py). Verification itself is the in-process rule every target shares
(`omnidraft.target.judge`): greedy, match, exact, and the lossy relaxed rule when asked.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np
import torch

from ..decode.verify import Verdict
from ..errors import IncompatibleError
from ..store.models import load_tokenizer
from ..target import Capabilities, Rule, SessionBase, TargetBase, judge
from ..translate.codec import ByteCodec
from ..translate.token_bytes import build_token_bytes
from .engine import COST_CONTEXT, LlamaEngine
from .loading import gguf_file

__all__ = ["LlamaCppTarget"]

# A string whose tokenization both tokenizers must agree on (code, prose, digits, non-ASCII, chat markup).
PROBE = "def f(x):\n    return x * 2  # 1,234 \u00e9t\u00e9 \u4f60\u597d\n<|im_start|>user\nHi<|im_end|>\n"


class _LlamaSession(SessionBase):
    def __init__(self, owner: LlamaCppTarget, prompt_ids: list[int]) -> None:
        self.owner, self.ids = owner, list(prompt_ids)
        self.prompt = len(self.ids)
        self.forwards = 0

    def _logits(self, ids: list[int], rows: int) -> torch.Tensor:
        return torch.from_numpy(self.owner.engine.logits(ids, rows, prompt=self.prompt, owner=self))

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
        logits = self._logits(self.ids + draft, len(draft) + 1)
        self.forwards += 1
        verdict = judge(logits, proposal, rule, q, generator, base, topk=topk, relax=relax)
        self.ids = self.ids + draft[: verdict.accepted] + [verdict.token]
        return verdict

    def scores(self, new: list[int], keep: int) -> torch.Tensor:
        """Append `new` to the sequence and return the logits (keep, V) after its last `keep` tokens.
        Before the first verify or decode the sequence is still a prompt (evaluated as one)."""
        self.ids.extend(new)
        if self.forwards == 0:
            self.prompt = len(self.ids)
        return self._logits(self.ids, keep)

    def close(self) -> None:
        """The generation is over: its KV slot may be taken over first."""
        self.owner.engine.release(self)

    def decode(self, max_tokens: int) -> Iterator[int]:
        """Greedy-decode up to `max_tokens` tokens with the target alone (stopping after an
        end-of-generation token): llama.cpp's plain decoding loop."""
        for _ in range(max_tokens):
            row = self.owner.engine.logits(self.ids, 1, prompt=self.prompt, owner=self)[0]
            token = int(np.argmax(row))  # (numpy, on this thread: see decode/verify.py `argmax`)
            self.ids.append(token)
            self.forwards += 1
            yield token
            if token in self.owner.eos_ids:
                return


class LlamaCppTarget(TargetBase):
    """A preset or .gguf file under llama.cpp, verifying in this process.

    `tokenizer`: the HF tokenizer for the same vocabulary (default: converted from the GGUF file);
    it must tokenize like llama.cpp does, which is checked on a probe string. `n_ctx` bounds a
    session's sequence; `threads` defaults to every core. `slots`: sessions whose KV caches are kept
    side by side (a server's concurrent sessions; see LlamaEngine); a session that lost its slot
    evaluates its sequence afresh, so its output never depends on who ran before."""

    capabilities = Capabilities(in_process=True, decodes_alone=True, scores_positions=True)

    def __init__(
        self,
        model: str | os.PathLike[str] | LlamaEngine,
        *,
        tokenizer: Any = None,
        n_ctx: int = 4096,
        threads: int | None = None,
        slots: int = 1,
        name: str | None = None,
    ) -> None:
        if isinstance(model, LlamaEngine):
            self.engine, spec = model, str(model.path)
            default_name = model.path.stem
        else:
            path, default_name = gguf_file(model)
            spec = os.fspath(model)
            self.engine = LlamaEngine(path, n_ctx=n_ctx, threads=threads, slots=slots)
        self.name = name or default_name
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec)
        self.token_bytes = build_token_bytes(self.tokenizer, self.engine.n_vocab)
        self.token_bytes.require_byte_coverage(self.name)
        self.codec = ByteCodec(self.tokenizer, self.token_bytes)
        ours = self.tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        theirs = self.engine.tokenize(PROBE)
        if ours != theirs:
            raise IncompatibleError(
                f"{self.name}: the tokenizer given tokenizes unlike llama.cpp's own vocabulary "
                f"(probe string: {len(ours)} vs {len(theirs)} tokens); pass the model's tokenizer"
            )
        self.context_length = self.engine.n_ctx
        eos = self.tokenizer.eos_token_id
        self.eos_ids = self.engine.eog_ids() | ({eos} if isinstance(eos, int) else set())

    def verify_costs(self, context: int | None = None) -> dict[int, float]:
        """Seconds to verify n tokens (n = 1 .. 8), measured on this machine (LlamaEngine.row_costs):
        what a pairing reads to decide whether drafting can pay here at all. After `context` tokens
        (default: where they were measured) a call may evaluate fewer tokens bit-exactly
        (`LlamaEngine.rows_at`): verifying n then takes more calls, and the costs say so."""
        costs = self.engine.row_costs()
        rows = self.engine.rows_at(COST_CONTEXT if context is None else context)
        if rows >= self.engine.rows_at(COST_CONTEXT):
            return costs
        return {n: (n // rows) * costs[rows] + (costs[n % rows] if n % rows else 0.0) for n in costs}

    @classmethod
    def load(cls, spec: str, **options: Any) -> LlamaCppTarget:
        """Same as the constructor, named like the other backends' loaders."""
        return cls(spec, **options)

    def begin(self, prompt_ids: list[int]) -> _LlamaSession:
        if not prompt_ids:
            raise ValueError("the prompt must have at least one token")
        if any(not 0 <= int(i) < self.engine.n_vocab for i in prompt_ids):
            raise ValueError(f"prompt ids must be in [0, {self.engine.n_vocab})")
        return _LlamaSession(self, list(prompt_ids))

    def __repr__(self) -> str:
        return f"LlamaCppTarget({self.name!r}, vocab {self.engine.n_vocab})"
