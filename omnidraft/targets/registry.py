"""Target engines by name: the one list `omnidraft serve --engine`, `omnidraft bench
--target-backend` and the bench's pairs read (docs/architecture.md, "Add a target engine").

An `Engine` loads a target from a spec (a preset name, a file, an HF id) and the serve command's
options, each engine reading those it knows. `bench` is its own comparison for `omnidraft bench
--target-backend NAME`, `bench_remote` its own for `--remote`; without them the bench runs its own
for the engine (llama.cpp and vLLM against their own speculative decoding: bench/commands.py) or
the generic ones (the pairing against the target decoding alone, in process or through a server
on loopback).

    register_engine(Engine("my-engine", "my engine, in this process", lambda spec, options: MyTarget(spec)))
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from ..target import Target

__all__ = [
    "ENGINES",
    "Engine",
    "engine",
    "engine_names",
    "load_target",
    "register_engine",
    "resolved",
    "vllm_engine_args",
]


@dataclass(frozen=True)
class Engine:
    """A target engine: `name` (what --engine and --target-backend take), `summary` (one line of
    help), `load(spec, options)` -> a target, and optionally its own `bench` and `bench_remote`
    commands (each given the bench's parsed arguments); `verifies_flat`: a verify of a few tokens
    costs it about one step, so drafts can pay on it (`auto` prefers it within a tie of the fastest,
    targets/fastest.py)."""

    name: str
    summary: str
    load: Callable[[str, Mapping[str, Any]], Target]
    bench: Callable[[argparse.Namespace], None] | None = None
    bench_remote: Callable[[argparse.Namespace], None] | None = None
    verifies_flat: bool = False


ENGINES: dict[str, Engine] = {}


def register_engine(engine: Engine) -> None:
    """Add `engine` (or replace the one of its name): serve and bench accept its name from now on."""
    if not engine.name or any(c.isspace() for c in engine.name):
        raise ValueError(f"an engine's name is one word, got {engine.name!r}")
    ENGINES[engine.name] = engine


def engine(name: str) -> Engine:
    """The engine called `name`, or a ValueError naming the ones there are."""
    if name not in ENGINES:
        raise ValueError(f"no target engine {name!r}; the engines are {', '.join(engine_names())}")
    return ENGINES[name]


_engine = engine  # (as `load_target`, whose parameter is called `engine`, calls it)


def engine_names() -> list[str]:
    """Every registered engine's name, the built-in ones first."""
    return list(ENGINES)


def vllm_engine_args(options: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM engine arguments from serve's options: the named ones, then each `engine_arg` KEY=VALUE
    (VALUE parsed as JSON where it is JSON, else kept as a string)."""
    named = ("dtype", "max_model_len", "tensor_parallel_size", "pipeline_parallel_size")
    out = {k: options[k] for k in named if options.get(k) is not None}
    for item in options.get("engine_arg") or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg takes KEY=VALUE, got {item!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except ValueError:
            out[key.replace("-", "_")] = value
    return out


def _torch(spec: str, options: Mapping[str, Any]) -> Target:
    from .local import LocalTarget

    return LocalTarget.load(spec, device=options.get("device"), dtype=options.get("dtype"))


def _llama(spec: str, options: Mapping[str, Any]) -> Target:
    from ..llamacpp.llama_target import LlamaCppTarget

    return LlamaCppTarget(spec, slots=options.get("slots") or 1, n_ctx=options.get("n_ctx") or 4096)


def _vllm(spec: str, options: Mapping[str, Any]) -> Target:
    from .vllm_target import VLLMTarget

    return VLLMTarget.load(spec, **vllm_engine_args(options))  # with omnidraft's proposer: /speculate


def load_target(spec: str, engine: str = "auto", **options: Any) -> Target:
    """`spec` (a preset name, .gguf file, HF id or directory, exported IR) as a target on `engine`:
    a registered engine's name ("llama.cpp", "openvino", "torch", "vllm", ...) or "auto", the one
    that serves a request alone fastest here (targets/fastest.py). `options`: the engine's own
    (the serve command's: `device`, `dtype`, `n_ctx`, ...)."""
    return _engine(resolved(spec, engine, options)).load(spec, options)


def resolved(spec: str, name: str, options: Mapping[str, Any]) -> str:
    """`name`, or for "auto" the engine that serves `spec` fastest here."""
    if name != "auto":
        return name
    from .fastest import fastest_engine

    flat = [name for name, e in ENGINES.items() if e.verifies_flat]
    return fastest_engine(spec, lambda candidate: ENGINES[candidate].load(spec, options), flat=flat)


def _auto(spec: str, options: Mapping[str, Any]) -> Target:
    return load_target(spec, "auto", **options)


def _openvino(weights: str) -> Callable[[str, Mapping[str, Any]], Target]:
    """The loader of OpenVINO with `weights` ("int8", "int4")."""

    def load(spec: str, options: Mapping[str, Any]) -> Target:
        from .openvino_target import OpenVINOTarget

        return OpenVINOTarget.load(spec, weights=weights)

    return load


for _builtin in (
    Engine("torch", "PyTorch in this process (fp32 on a CPU; --device, --dtype)", _torch),
    Engine("llama.cpp", "llama.cpp on the preset's or .gguf file's own weights (--slots, --n-ctx)", _llama),
    Engine(
        "vllm",
        "vLLM, sessions batched by its scheduler (pip install 'omnidraft[vllm]'; --max-model-len, "
        "--engine-arg)",
        _vllm,
    ),
    Engine(
        "openvino",
        "OpenVINO in this process, a preset exported once to int8 IR (pip install 'omnidraft[openvino]'; "
        "the export needs OMNIDRAFT_OPENVINO_PYTHON)",
        _openvino("int8"),
        verifies_flat=True,
    ),
    Engine(
        "openvino-int4",
        "OpenVINO in this process, a preset exported once to int4 IR (the GGUFs' size; the export needs "
        "OMNIDRAFT_OPENVINO_PYTHON)",
        _openvino("int4"),
        verifies_flat=True,
    ),
    Engine(
        "auto",
        "the fastest of the engines here for the model: one request alone timed on each, once a machine "
        "(targets/fastest.py)",
        _auto,
    ),
):
    register_engine(_builtin)
