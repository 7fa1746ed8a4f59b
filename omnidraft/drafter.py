"""The drafter: one small LM on the device that proposes tokens for any target.

`Drafter.begin(ids)` opens a draft session over the drafter's view of the committed text;
`propose(k)` drafts up to k tokens (greedy or sampled, optionally restricted to the vocabulary the
target shares) and `commit(keep, tail)` rolls the session back to what the target accepted.

Per-target LoRA adapters (peft) live here, on one frozen base shared by every target: the fp32
peft model holds them, drafting runs on its int8 twin, and training (`learner`) through the twin's
int8 weights emulated in fp32; all three share the same LoRA modules (distill/adapters.py), so a
step is live for drafting at no copy cost. `activate(name)` switches all in milliseconds;
`activate(None)` drafts with the bare base. This module does not know about
targets' tokenizers.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from .draft import Draft, confidence, heal_pick, pick
from .int8 import quantize_int8
from .models import load_model
from .presets import PRESETS
from .runner import CausalRunner
from .translate.codec import ByteCodec
from .translate.token_bytes import build_token_bytes

if TYPE_CHECKING:
    from .adaptive.head import Stopper
    from .shortlist.head import ShortlistHead
    from .distill.adapters import AdapterConfig
    from .pairing import DecodeConfig, Pairing
    from .target import Target

__all__ = ["BACKENDS", "Draft", "DraftSession", "Drafter"]

BACKENDS = ("torch", "llama.cpp", "auto")

log = logging.getLogger("omnidraft")


@runtime_checkable
class DraftSession(Protocol):
    """One generation on a drafter (the protocol an ONNX drafter implements too)."""

    def propose(self, k: int, *, temperature: float = 0.0, allowed: torch.Tensor | None = None,
                generator: torch.Generator | None = None, stop_confidence: float = 0.0,
                stopper: Stopper | None = None, heal: torch.Tensor | None = None) -> Draft: ...

    def commit(self, keep: int, tail: list[int]) -> None: ...


class _TorchDraftSession:
    def __init__(self, model: Any, ids: list[int], stop_ids: frozenset[int], lock: threading.RLock,
                 head: ShortlistHead | None = None) -> None:
        self.runner = CausalRunner(model, ids)
        self.stop_ids = stop_ids
        self.lock = lock
        self.head = head  # a shortlisted LM head: told the draft position, and what the context holds
        self._base = len(ids)
        if head is not None:
            head.policy.begin(list(ids))

    def propose(self, k: int, *, temperature: float = 0.0, allowed: torch.Tensor | None = None,
                generator: torch.Generator | None = None, stop_confidence: float = 0.0,
                stopper: Stopper | None = None, heal: torch.Tensor | None = None) -> Draft:
        """Draft up to k tokens; `allowed` (Vd,) bool restricts sampling to those tokens. `heal`
        (Vd,) bool: the tokens that may replace the context's last token (token healing): when the
        drafter prefers another of them at that position, the draft starts with it (`Draft.healed`).
        Drafting stops after a token the drafter gave less than `stop_confidence` probability (the
        next drafter step would most likely be wasted), or when `stopper` (an acceptance head's
        rule, fed each token's hidden state) says so."""
        if k < 1:
            raise ValueError(f"draft length k must be >= 1, got {k}")
        with self.lock:  # an optimizer step in another thread waits for the draft, and vice versa
            return self._propose(k, temperature, allowed, generator, stop_confidence, stopper, heal)

    def _propose(self, k: int, temperature: float, allowed: torch.Tensor | None, generator: torch.Generator | None,
                 stop_confidence: float, stopper: Stopper | None, heal: torch.Tensor | None) -> Draft:
        self._base = len(self.runner.ids)
        ids, rows, healed = [], [], False
        for step in range(k):
            if self.head is not None:
                self.head.step = step
            if step == 0 and heal is not None and len(self.runner.ids) > 1:
                logits, hidden, token, probs, healed = self._heal_step(heal, temperature, allowed, generator, stopper is not None)
            else:
                logits = _host(self.runner.forward(keep=1, hidden=stopper is not None)[0])
                hidden = _host(self.runner.hidden[0]) if stopper is not None else None
                token, probs = pick(logits, temperature, allowed, generator)
            ids.append(token)
            if probs is not None:
                rows.append(probs)
            self.runner.extend([token])
            halt = stopper is not None and stopper.stop_after(step, token, logits, hidden)
            if halt or token in self.stop_ids or (stop_confidence > 0 and confidence(logits, token, probs) < stop_confidence):
                break
        return Draft(ids, torch.stack(rows) if rows else None, healed)

    def _heal_step(self, heal: torch.Tensor, temperature: float, allowed: torch.Tensor | None,
                   generator: torch.Generator | None, hidden: bool) -> tuple[torch.Tensor, Any, int, torch.Tensor | None, bool]:
        """Step 0 under token healing, from one forward that also gives the logits one position
        back: (logits, hidden state, token, probs, healed) of the first drafted token."""
        logits = _host(self.runner.forward(keep=2, hidden=hidden))
        states = _host(self.runner.hidden) if hidden else (None, None)
        chosen = heal_pick(logits[0], heal, self.runner.ids[-1], temperature, allowed, generator)
        if chosen is None:  # the drafter keeps its last token: draft after it, as usual
            token, probs = pick(logits[1], temperature, allowed, generator)
            return logits[1], states[1], token, probs, False
        self.runner.crop(len(self.runner.ids) - 1)  # a longer token replaces it
        self._base -= 1
        back, token, probs = chosen
        return back, states[0], token, probs, True

    def commit(self, keep: int, tail: list[int]) -> None:
        """Keep the first `keep` drafted tokens, then append `tail` (fed at the next propose)."""
        self.runner.crop(self._base + keep)
        self.runner.extend(tail)
        self._base = len(self.runner.ids)
        if self.head is not None and tail:
            self.head.policy.observe(tail)  # committed text the draft missed (an EvoSpec buffer recalls it)


def _host(t: torch.Tensor) -> torch.Tensor:
    """A drafter's logits or hidden states as the pure drafting functions take them: fp32 on the CPU
    (a no-op for a CPU fp32 drafter; one small copy a drafted token on an accelerator)."""
    return t if t.device.type == "cpu" and t.dtype == torch.float32 else t.float().cpu()


class Drafter:
    """A small causal LM shared by every pairing; per-target state lives in the pairing."""

    def __init__(self, model: Any, tokenizer: Any, name: str = "drafter", *, spec: str | None = None,
                 int8: bool = False, train_through_int8: bool = True) -> None:
        """`model` drafts. With `int8`, it is a quantized copy and training reloads fp32 weights
        from `spec`; otherwise `model` itself is trained when adapters are added.
        `train_through_int8` (int8 only): adapters learn through the int8 weights the drafter
        drafts with (int8.fake_int8: read from the twin, no weight copied); False trains them on
        the fp32 base (kept for comparison: `python -m benchmarks adapt --train-weights fp32`)."""
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.token_bytes = build_token_bytes(tokenizer, model.config.vocab_size)
        self.codec = ByteCodec(tokenizer, self.token_bytes)
        self.stop_ids = frozenset(i for i in (tokenizer.eos_token_id,) if isinstance(i, int))
        self.lock = threading.RLock()
        self._spec, self._int8, self._through_int8 = spec, int8, train_through_int8
        self.twin_spec: str | None = None  # a preset or .gguf whose llama.cpp twin may draft for a pairing
        self.trainable: Any = None  # the fp32 peft model, once an adapter exists
        self.learner: Any = None  # what adapters train through: `trainable`, or the int8 twin emulated
        self.active: str | None = None
        self.head: ShortlistHead | None = None  # the shortlisted LM head, when one is in use

    @classmethod
    def load(cls, spec: str, *, backend: str | None = None, quantize: str | None = "int8",
             train_through_int8: bool = True, threads: int | None = None, shortlist: str | None = None,
             device: str | torch.device | None = None, dtype: str | torch.dtype | None = None) -> Any:
        """Load a drafter by preset name, .gguf path, local dir or HF id.

        `backend`: "torch" (this class: the only one that learns adapters), "llama.cpp" (the GGUF
        file itself under llama.cpp: a preset or .gguf path; `threads` its thread count), or "auto":
        whichever of the installed backends drafts a token fastest on this machine, timed once and
        remembered per machine (backends.py). None (default): this class, whose pairings draft
        through the GGUF file's llama.cpp twin where that is faster here and they need nothing
        only this class has (`backends.drafting_twin`); "torch" keeps every pairing on PyTorch.
        `quantize="int8"` (torch, default) applies dynamic int8 to its linear layers (int8.py:
        per-channel, MLPs smoothed): about 3x faster per token on CPU. It changes only what is
        proposed, never what the target commits. `train_through_int8`: see `__init__`.
        `shortlist` (torch): evaluate the LM head on part of the vocabulary only, "static",
        "evo" or "dyna" (see `use_shortlist`). `device` / `dtype` (torch): where and in what the
        weights live, as `LocalTarget.load` takes them; int8 applies to a CPU fp32 drafter only.
        """
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"drafter backend must be one of {BACKENDS}, got {backend!r}")
        from .target import resolve_device, resolve_dtype

        where, kind = resolve_device(device), resolve_dtype(dtype)
        if (where.type != "cpu" or kind != torch.float32) and backend not in (None, "torch"):
            raise ValueError(f"device and dtype apply to the torch backend, not {backend!r}")
        if backend == "auto":
            from .backends import fastest_drafter

            return fastest_drafter(spec, lambda name: cls.load(spec, backend=name, quantize=quantize,
                                                               train_through_int8=train_through_int8, threads=threads))
        if backend == "llama.cpp":
            from .llamacpp.drafter import LlamaCppDrafter

            return LlamaCppDrafter(spec, threads=threads)
        if quantize not in (None, "int8"):
            raise ValueError(f"drafter quantize must be None or 'int8', got {quantize!r}")
        plain = where.type == "cpu" and kind == torch.float32
        quantize = quantize if plain else None
        loaded = load_model(spec, dtype=kind)
        loaded.model.to(where)
        model = quantize_int8(loaded.model, loaded.tokenizer, inplace=True) if quantize == "int8" else loaded.model
        drafter = cls(model, loaded.tokenizer, loaded.name, spec=spec, int8=quantize == "int8",
                      train_through_int8=train_through_int8)
        if backend is None and plain and (spec in PRESETS or str(spec).endswith(".gguf")):
            drafter.twin_spec = spec
        if shortlist not in (None, "full"):
            drafter.use_shortlist(shortlist)
        return drafter

    def llama_twin(self) -> Any:
        """This drafter's GGUF file (`twin_spec`) under llama.cpp, loaded once; None where it cannot run."""
        if "_twin" not in self.__dict__:
            from .llamacpp.drafter import LlamaCppDrafter

            try:
                self._twin = LlamaCppDrafter(self.twin_spec, tokenizer=self.tokenizer) if self.twin_spec else None
                if self._twin is not None:
                    self._twin.pytorch = self  # the drafter it stands in for (HF peers need its model)
            except Exception as exc:  # noqa: BLE001 - a file llama.cpp cannot run leaves this drafter
                log.info("%s: no llama.cpp twin (%s); drafting on PyTorch", self.name, exc)
                self._twin = None
        return self._twin

    @property
    def hidden_size(self) -> int:
        """Width of the hidden state an acceptance head reads."""
        return int(self.model.config.hidden_size)

    @staticmethod
    def load_onnx(path: str, *, threads: int | None = None) -> Any:
        """An exported drafter (`omnidraft export`) running on onnxruntime; pairs like this class."""
        from .export.ort_drafter import OrtDrafter

        return OrtDrafter.load(path, threads=threads)

    def begin(self, ids: list[int]) -> _TorchDraftSession:
        return _TorchDraftSession(self.model, ids, self.stop_ids, self.lock, self.head)

    def use_shortlist(self, kind: str | None, **options: Any) -> None:
        """Draft from part of the vocabulary: "static" (the most frequent tokens: FR-Spec), "evo"
        (those plus a buffer recalled from the context: EvoSpec), "dyna" (a router picks clusters
        of the head's rows per position: DynaSpec); None or "full" for the whole head. Built once
        per tokenizer and cached (shortlist/build.py); `options` go to `shortlist.build.shortlist`.
        Verification is unchanged: drafts come from the drafter's distribution on the support."""
        from .shortlist.build import shortlist
        from .shortlist.head import ShortlistHead, install

        with self.lock:
            if kind in (None, "full"):
                current = self.model.get_output_embeddings()
                if isinstance(current, ShortlistHead):
                    self.model.set_output_embeddings(current.full)
                self.head = None
                return
            self.head = install(self.model, shortlist(self, kind, **options))

    def fp32_model(self) -> Any:
        """The drafter's fp32 weights (this model, or reloaded from the spec for an int8 drafter)."""
        if not self._int8:
            return self.model
        if self._spec is None:
            raise ValueError("this int8 drafter was built without a spec to reload fp32 weights from")
        return load_model(self._spec).model

    def pair(self, target: Target, config: DecodeConfig | None = None, **options: Any) -> Pairing:
        """Pair this drafter with `target`: see `omnidraft.pairing.pair` (user, learn, overrides)."""
        from .pairing import pair

        return pair(self, target, config, **options)

    # -- adapters ------------------------------------------------------------------------------

    @staticmethod
    def adapter_name(target: str, user: str | None) -> str:
        """A peft-safe adapter name for a (target, user) pairing, injective: a readable prefix plus a
        hash of the exact pair, so users "a.b", "a_b" and "a-b" never share an adapter, nor does
        the anonymous pairing (user None) share one with any named user ("default" included)."""
        exact = f"{target}\0{chr(1) if user is None else chr(2) + user}".encode()
        readable = re.sub(r"[^A-Za-z0-9]", "_", f"{target}__{'anonymous' if user is None else user}")[:48]
        return f"{readable}_{hashlib.sha256(exact).hexdigest()[:16]}"

    def add_adapter(self, name: str, config: AdapterConfig | None = None,
                    state: dict[str, torch.Tensor] | None = None) -> None:
        """Create adapter `name` (fresh, or loaded from `state`) if it does not exist yet."""
        from .distill.adapters import AdapterConfig, add_adapter, covers, int8_learner, int8_twin, load_adapter_state

        with self.lock:
            if self.trainable is not None and name in self.trainable.peft_config:
                return
            base, first = self.trainable, self.trainable is None
            if first:
                if self._int8 and self._spec is None:
                    raise ValueError("this int8 drafter was built without a spec to reload fp32 weights from")
                base = load_model(self._spec).model if self._int8 else self.model
                for p in base.parameters():
                    p.requires_grad_(False)
            self.trainable = add_adapter(base, name, config or AdapterConfig())
            if state is not None:
                load_adapter_state(self.trainable, name, state)
            if not self._int8:
                self.model = self.learner = self.trainable
            elif first or not covers(self.model, self.trainable):  # (LoRA layers on new projections: rebuild)
                self.model = int8_twin(self.trainable, self.tokenizer)
                self.learner = int8_learner(self.model) if self._through_int8 else self.trainable
                if self.head is not None:  # the twin's head holds the same int8 rows: the blocks stay valid
                    from .shortlist.head import install

                    self.head = install(self.model, self.head.policy)
            # else the twin and learner already share the new adapter's modules: no second int8 copy
            self.active = None
            self.activate(name)

    def activate(self, name: str | None) -> None:
        """Draft (and train) with adapter `name`, or with the bare base for None."""
        if name == self.active:
            return
        from .distill.adapters import set_active

        with self.lock:
            if self.trainable is None:
                if name is not None:
                    raise KeyError(f"no adapter {name!r}: this drafter has none yet")
                return
            for model in {id(m): m for m in (self.trainable, self.model, self.learner)}.values():
                if name is None:
                    model.base_model.disable_adapter_layers()
                    continue
                if self.active is None:  # (from one adapter to another the layers are on already: a walk saved)
                    model.base_model.enable_adapter_layers()
                set_active(model, name, grads=model is self.trainable)  # (the others share its LoRA parameters)
            self.active = name

    def __repr__(self) -> str:
        return f"Drafter({self.name!r}, vocab {len(self.token_bytes)})"
