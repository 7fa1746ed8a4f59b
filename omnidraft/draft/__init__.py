"""Drafting: a small LM on the device proposes tokens (docs/architecture.md).

- `picking.py`: `Draft` (what one proposal is) and the pure functions that pick a drafted token;
- `session.py`: `DraftSession`, the one drafting loop, over a backend's `Stream`;
- `base.py`: `Drafter`, what every backend shares, and `Drafter.load`, which returns one;
- `torch_drafter.py`: the PyTorch backend (int8 on a CPU), the one that learns adapters. The
  llama.cpp backend is `llamacpp/drafting.py`, ONNX Runtime's `export/ort_drafter.py`.
"""

from .base import BACKENDS, Drafter
from .picking import NO_DRAFT, Adaptable, Draft, confidence, heal_pick, pick, restrict
from .session import DraftSession, Stream
from .torch_drafter import TorchDrafter

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
