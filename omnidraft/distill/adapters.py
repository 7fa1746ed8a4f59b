"""Per-target LoRA adapters (peft) on the shared, frozen drafter, and an int8 drafting copy.

Training needs the fp32 drafter with peft LoRA layers; drafting is twice as fast on the int8 base
(int8.quantize_int8). `int8_copy` builds the drafting copy: every base linear is quantized, and
every LoRA module is *the same object* as in the training model, so an optimizer step is live for
drafting at no copy cost and switching targets is `set_adapter` on both. The per-adapter tables
(rank, scale, dropout) and the adapter configs are shared too, so an adapter added to the training
model later is in the copy at once (`covers` says when it is not: one on projections the copy has
no LoRA layer on), and a new target costs no second quantized copy. `int8_learner` is what the
adapters train through: the copy's int8 weights computed in fp32, with the same LoRA modules.
Only adapter parameters ever require gradients; the base weights are shared by all targets.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..store.atomic import atomic_path, recover

__all__ = [
    "AdapterConfig",
    "add_adapter",
    "adapter_state",
    "covers",
    "int8_learner",
    "int8_copy",
    "load_adapter_state",
    "load_peft",
    "save_peft",
    "set_active",
]

PEFT_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True, kw_only=True)
class AdapterConfig:
    """LoRA rank and scale, and which projections get adapters (attention by default)."""

    rank: int = 32
    alpha: int = 64
    modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha < 1:
            raise ValueError(f"LoRA rank and alpha must be >= 1, got rank={self.rank}, alpha={self.alpha}")
        if not self.modules:
            raise ValueError("LoRA needs at least one target module name")


def add_adapter(model: Any, name: str, config: AdapterConfig = AdapterConfig()) -> Any:
    """Add adapter `name` (a fresh LoRA, B = 0 so the drafter is unchanged) and make it active.

    `model` is a plain HF model (it is wrapped by peft) or a peft model from an earlier call.
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules=list(config.modules),
        lora_dropout=0.0,
        bias="none",
    )
    if isinstance(model, PeftModel):
        model.add_adapter(name, lora)
    else:
        with warnings.catch_warnings():  # peft reads an attribute newer transformers deprecate
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            model = get_peft_model(model, lora, adapter_name=name)
    set_active(model, name)
    return model


def set_active(model: Any, name: str, *, grads: bool = True) -> None:
    """Make `name` the active adapter; with `grads`, only its parameters require gradients (a model
    sharing its LoRA parameters with one already set, such as a copy, can skip that walk)."""
    if name not in model.peft_config:
        raise KeyError(f"no adapter {name!r}; this drafter has {sorted(model.peft_config)}")
    model.set_adapter(name)
    if grads:
        for pname, param in model.named_parameters():
            param.requires_grad_(f".{name}." in pname and "lora_" in pname)


def adapter_state(model: Any, name: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors (what a profile saves)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}


def config_from_state(state: dict[str, torch.Tensor]) -> AdapterConfig:
    """The LoRA shape a saved state was made with: rank and modules from its tensors, alpha from its
    "meta.alpha" entry (written by `Pairing.save`; 2 x rank, the default ratio, if absent)."""
    ranks = {int(v.shape[0]) for k, v in state.items() if "lora_A" in k}
    if len(ranks) != 1:
        raise ValueError(f"adapter state has no single LoRA rank (found {sorted(ranks)})")
    rank = ranks.pop()
    modules = sorted({part for k in state if "lora_" in k for part in k.split(".") if part.endswith("_proj")})
    alpha = int(state["meta.alpha"]) if "meta.alpha" in state else 2 * rank
    return AdapterConfig(rank=rank, alpha=alpha, modules=tuple(modules))


def load_adapter_state(model: Any, name: str, state: dict[str, torch.Tensor]) -> None:
    """Load tensors saved by `adapter_state` into adapter `name`."""
    from peft import set_peft_model_state_dict

    state = {k: v for k, v in state.items() if not k.startswith("meta.")}
    result = set_peft_model_state_dict(model, state, adapter_name=name)
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unexpected:
        raise ValueError(f"adapter state does not fit this drafter: unexpected keys {unexpected[:3]}")


def save_peft(model: Any, name: str, directory: str | os.PathLike[str], *, base: str | None = None) -> Path:
    """Adapter `name` of peft model `model` as a peft adapter directory (adapter_config.json and
    adapter_model.safetensors, what `PeftModel.from_pretrained` reads), written whole into a
    temporary directory and renamed into place, so a crash leaves the old directory or the new one.
    `base`: the base model's portable name (a preset or HF id) recorded as `base_model_name_or_path`
    instead of this machine's cache path, so the directory loads on another machine."""
    import copy

    from safetensors.torch import save

    final = Path(directory)
    state = {k: v.contiguous() for k, v in adapter_state(model, name).items()}
    config = copy.copy(model.peft_config[name])
    if base is not None:
        config.base_model_name_or_path = base
    with atomic_path(final, directory=True) as tmp:
        config.save_pretrained(str(tmp))
        (tmp / PEFT_WEIGHTS).write_bytes(save(state, metadata={"format": "pt"}))
    return final


def load_peft(directory: str | os.PathLike[str]) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """A peft LoRA adapter directory (any tool's) as (config, tensors) for `add_adapter`; an error
    names what is missing or unsupported."""
    from safetensors.torch import load_file

    path = recover(directory)  # a save killed mid-replace left the previous adapter aside
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path}: no adapter_config.json here; not a peft adapter directory")
    doc = json.loads(config_file.read_text(encoding="utf-8"))
    if doc.get("peft_type") != "LORA":
        raise ValueError(f"{path}: a {doc.get('peft_type')!r} adapter; only LoRA adapters fit a drafter")
    modules = doc.get("target_modules")
    if not isinstance(modules, list) or not modules:
        raise ValueError(f"{path}: target_modules must be a list of module names, got {modules!r}")
    if not (path / PEFT_WEIGHTS).is_file():
        raise FileNotFoundError(f"{path}: no {PEFT_WEIGHTS} (only safetensors weights are read)")
    config = AdapterConfig(rank=int(doc["r"]), alpha=int(doc["lora_alpha"]), modules=tuple(sorted(modules)))
    return config, {**load_file(str(path / PEFT_WEIGHTS)), "meta.alpha": torch.tensor(config.alpha)}


def int8_copy(model: Any, tokenizer: Any | None = None) -> Any:
    """An int8 copy of a peft model for drafting that shares its LoRA modules (see module doc);
    with `tokenizer`, its MLPs are smoothed before quantizing (int8.py)."""
    from ..runtime.int8 import quantize_int8

    drafting = _share_lora(copy.deepcopy(model), model)
    base_linears = {
        n for n, m in drafting.named_modules() if type(m) is torch.nn.Linear and ".lora_" not in n
    }
    return quantize_int8(drafting, tokenizer, inplace=True, only=base_linears)


def int8_learner(drafting: Any) -> Any:
    """The model to train an int8 copy's adapters through: the copy with its int8 linears emulated
    in fp32 (int8.fake_int8) and the same LoRA modules. Training on the fp32 base instead would fit
    the adapter to weights the drafter never drafts with (int8 alone lowers τ: docs/distillation.md)."""
    from ..runtime.int8 import fake_int8

    return _share_lora(fake_int8(drafting), drafting)


def covers(copy_: Any, source: Any) -> bool:
    """Whether `copy_` (a copy or learner of `source`) has a LoRA layer wherever `source` has one,
    so every adapter of `source` drafts and trains through it (see `_share_lora`)."""
    return _lora_layers(copy_).keys() == _lora_layers(source).keys()


# What a LoRA layer keeps per adapter name (peft's LoraLayer; names absent in a peft version are skipped)
_PER_ADAPTER = (
    "lora_A",
    "lora_B",
    "lora_embedding_A",
    "lora_embedding_B",
    "lora_magnitude_vector",
    "r",
    "lora_alpha",
    "scaling",
    "lora_dropout",
    "use_dora",
    "use_rslora",
    "lora_bias",
    "lora_variant",
)


def _lora_layers(model: Any) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def _share_lora(copied: Any, source: Any) -> Any:
    """Point every LoRA layer of `copied` (a deep copy of `source`) at `source`'s per-adapter modules
    and tables, and `copied`'s adapter configs at `source`'s: shared, not copied, so adapters added
    to `source` afterwards exist in `copied` too."""
    originals = _lora_layers(source)
    for name, layer in _lora_layers(copied).items():
        for attr in _PER_ADAPTER:
            if hasattr(originals[name], attr):
                setattr(layer, attr, getattr(originals[name], attr))
    copied.base_model.peft_config = source.base_model.peft_config
    return copied
