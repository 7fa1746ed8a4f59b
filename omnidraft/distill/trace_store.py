"""Recorded target behaviour for fast, exact greedy experiments (issue: online distillation).

In greedy mode what omnidraft commits is exactly the target's own greedy continuation, so each
prompt's continuation and the target's top-k log-probabilities at every position can be recorded
once and replayed. `ReplayTarget` implements the `Target` protocol from those records: the whole
engine (drafter, translator, session) runs unchanged and gives the same tokens and the same
acceptance figures as the live target, with drafter forwards only. The top-k rows are what the
distillation loss needs (distill/losses.py). Shapes: N generated positions, K top-k entries.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..decode.verify import Verdict
from ..errors import CorruptFileError, IncompatibleError
from ..store.atomic import atomic_write_bytes
from ..target import SessionBase, TargetBase
from ..translate.codec import ByteCodec
from ..translate.token_bytes import TokenBytes

if TYPE_CHECKING:
    from ..target import Target
    from ..targets.local import LocalTarget

__all__ = ["ReplayTarget", "TargetTrace", "load_traces", "record", "record_many", "save_traces"]


@dataclass(frozen=True)
class TargetTrace:
    """prompt_ids and continuation (N,) as lists; topk_ids (N, K) int64, topk_logp (N, K) float32:
    row i is the target's distribution over the token at continuation position i."""

    prompt_ids: list[int]
    continuation: list[int]
    topk_ids: torch.Tensor
    topk_logp: torch.Tensor


@torch.inference_mode()
def record(target: LocalTarget, prompt: str, max_new_tokens: int, k: int = 32) -> TargetTrace:
    """Greedy continuation of `prompt` by a LocalTarget, and its top-k log-probabilities."""
    ids = target.tokenizer(prompt)["input_ids"]
    x = torch.tensor([ids])
    out = target.model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(target.eos_ids),
        pad_token_id=min(target.eos_ids),
    )
    continuation = out[0, len(ids) :].tolist()
    logits = target.model(out).logits[
        0, len(ids) - 1 : -1
    ]  # one teacher-forced pass: row i predicts position i
    logp, top = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
    return TargetTrace(ids, continuation, top, logp)


@torch.inference_mode()
def record_many(
    target: LocalTarget,
    prompts: list[str],
    max_new_tokens: int,
    k: int = 32,
    batch_size: int = 8,
    progress: Any = None,
) -> list[TargetTrace]:
    """`record` for many prompts, `batch_size` at a time (left-padded): several times the
    throughput on CPU. Batched matmuls round differently from single-row ones, so a continuation
    may rarely part from the unbatched greedy one after a near tie; it is still the target's
    greedy text, which is what training and acceptance estimates need. `progress(done)` is called
    after each batch (default: a tqdm bar on a terminal)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    bar = None
    if progress is None:  # a progress bar on a terminal (tqdm stays silent elsewhere)
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc="recording target traces", unit="prompt", disable=None)
    pad, eos = min(target.eos_ids), sorted(target.eos_ids)
    traces: list[TargetTrace] = []
    for start in range(0, len(prompts), batch_size):
        batch = [target.tokenizer(p)["input_ids"] for p in prompts[start : start + batch_size]]
        width = max(map(len, batch))
        x = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
        out = target.model.generate(
            x,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
            output_logits=True,
            return_dict_in_generate=True,
        )
        steps = torch.stack(out.logits, 1).float()  # (B, N, Vt): row i predicted generated token i
        for b, ids in enumerate(batch):
            continuation = out.sequences[b, width:].tolist()
            end = next((i + 1 for i, t in enumerate(continuation) if t in target.eos_ids), len(continuation))
            logp, top = torch.log_softmax(steps[b, :end], -1).topk(k, dim=-1)
            traces.append(TargetTrace(ids, continuation[:end], top, logp))
        if bar is not None:
            bar.update(len(batch))
        else:
            progress(len(traces))
    if bar is not None:
        bar.close()
    return traces


def save_traces(path: str | os.PathLike[str], traces: list[TargetTrace], fingerprint: str) -> None:
    """One safetensors file (atomic) holding every trace, keyed by index, with JSON metadata."""
    from safetensors.torch import save

    tensors, meta = {}, {"fingerprint": fingerprint, "count": len(traces)}
    for i, t in enumerate(traces):
        tensors[f"{i}.prompt"] = torch.tensor(t.prompt_ids, dtype=torch.long)
        tensors[f"{i}.continuation"] = torch.tensor(t.continuation, dtype=torch.long)
        tensors[f"{i}.topk_ids"], tensors[f"{i}.topk_logp"] = (
            t.topk_ids.contiguous(),
            t.topk_logp.contiguous(),
        )
    atomic_write_bytes(Path(path), save(tensors, metadata={"omnidraft.traces": json.dumps(meta)}))


def load_traces(path: str | os.PathLike[str], fingerprint: str | None = None) -> list[TargetTrace]:
    """Traces saved by `save_traces`; refuses a file recorded with another target tokenizer."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {})["omnidraft.traces"])
            get = fh.get_tensor
            traces = [
                TargetTrace(
                    get(f"{i}.prompt").tolist(),
                    get(f"{i}.continuation").tolist(),
                    get(f"{i}.topk_ids"),
                    get(f"{i}.topk_logp"),
                )
                for i in range(meta["count"])
            ]
    except Exception as exc:  # safetensors raises its own errors on truncated or foreign files
        raise CorruptFileError(f"{path} is not a readable omnidraft trace file: {exc}") from exc
    if fingerprint is not None and meta["fingerprint"] != fingerprint:
        raise IncompatibleError(
            f"{path} was recorded for target tokenizer {meta['fingerprint']!r}, not {fingerprint!r}"
        )
    return traces


class _ReplaySession(SessionBase):
    def __init__(self, trace: TargetTrace) -> None:
        self.trace, self.ids, self._n = trace, list(trace.prompt_ids), 0
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
            raise ValueError(f"a replayed target verifies greedy drafts only, not mode {rule.mode!r}")
        truth = self.trace.continuation[self._n : self._n + len(proposal) + 1]
        if len(truth) <= len(proposal):
            raise ValueError(
                f"the recorded continuation has {len(self.trace.continuation)} tokens; "
                "generate at most that many from a ReplayTarget"
            )
        agree = torch.tensor(truth[: len(proposal)]) == proposal
        n = int(agree.long().cumprod(0).sum())
        rows = None
        if topk > 0:
            if topk > self.trace.topk_ids.shape[1]:
                raise ValueError(
                    f"asked for top-{topk} rows; this trace recorded top-{self.trace.topk_ids.shape[1]}"
                )
            rows = (
                self.trace.topk_ids[self._n : self._n + n + 1, :topk],
                self.trace.topk_logp[self._n : self._n + n + 1, :topk],
            )
        self.ids += truth[: n + 1]
        self._n += n + 1
        self.forwards += 1
        return Verdict(n, truth[n], rows)


class ReplayTarget(TargetBase):
    """A `Target` that answers from recorded traces: same tokens and acceptance as the live one."""

    def __init__(
        self,
        tokenizer: Any,
        token_bytes: TokenBytes,
        eos_ids: frozenset[int],
        traces: list[TargetTrace],
        name: str = "replay",
    ) -> None:
        self.tokenizer, self.token_bytes, self.eos_ids, self.name = tokenizer, token_bytes, eos_ids, name
        self.codec = ByteCodec(tokenizer, token_bytes)
        self._by_prompt = {tuple(t.prompt_ids): t for t in traces}

    @classmethod
    def like(cls, target: Target, traces: list[TargetTrace]) -> ReplayTarget:
        """A replay of `target` (any Target: its tokenizer, byte view and EOS ids)."""
        return cls(target.tokenizer, target.token_bytes, target.eos_ids, traces, f"replay:{target.name}")

    def begin(self, prompt_ids: list[int]) -> _ReplaySession:
        trace = self._by_prompt.get(tuple(prompt_ids))
        if trace is None:
            raise KeyError(f"no recorded trace for this prompt ({len(prompt_ids)} tokens); record it first")
        return _ReplaySession(trace)
