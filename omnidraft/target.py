"""The target side: the `Target` protocol and `LocalTarget`, an HF model in this process.

A target session holds the committed target tokens and the target's KV cache. `verify` runs one
forward over the pending token and the proposal, applies the acceptance rule from `verify.py`,
keeps the accepted tokens in the cache (rollback of the rest) and appends the emitted token. A
remote target implements the same protocol over HTTP.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import torch

from . import measured
from . import verify as V
from .attention import use_grouped_attention
from .causal_runner import CausalRunner
from .kernels import use_kernels
from .models import load_model
from .static_runner import StaticRunner, measure_graphs, static_cache_supported
from .translate.codec import ByteCodec
from .translate.token_bytes import TokenBytes, build_token_bytes

__all__ = ["LocalTarget", "Rule", "Target", "TargetSession", "judge", "resolve_device", "resolve_dtype"]

MODES = ("greedy", "match", "exact", "omnidraft")
MIN_TEMPERATURE = 1e-3  # sampling temperatures below this overflow exp(logits / T)


@dataclass(frozen=True, kw_only=True)
class Rule:
    """How proposals are accepted: `mode` (see verify.py) at `temperature` (0 for greedy). Sampling
    modes draw from the target's distribution filtered by `top_k`, `top_p` and `min_p` (as HF and
    vLLM apply them), which verification then reproduces exactly; greedy ignores them. With `seed`,
    `match` draws the sample at each position from a generator keyed by (seed, position), so the
    output depends on the seed alone, not on how drafting split it into rounds."""

    mode: str = "greedy"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63
        ):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.mode not in MODES:
            raise ValueError(f"verification mode must be one of {MODES}, got {self.mode!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature != 0 and not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}: "
                "a smaller one overflows the softmax"
            )
        if (self.mode == "greedy") != (self.temperature == 0):
            raise ValueError(
                f"mode {self.mode!r} with temperature {self.temperature}: greedy needs temperature 0, "
                "sampling modes need temperature > 0"
            )


@runtime_checkable
class TargetSession(Protocol):
    """One generation on a target. `ids` are the committed target tokens (prompt included)."""

    ids: list[int]

    def verify(
        self,
        proposal: torch.Tensor,
        rule: Rule,
        q: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        *,
        topk: int = 0,
    ) -> V.Verdict:
        """Accept a prefix of `proposal` and emit one token; with `topk` > 0 the verdict carries
        the target's top-k log-probabilities at every committed position (see Verdict)."""
        ...


@runtime_checkable
class Target(Protocol):
    """Anything that can verify: a tokenizer's byte view plus sessions."""

    name: str
    tokenizer: Any
    token_bytes: TokenBytes
    codec: ByteCodec
    eos_ids: frozenset[int]

    def begin(self, prompt_ids: list[int]) -> TargetSession: ...


class _LocalSession:
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

    def prefill(self, most: int) -> int:
        """Feed up to `most` uncached tokens of the sequence (a server bounds how long one call
        holds the model this way); returns how many remain."""
        return self.runner.prefill(most)

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
    ) -> V.Verdict:
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


def judge(
    logits: torch.Tensor,
    proposal: torch.Tensor,
    rule: Rule,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
    base: int,
    *,
    topk: int = 0,
    relax: tuple[torch.Tensor, int] | None = None,
) -> V.Verdict:
    """The verdict on `proposal` (M,) from the target's logits (M + 1, V) after the pending token
    and after each proposed one; `base` is the proposal's first position. Every in-process target
    (PyTorch, llama.cpp) verifies through this one function. Logits on an accelerator stay there
    for greedy verification; the sampling rules, whose generators live on the CPU, read them there."""
    if logits.device != proposal.device:
        if rule.mode == "greedy" and relax is None:
            proposal = proposal.to(logits.device)
        else:
            logits = logits.float().cpu()
    if relax is not None:
        if rule.mode != "greedy":
            raise ValueError(f"relaxed verification is a greedy rule; got mode {rule.mode!r}")
        verdict = V.relaxed(logits, proposal, relax[0], relax[1])
    else:
        verdict = _judge(logits, proposal, rule, q, generator, base)
    if topk > 0:
        full = torch.log_softmax(logits[: verdict.accepted + 1].float(), -1)
        logp, ids = full.topk(topk, dim=-1)
        committed = proposal[: verdict.accepted].tolist() + [verdict.token]
        chosen = full.gather(-1, torch.tensor(committed, device=full.device)[:, None])[:, 0]
        verdict = replace(verdict, topk=(ids.cpu(), logp.cpu()), chosen=chosen.cpu())
    return verdict


def _judge(
    logits: torch.Tensor,
    proposal: torch.Tensor,
    rule: Rule,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
    base: int = 0,
) -> V.Verdict:
    if rule.mode == "greedy":
        return V.greedy(logits, proposal)
    probs = V.probabilities(logits, rule.temperature, top_k=rule.top_k, top_p=rule.top_p, min_p=rule.min_p)
    if rule.mode == "match" and rule.seed is not None:  # position-keyed: independent of the round split
        return V.match(probs, proposal, keys=[(rule.seed, base + i) for i in range(len(proposal) + 1)])
    if rule.mode == "match" or len(proposal) == 0:
        return V.match(probs, proposal, generator)
    if q is None:
        raise ValueError(f"mode {rule.mode!r} needs the draft rows q")
    return V.rejection(probs, q, proposal, generator)


class LocalTarget:
    """An HF causal LM in this process, used as a target. Its sessions can decode alone
    (`generates_alone`): a latency-objective pairing does so where drafting measured slower."""

    generates_alone = True
    in_process = True  # a round without a draft costs what decoding one token alone costs

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


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A torch dtype from a name or a dtype; None is float32."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be one of {sorted(set(DTYPES))} or a torch dtype among them, got {dtype!r}")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch device that exists here; None is the CPU. An absent accelerator is named in the error."""
    try:
        where = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}") from exc
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device is available here (torch {torch.__version__})")
    if where.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS is not available here")
    if where.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}")
    return where


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
