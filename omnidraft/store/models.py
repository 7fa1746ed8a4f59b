"""Load a causal LM and its tokenizer from a preset name, a local HF directory or id, or a .gguf file.

GGUF files are dequantised once (15-50 s) and the result is cached as safetensors under
`presets.cache_dir()/converted/`, so every later load is a plain fp32 safetensors load. This module
does no decoding; it only hands back `(model, tokenizer)`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import torch

from ..runtime.notice import one_time
from . import presets
from .atomic import atomic_path, build_lock

__all__ = ["check_spec", "LoadedModel", "hf_directory", "load_model", "load_tokenizer"]

log = logging.getLogger(__name__)


class LoadedModel:
    """A model in eval mode with its tokenizer and the name it was loaded under."""

    def __init__(self, model: Any, tokenizer: Any, name: str) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name

    def __repr__(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        return f"LoadedModel({self.name!r}, {n / 1e6:.0f}M params, vocab {len(self.tokenizer)})"


def load_model(spec: str, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load `spec`: a preset name (see `presets.PRESETS`), a `.gguf` path, a local dir or an HF id."""
    check_spec(spec)
    if spec in presets.PRESETS:
        return _load_gguf(presets.gguf_path(spec), spec, dtype)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return _load_gguf(path, path.stem, dtype)
    return _load_hf(spec, spec, dtype)


def check_spec(spec: str) -> None:
    """Refuse, before any slow work, a model spec that cannot load: a misspelled preset, a .gguf
    file or a local directory (a path starting with ".", "/" or "~") that is not there."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model spec must be a non-empty string, got {spec!r}")
    if spec in presets.PRESETS:
        return
    kinds = f"a preset ({', '.join(sorted(presets.PRESETS))}), a .gguf file, a local directory or an HF id"
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}; a model is {kinds}")
    if spec.startswith((".", "/", "~")) and not path.exists():
        raise FileNotFoundError(f"no model directory at {path}; a model is {kinds}")
    if spec.startswith(("smollm", "qwen", "gemma")) and not path.exists():
        raise ValueError(f"unknown preset {spec!r}; known presets: {', '.join(sorted(presets.PRESETS))}")


def load_tokenizer(spec: str) -> Any:
    """Only the tokenizer of `spec` (a preset, .gguf path, local dir or HF id): no weights."""
    from transformers import AutoTokenizer

    check_spec(spec)
    if spec in presets.PRESETS or spec.endswith(".gguf"):
        path = presets.gguf_path(spec) if spec in presets.PRESETS else Path(spec)
        converted = _converted_dir(path, spec if spec in presets.PRESETS else path.stem)
        if (converted / "config.json").exists():
            return AutoTokenizer.from_pretrained(str(converted))
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(spec)


def hf_directory(spec: str) -> str:
    """A directory or HF id another engine (vLLM) can load `spec` from: a preset or .gguf file
    becomes its converted safetensors directory (converted once, as `load_model` does)."""
    check_spec(spec)
    if spec in presets.PRESETS or spec.endswith(".gguf"):
        path = presets.gguf_path(spec) if spec in presets.PRESETS else Path(spec).expanduser()
        converted = _converted_dir(path, spec if spec in presets.PRESETS else path.stem)
        if not (converted / "config.json").exists():
            load_model(spec)
        return str(converted)
    return spec


def _converted_dir(path: Path, name: str) -> Path:
    return presets.cache_dir() / "converted" / f"{name}-{path.stat().st_size}"


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """transformers' weight-loading and dequantising progress bars off while omnidraft loads a
    model (a run prints what it was asked for; a first load says so in one line), restored after."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # the GGUF dequantiser's bar is tqdm's own, which transformers' switch does not reach
    with mock.patch("transformers.modeling_gguf_pytorch_utils.tqdm", lambda items, **_: items):
        try:
            yield
        finally:
            if shown:
                hf_logging.enable_progress_bar()


def _load_hf(source: str, name: str, dtype: torch.dtype, **kwargs: Any) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_loading():
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    model.eval().requires_grad_(False)
    return LoadedModel(model, tokenizer, name)


def _load_gguf(path: Path, name: str, dtype: torch.dtype) -> LoadedModel:
    converted = _converted_dir(path, name)
    if (converted / "config.json").exists():
        return _load_hf(str(converted), name, dtype)
    with build_lock(converted):  # two processes loading it first at once dequantise it once
        if (converted / "config.json").exists():
            return _load_hf(str(converted), name, dtype)
        return _convert_gguf(path, name, dtype, converted)


def _convert_gguf(path: Path, name: str, dtype: torch.dtype, converted: Path) -> LoadedModel:
    started = time.perf_counter()
    one_time(
        "first load of %s: dequantising %s once (tens of seconds; cached in %s)", name, path.name, converted
    )
    loaded = _load_hf(str(path.parent), name, dtype, gguf_file=path.name)
    log.info(
        "dequantised %s in %.1f s; caching safetensors in %s",
        path.name,
        time.perf_counter() - started,
        converted,
    )
    _forget_gguf_origin(loaded.model)
    with atomic_path(converted, directory=True) as tmp, _quiet_loading():
        loaded.model.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
    return loaded


def _forget_gguf_origin(model: Any) -> None:
    """The dequantised weights are plain fp32; drop the GGUF marker that blocks save_pretrained."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
