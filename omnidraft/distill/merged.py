"""Drafting with an adapter at the bare drafter's speed: the active LoRA adapter merged into copies
of the adapted projections, kept in step with the adapter's tensors.

peft's LoRA layer adds two small matmuls and its own Python to every adapted projection of every
forward; a one-token draft is a few small matmuls per layer, so that costs a drafted token far more
than the adapter's arithmetic (docs/personalization.md, "What it costs the device"). Drafting needs
the adapter's function, not its structure: `MergedDrafting.model(peft_model, name)` gives the HF
model under peft with each LoRA layer replaced by a plain projection holding W + scale * B @ A
(re-quantized per channel where the base is an int8 dynamic linear, as `quantize_int8` quantizes it:
`int8_weight`; in the base's dtype where it is an `nn.Linear`), every other tensor shared with
`peft_model`. The module tree is copied once per drafting model; an adapter's merged projections
are built when it drafts first and again when its tensors change (PyTorch's in-place version
counters say when: an optimizer step, a loaded state, Test-Time Speculation's fast steps and their
undoing), so a step is live for the next draft as it is through the LoRA layers (the learner builds
them after its step, so no reply waits for them). The last `KEEP` adapters' projections are kept,
so users taking turns on one drafter do not rebuild them each request. A projection the adapter
leaves unchanged (B = 0), and every one with no adapter (`name` None), is the base's own.

What this is not: training goes on through the LoRA layers (`TorchDrafter.learner`). Merging
changes drafts by int8 rounding only; the target decides what is committed. A layer peft builds
another way (DoRA, a LoRA bias, another base type) leaves the peft model drafting as before.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from ..runtime.int8 import int8_weight

__all__ = ["KEEP", "MergedDrafting"]

KEEP = 4  # adapters whose merged projections are kept (int8 SmolLM2, attention: about 27 MB each)


class MergedDrafting:
    """The drafting model with one adapter merged in, for one peft drafting model at a time."""

    def __init__(self) -> None:
        self._source: Any = None  # the peft model the shell below was copied from
        self._shell: Any = None  # its HF model with a plain projection where each LoRA layer was
        self._slots: list[tuple[nn.Module, str, Any]] = []  # (parent in the shell, child name, LoRA layer)
        self._base: list[tuple[torch.Tensor, torch.Tensor | None] | None] = []  # int8 bases, unpacked
        self._built: OrderedDict[str | None, tuple[tuple[Any, ...], list[nn.Module]]] = OrderedDict()
        self._tensors: dict[str, tuple[Any, list[torch.Tensor]]] = {}  # adapter: (its config, A and B's)
        self._placed: tuple[Any, ...] | None = None  # (name, key) of the projections in the shell now

    def model(self, source: Any, name: str | None) -> Any:
        """`source` (a peft model) drafting with adapter `name` merged in (None: the bare base);
        `source` itself where a layer cannot be merged."""
        if source is not self._source:
            self._build(source)
        if self._shell is None:
            return source
        key = self._key(source, name)
        built = self._built.get(name)
        if built is None or built[0] != key:
            old = built[1] if built is not None else [None] * len(self._slots)
            with torch.no_grad():
                built = key, [self._merge(i, name, into) for i, into in enumerate(old)]
            self._built[name] = built
            while len(self._built) > KEEP:
                self._built.popitem(last=False)
        self._built.move_to_end(name)
        if self._placed != (name, key):
            for (parent, child, _), projection in zip(self._slots, built[1]):
                setattr(parent, child, projection)
            self._placed = (name, key)
        head = source.get_output_embeddings()  # (a shortlisted head installed later drafts here too)
        if self._shell.get_output_embeddings() is not head:
            self._shell.set_output_embeddings(head)
        return self._shell

    def _key(self, source: Any, name: str | None) -> tuple[Any, ...]:
        """What `name`'s merged projections depend on: its config and its tensors' in-place versions."""
        if name is None:
            return ()
        config = source.peft_config.get(name)
        if name not in self._tensors or self._tensors[name][0] is not config:
            self._tensors[name] = (config, _adapter_tensors(self._slots, name))
        return (id(config), *(t._version for t in self._tensors[name][1]))

    def _build(self, source: Any) -> None:
        from peft.tuners.lora import LoraLayer
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

        self._source, self._shell, self._slots, self._base = source, None, [], []
        self._built.clear()
        self._tensors.clear()
        self._placed = None
        base = source.get_base_model()
        layers: dict[str, Any] = {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
        if not layers or not all(_mergeable(m) for m in layers.values()):
            return
        inner = {id(m) for layer in layers.values() for m in layer.modules()}
        shared = {
            id(t): t
            for t in itertools.chain(
                base.parameters(),
                base.buffers(),
                (m for m in base.modules() if isinstance(m, DynamicLinear) and id(m) not in inner),
            )
        }
        shell = copy.deepcopy(base, shared)  # the module tree only: every tensor stays the same object
        for path, layer in layers.items():
            parent, _, child = path.rpartition(".")
            self._slots.append((shell.get_submodule(parent) if parent else shell, child, layer))
            bottom = layer.base_layer
            self._base.append((bottom.weight(), bottom.bias()) if isinstance(bottom, DynamicLinear) else None)
        self._shell = shell.eval()

    def _merge(self, i: int, name: str | None, into: nn.Module | None) -> nn.Module:
        """Slot `i`'s projection with adapter `name` added (the base's own where it adds nothing),
        written into `into` (the one built before, if any: packing a new module costs more)."""
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

        _, _, layer = self._slots[i]
        bottom = layer.base_layer
        if name is None or name not in layer.lora_A or not bool(layer.lora_B[name].weight.any()):
            return bottom
        delta = layer.get_delta_weight(name)
        into = None if into is bottom else into
        if (unpacked := self._base[i]) is not None:
            weight, bias = unpacked
            if into is None:
                into = DynamicLinear(
                    bottom.in_features, bottom.out_features, bias_=bias is not None, dtype=torch.qint8
                )
            merged = int8_weight(weight.dequantize() + delta.float())  # the base's own rule, re-applied
            into.set_weight_bias(merged, bias)  # type: ignore[operator]
            return into
        if into is None:
            into = copy.deepcopy(bottom).requires_grad_(False)
        assert isinstance(into, nn.Linear) and isinstance(bottom, nn.Linear)
        into.weight.copy_(bottom.weight + delta.to(bottom.weight.dtype))
        return into


def _mergeable(layer: Any) -> bool:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    flags = [getattr(layer, attr, {}) for attr in ("use_dora", "lora_bias")]
    variants = getattr(layer, "lora_variant", {})
    return (
        type(layer.base_layer) in (nn.Linear, DynamicLinear)
        and not getattr(layer, "fan_in_fan_out", False)
        and not any(any(flag.values()) for flag in flags)
        and not any(v is not None for v in variants.values())
    )


def _adapter_tensors(slots: list[tuple[nn.Module, str, Any]], name: str) -> list[torch.Tensor]:
    """Adapter `name`'s A and B weights over the slots' LoRA layers (those it has)."""
    return [
        t
        for _, _, layer in slots
        if name in layer.lora_A
        for t in (layer.lora_A[name].weight, layer.lora_B[name].weight)
    ]
