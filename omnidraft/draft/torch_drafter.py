"""`TorchDrafter`: the drafter on PyTorch (int8 by default on a CPU), the one that learns.

Per-target LoRA adapters (peft) live here, on one frozen base shared by every target: the fp32
peft model holds them, drafting runs on its int8 copy, and training (`learner`) through the copy's
int8 weights emulated in fp32; all three share the same LoRA modules (distill/adapters.py), so a
step is live for drafting at no copy cost. `activate(name)` switches all in milliseconds;
`activate(None)` drafts with the bare base. This module does not know about targets' tokenizers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..distill.merged import MergedDrafting
from ..runtime.causal_runner import CausalRunner
from ..runtime.int8 import quantize_int8
from ..store.models import load_model
from ..store.presets import PRESETS
from .base import Drafter

if TYPE_CHECKING:
    from ..distill.adapters import AdapterConfig
    from ..shortlist.shortlisted_head import ShortlistHead

__all__ = ["TorchDrafter", "TorchStream"]

log = logging.getLogger("omnidraft")


class TorchStream:
    """A `Stream` on a PyTorch model (int8 or not): a `CausalRunner` and its KV cache. With
    `model_for`, each forward runs on the model it returns then (the drafter's adapter may change
    between two forwards of one stream: an optimizer step, another adapter activated)."""

    gives_hidden = True

    def __init__(self, model: Any, ids: list[int], model_for: Callable[[], Any] | None = None) -> None:
        self.runner = CausalRunner(model, ids)
        self.ids = self.runner.ids  # (the same list: the runner extends and crops it in place)
        self.model_for = model_for

    def extend(self, ids: list[int]) -> None:
        self.runner.extend(ids)

    def crop(self, n: int) -> None:
        self.runner.crop(n)

    def logits(self, rows: int = 1, *, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.model_for is not None:
            self.runner.model = self.model_for()
        logits = _host(self.runner.forward(keep=rows, hidden=hidden))
        return logits, _host(self.runner.hidden) if hidden else None


def _host(t: torch.Tensor) -> torch.Tensor:
    """A drafter's logits or hidden states as the pure drafting functions take them: fp32 on the CPU
    (a no-op for a CPU fp32 drafter; one small copy a drafted token on an accelerator)."""
    return t if t.device.type == "cpu" and t.dtype == torch.float32 else t.float().cpu()


class TorchDrafter(Drafter, name="torch"):
    """A small causal LM on PyTorch; the only backend with adapters, acceptance heads and every
    shortlist. `Drafter.load(spec)` builds one."""

    learns = True
    backend = "PyTorch"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name: str = "drafter",
        *,
        spec: str | None = None,
        int8: bool = False,
        train_through_int8: bool = True,
    ) -> None:
        """`model` drafts. With `int8`, it is a quantized copy and training reloads fp32 weights
        from `spec`; otherwise `model` itself is trained when adapters are added.
        `train_through_int8` (int8 only): adapters learn through the int8 weights the drafter
        drafts with (int8.fake_int8: read from the copy, no weight copied); False trains them on
        the fp32 base (kept for comparison: `python -m benchmarks adapt --train-weights fp32`)."""
        self.model, self.name = model, name
        self._init_vocabulary(tokenizer, model.config.vocab_size)
        self.hidden_size = int(model.config.hidden_size)
        self.spec, self.int8, self._through_int8 = spec, int8, train_through_int8
        self.gguf_spec: str | None = None  # a preset or .gguf whose llama.cpp copy may draft for a pairing
        self.trainable: Any = None  # the fp32 peft model, once an adapter exists
        self.learner: Any = None  # what adapters train through: `trainable`, or the int8 copy emulated
        self.active: str | None = None
        self.head: ShortlistHead | None = None  # the shortlisted LM head, when one is in use
        self._merged = MergedDrafting()  # what drafts once adapters exist (see `drafting_model`)
        self.merge_adapters = True  # False: draft through peft's LoRA layers (Test-Time Speculation)

    @classmethod
    def from_spec(
        cls,
        spec: str,
        *,
        quantize: str | None = "int8",
        train_through_int8: bool = True,
        shortlist: str | None = None,
        device: torch.device = torch.device("cpu"),
        dtype: torch.dtype = torch.float32,
        llama_copy: bool = True,
        **_: Any,
    ) -> TorchDrafter:
        """See `Drafter.load`; `llama_copy`: pairings may draft through the GGUF file's llama.cpp copy.
        int8 applies to a CPU fp32 drafter only."""
        if quantize not in (None, "int8"):
            raise ValueError(f"drafter quantize must be None or 'int8', got {quantize!r}")
        plain = device.type == "cpu" and dtype == torch.float32
        quantize = quantize if plain else None
        loaded = load_model(spec, dtype=dtype)
        loaded.model.to(device)
        model = (
            quantize_int8(loaded.model, loaded.tokenizer, inplace=True)
            if quantize == "int8"
            else loaded.model
        )
        drafter = cls(
            model,
            loaded.tokenizer,
            loaded.name,
            spec=spec,
            int8=quantize == "int8",
            train_through_int8=train_through_int8,
        )
        if llama_copy and plain and (spec in PRESETS or str(spec).endswith(".gguf")):
            drafter.gguf_spec = spec
        if shortlist not in (None, "full"):
            drafter.use_shortlist(shortlist)
        return drafter

    def stream(self, ids: list[int]) -> TorchStream:
        return TorchStream(self.model, ids, self.drafting_model)

    def drafting_model(self) -> Any:
        """What drafts now: `model`, or once adapters exist, the active one merged into a copy of its
        projections (distill/merged.py: the bare drafter's speed, not peft's LoRA layers'), unless
        `merge_adapters` is off."""
        with self.lock:
            if self.trainable is None or not self.merge_adapters:
                return self.model
            return self._merged.model(self.model, self.active)

    @property
    def cost_key(self) -> str:
        return f"{super().cost_key}|int8 {self.int8}"

    def llama_copy(self) -> Any:
        """This drafter's GGUF file (`gguf_spec`) under llama.cpp, loaded once; None where it cannot run."""
        if "_llama_copy" not in self.__dict__:
            from ..llamacpp.drafting import LlamaCppDrafter

            try:
                self._llama_copy = (
                    LlamaCppDrafter(self.gguf_spec, tokenizer=self.tokenizer) if self.gguf_spec else None
                )
                if self._llama_copy is not None:
                    self._llama_copy.pytorch = self  # the drafter it stands in for (HF peers need its model)
            except Exception as exc:  # noqa: BLE001 - a file llama.cpp cannot run leaves this drafter
                log.info("%s: no llama.cpp copy (%s); drafting on PyTorch", self.name, exc)
                self._llama_copy = None
        return self._llama_copy

    def use_shortlist(self, kind: str | None, **options: Any) -> None:
        """Draft from part of the vocabulary: "static" (the most frequent tokens: FR-Spec), "evo"
        (those plus a buffer recalled from the context: EvoSpec), "dyna" (a router picks clusters
        of the head's rows per position: DynaSpec); None or "full" for the whole head. Built once
        per tokenizer and cached (shortlist/build.py); `options` go to `shortlist.build.shortlist`.
        Verification is unchanged: drafts come from the drafter's distribution on the support."""
        from ..shortlist.build import shortlist
        from ..shortlist.shortlisted_head import ShortlistHead, install

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
        if not self.int8:
            return self.model
        if self.spec is None:
            raise ValueError("this int8 drafter was built without a spec to reload fp32 weights from")
        return load_model(self.spec).model

    # -- adapters ------------------------------------------------------------------------------

    def add_adapter(
        self, name: str, config: AdapterConfig | None = None, state: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Create adapter `name` (fresh, or loaded from `state`) if it does not exist yet."""
        from ..distill.adapters import (
            AdapterConfig,
            add_adapter,
            covers,
            int8_copy,
            int8_learner,
            load_adapter_state,
        )

        with self.lock:
            if self.trainable is not None and name in self.trainable.peft_config:
                return
            base, first = self.trainable, self.trainable is None
            if first:
                base = self.model
                if self.int8:
                    if self.spec is None:
                        raise ValueError(
                            "this int8 drafter was built without a spec to reload fp32 weights from"
                        )
                    base = load_model(self.spec).model
                for p in base.parameters():
                    p.requires_grad_(False)
            self.trainable = add_adapter(base, name, config or AdapterConfig())
            if state is not None:
                load_adapter_state(self.trainable, name, state)
            if not self.int8:
                self.model = self.learner = self.trainable
            elif first or not covers(self.model, self.trainable):  # (LoRA layers on new projections: rebuild)
                self.model = int8_copy(self.trainable, self.tokenizer)
                self.learner = int8_learner(self.model) if self._through_int8 else self.trainable
                if self.head is not None:  # the copy's head holds the same int8 rows: the blocks stay valid
                    from ..shortlist.shortlisted_head import install

                    self.head = install(self.model, self.head.policy)
            # else the copy and learner already share the new adapter's modules: no second int8 copy
            self.active = None
            self.activate(name)

    def activate(self, name: str | None) -> None:
        """Draft (and train) with adapter `name`, or with the bare base for None."""
        if name == self.active:
            return
        from ..distill.adapters import set_active

        with self.lock:
            if self.trainable is None:
                if name is not None:
                    raise KeyError(f"no adapter {name!r}: this drafter has none yet")
                return
            for model in {id(m): m for m in (self.trainable, self.model, self.learner)}.values():
                if name is None:
                    model.base_model.disable_adapter_layers()
                    continue
                if (
                    self.active is None
                ):  # (from one adapter to another the layers are on already: a walk saved)
                    model.base_model.enable_adapter_layers()
                set_active(
                    model, name, grads=model is self.trainable
                )  # (the others share its LoRA parameters)
            self.active = name
