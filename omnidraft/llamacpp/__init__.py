"""llama.cpp (through llama-cpp-python) as a drafter backend and as a target, in this process.

    target = LlamaCppTarget("qwen2.5-coder-1.5b")              # the preset's own GGUF file
    drafter = Drafter.load("smollm2-135m", backend="llama.cpp")
    pair = drafter.pair(target)

`engine.py` evaluates token ids with a KV cache that keeps the longest shared prefix; `llama_target.py`
and `drafting.py` put the target and drafter protocols on it; `hook.py` offers an omnidraft drafter to
llama-cpp-python's own speculative decoding (`Llama(..., draft_model=...)`).
"""

from importlib import import_module
from typing import Any

__all__ = ["LlamaCppDrafter", "LlamaCppTarget", "LlamaEngine"]

_WHERE = {"LlamaCppDrafter": "drafting", "LlamaCppTarget": "llama_target", "LlamaEngine": "engine"}


def __getattr__(name: str) -> Any:  # each name's module on first use: one module loads no other
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
