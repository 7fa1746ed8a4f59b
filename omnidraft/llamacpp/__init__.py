"""llama.cpp (through llama-cpp-python) as a drafter backend and as a target, in this process.

    target = LlamaCppTarget("qwen2.5-coder-1.5b")              # the preset's own GGUF file
    drafter = Drafter.load("smollm2-135m", backend="llama.cpp")
    pair = drafter.pair(target)

`engine.py` evaluates token ids with a KV cache that keeps the longest shared prefix; `llama_target.py`
and `drafting.py` put the target and drafter protocols on it; `hook.py` offers an omnidraft drafter to
llama-cpp-python's own speculative decoding (`Llama(..., draft_model=...)`).
"""

from .drafting import LlamaCppDrafter
from .engine import LlamaEngine
from .llama_target import LlamaCppTarget

__all__ = ["LlamaCppDrafter", "LlamaCppTarget", "LlamaEngine"]
