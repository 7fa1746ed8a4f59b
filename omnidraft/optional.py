"""Optional dependencies, imported where they are needed: a missing one is a MissingDependencyError
naming the extra that installs it, never a bare ModuleNotFoundError."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError

__all__ = ["EXTRAS", "require"]

EXTRAS = {
    "httpx": "client",
    "pydantic": "client",
    "fastapi": "server",
    "uvicorn": "server",
    "onnx": "onnx",
    "onnxruntime": "onnx",
    "llama_cpp": "llama",
    "vllm": "vllm",
}


def require(module: str, what: str) -> ModuleType:
    """`module`, imported; `what` says what needs it ("RemoteTarget", "omnidraft serve", ...)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRAS.get(module.split(".")[0])
        hint = f"pip install 'omnidraft[{extra}]'" if extra else f"pip install {module.split('.')[0]}"
        raise MissingDependencyError(
            f"{what} needs {module.split('.')[0]}, which is not installed: {hint}"
        ) from exc
