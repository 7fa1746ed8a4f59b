"""`LocalTarget`: an HF causal LM in this process, on the CPU or a GPU, used as a target.

Its sessions run the model through a `CausalRunner` (dynamic KV cache) or, on a GPU where measured
faster, a `StaticRunner` (static cache replaying CUDA graphs: docs/gpu.md).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Iterator

import torch

from ..decode.verify import Verdict
from ..runtime import measured
from ..runtime.attention import use_grouped_attention
from ..runtime.causal_runner import CausalRunner
from ..runtime.devices import resolve_device, resolve_dtype
from ..runtime.kernels import use_kernels
from ..runtime.static_runner import StaticRunner, measure_graphs, static_cache_supported
from ..store.models import load_model
from ..target import Capabilities, Rule, SessionBase, TargetBase, judge
from ..translate.codec import ByteCodec
from ..translate.token_bytes import build_token_bytes

__all__ = ["LocalTarget"]


class _LocalSession(SessionBase):
    def __init__(
        self,
        model: Any,
        prompt_ids: list[int],
        eos_ids: frozenset[int] = frozenset(),
        runner: CausalRunner | None = None,
    ) -> None:
        self.runner = runner if runner is not None else CausalRunner(model, prompt_ids)
        self.eos_ids = eos_ids
        self.forwards = 0

    def decode(self, max_tokens: int) -> Iterator[int]:
        """Greedy-decode up to `max_tokens` tokens with the target alone (stopping after an EOS),
        committing each: the plain decoding loop, on the same model and kernels."""
        with torch.inference_mode():
            for _ in range(max_tokens):
                token = int(self.runner.forward(keep=1)[-1].argmax())
                self.runner.extend([token])
                self.forwards += 1
                yield token
                if token in self.eos_ids:
                    return

    @property
    def ids(self) -> list[int]:
        return self.runner.ids

    @property
    def cached(self) -> int:
        """Tokens of the sequence already in the KV cache."""
        return self.runner.kv_len

    @property
    def pending(self) -> int:
        """Prompt tokens a prefill would still feed (all but the last uncached one)."""
        return self.runner.pending

    def prefill(self, limit: int) -> int:
        """Feed up to `limit` uncached tokens of the sequence (a server bounds how long one call
        holds the model this way); returns how many remain."""
        return self.runner.prefill(limit)

    def scores(self, new: list[int], keep: int) -> torch.Tensor:
        """Append `new` to the sequence and return the logits (keep, V) after its last `keep`
        tokens: scoring without verifying (the server's /v1/completions)."""
        self.runner.extend(new)
        with torch.inference_mode():
            return self.runner.forward(keep=keep)

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
        """proposal (M,) int64; q (M, Vt) draft rows, needed by the rejection modes only. `relax`
        (LOSSY, greedy rules only): (mask (M,) of the proposals that may be accepted without being
        the argmax, top r), see verify.relaxed."""
        base, m = len(self.runner.ids), int(proposal.shape[0])
        self.runner.extend(proposal.tolist())
        try:
            logits = self.runner.forward(keep=m + 1)
            verdict = judge(logits, proposal, rule, q, generator, base, topk=topk, relax=relax)
        except BaseException:  # all or nothing: a failed verify leaves the session as it was
            self.runner.crop(base)
            raise
        self.forwards += 1
        self.runner.crop(base + verdict.accepted)
        self.runner.extend([verdict.token])
        return verdict


class LocalTarget(TargetBase):
    """An HF causal LM in this process, used as a target. Its sessions can decode alone, which a
    latency-objective pairing does where drafting measured slower, prefill a long prompt in pieces
    and return rows of logits (a server's completions)."""

    capabilities = Capabilities(
        in_process=True, decodes_alone=True, prefills_in_chunks=True, scores_positions=True
    )

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name: str = "target",
        *,
        graphs: bool | None = None,
        capacity: int = 4096,
    ) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.token_bytes = build_token_bytes(tokenizer, model.config.vocab_size)
        self.token_bytes.require_byte_coverage(name)
        self.codec = ByteCodec(tokenizer, self.token_bytes)
        self.eos_ids = frozenset(_eos_ids(model, tokenizer))
        self.device = next(model.parameters()).device
        self.context_length: int | None = getattr(model.config, "max_position_embeddings", None)
        if graphs and self.device.type != "cuda":
            raise ValueError(f"graphs=True needs a CUDA device; this target is on {self.device}")
        if graphs and not static_cache_supported(model):
            raise ValueError(
                f"graphs=True: {name} has sliding-window layers, which a static cache cannot crop"
            )
        self.capacity = capacity
        self._graphs = graphs
        self._slot: StaticRunner | None = None
        self._slot_owner: Callable[[], Any] | None = None
        self._slot_lock = threading.Lock()  # two sessions begun at once must not share the slot

    @property
    def generation_config(self) -> Any:
        """The model's own `transformers.GenerationConfig` (None where it has none)."""
        return getattr(self.model, "generation_config", None)

    @property
    def graphs(self) -> bool:
        """Whether sessions verify on a static cache replaying CUDA graphs. Default (graphs=None):
        on a CUDA device where the model allows it and a verify measured faster that way on this
        GPU (once per GPU and model shape, kept; docs/gpu.md)."""
        if self._graphs is None:
            self._graphs = self.device.type == "cuda" and static_cache_supported(self.model)
            if self._graphs:
                config, dtype = self.model.config, next(self.model.parameters()).dtype
                key = "|".join(
                    (
                        torch.cuda.get_device_name(self.device),
                        type(self.model).__name__,
                        f"{config.hidden_size}x{config.num_hidden_layers}",
                        str(dtype),
                    )
                )
                choice = measured.remembered(
                    "target-graphs", key, lambda: measure_graphs(self.model, self.capacity)
                )
                self._graphs = bool(choice["graphs"])
        return self._graphs

    @classmethod
    def load(
        cls,
        spec: str,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        kernels: bool = True,
        graphs: bool | None = None,
        capacity: int = 4096,
    ) -> LocalTarget:
        """Load a target by preset name, .gguf path, local dir or HF id, on `device` ("cpu",
        "cuda", "cuda:1", "mps"; default cpu) in `dtype` ("float32", "bfloat16", "float16" or a
        torch dtype; default float32).

        `kernels` (default): every linear layer runs the kernel measured fastest on this machine
        for each row count (kernels.py), in target-alone decoding and in verification alike, and
        a verify's attention reads the cached keys and values without repeating them per query
        head where that measured faster (attention.py; the same numbers). The weights are
        untouched; False keeps transformers' stock layers everywhere. The kernel plan is measured
        for fp32 on the CPU only: on another device or dtype the stock layers run.

        `graphs` (CUDA): verify and decode on a static KV cache of `capacity` positions whose
        short feeds replay captured CUDA graphs (static_runner.py); None (default) decides by a
        measurement on this GPU, False never, True always. A session that outgrows `capacity`
        moves to a dynamic cache and goes on.
        """
        where, kind = resolve_device(device), resolve_dtype(dtype)
        loaded = load_model(spec, dtype=kind)
        loaded.model.to(where)
        if kernels and where.type == "cpu" and kind == torch.float32:
            use_kernels(loaded.model)
            use_grouped_attention(loaded.model)
        return cls(loaded.model, loaded.tokenizer, loaded.name, graphs=graphs, capacity=capacity)

    def begin(self, prompt_ids: list[int]) -> _LocalSession:
        if not self.graphs:
            return _LocalSession(self.model, prompt_ids, self.eos_ids)
        with self._slot_lock:
            session = _LocalSession(self.model, prompt_ids, self.eos_ids, runner=self._take_slot(prompt_ids))
            if isinstance(session.runner, StaticRunner):
                self._slot_owner = weakref.ref(session)
        return session

    def _take_slot(self, prompt_ids: list[int]) -> StaticRunner | None:
        """The graphed static runner, reset onto `prompt_ids`, unless a live session holds it (then
        the new session runs on a dynamic cache). Under the slot lock."""
        if self._slot_owner is not None and self._slot_owner() is not None:
            return None
        if self._slot is None:
            self._slot = StaticRunner(self.model, prompt_ids, self.capacity, graphs=True)
        else:
            self._slot.reset(prompt_ids)
        return self._slot

    def __repr__(self) -> str:
        return f"LocalTarget({self.name!r}, vocab {len(self.token_bytes)})"


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
