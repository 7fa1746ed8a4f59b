"""Drafting: a small LM on the device proposes tokens (docs/architecture.md).

- `picking.py`: `Draft` (what one proposal is) and the pure functions that pick a drafted token;
- `session.py`: `DraftSession`, the one drafting loop, over a backend's `Stream`;
- `base.py`: `Drafter`, what every backend shares, and `Drafter.load`, which returns one;
- `torch_drafter.py`: the PyTorch backend (int8 on a CPU), the one that learns adapters. The
  llama.cpp backend is `llamacpp/drafting.py`, ONNX Runtime's `export/ort_drafter.py`.
"""

from importlib import import_module
from typing import Any

__all__ = [
    "Adaptable",
    "BACKENDS",
    "Draft",
    "DraftSession",
    "Drafter",
    "NO_DRAFT",
    "Stream",
    "TorchDrafter",
    "confidence",
    "heal_pick",
    "pick",
    "restrict",
]

_WHERE = {  # each name's module, imported on first use: importing one module here loads no other
    "BACKENDS": "base",
    "Drafter": "base",
    "TorchDrafter": "torch_drafter",
    "DraftSession": "session",
    "Stream": "session",
    **{
        n: "picking"
        for n in ("Adaptable", "Draft", "NO_DRAFT", "confidence", "heal_pick", "pick", "restrict")
    },
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
