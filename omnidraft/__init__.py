"""omnidraft: one small on-device drafter, any target LM, cross-vocabulary speculative decoding.

    import omnidraft as od
    pair = od.Drafter.load("smollm2-135m").pair(od.LocalTarget.load("qwen2.5-coder-0.5b"))
    out = pair.generate("def fib(n):", max_new_tokens=128)

Heavy modules (torch, transformers) load on first use of a name, so `import omnidraft` stays light.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = [
    "Capabilities",
    "CorruptFileError",
    "DecodeConfig",
    "DraftSession",
    "Drafter",
    "Engine",
    "Generation",
    "HeadConfig",
    "IncompatibleError",
    "LlamaCppDrafter",
    "LlamaCppTarget",
    "LocalTarget",
    "MissingDependencyError",
    "MissingModelError",
    "OmnidraftError",
    "OpenAICompletionsTarget",
    "OpenVINOTarget",
    "OrtDrafter",
    "PRESETS",
    "Pairing",
    "ProfileStore",
    "RemoteRequestError",
    "RemoteTarget",
    "RetrievalConfig",
    "Rule",
    "SessionBase",
    "StreamCutError",
    "TargetBase",
    "TargetError",
    "TargetUnavailableError",
    "TorchDrafter",
    "TrainConfig",
    "VLLMTarget",
    "load_model",
    "load_target",
    "pair",
    "register_engine",
]
__version__ = "0.1.0"

_WHERE = {
    "Capabilities": "target",
    "DecodeConfig": "decode.config",
    "Engine": "targets.registry",
    "register_engine": "targets.registry",
    "SessionBase": "target",
    "TargetBase": "target",
    "Drafter": "draft.base",
    "TorchDrafter": "draft.torch_drafter",
    "OrtDrafter": "export.ort_drafter",
    "DraftSession": "draft.session",
    "HeadConfig": "adaptive.acceptance_head",
    "Generation": "pairing",
    "LlamaCppDrafter": "llamacpp.drafting",
    "LlamaCppTarget": "llamacpp.llama_target",
    "LocalTarget": "targets.local",
    "OmnidraftError": "errors",
    "CorruptFileError": "errors",
    "IncompatibleError": "errors",
    "MissingDependencyError": "errors",
    "MissingModelError": "errors",
    "RemoteRequestError": "errors",
    "TargetError": "errors",
    "StreamCutError": "errors",
    "TargetUnavailableError": "errors",
    "OpenAICompletionsTarget": "targets.openai_client",
    "OpenVINOTarget": "targets.openvino_target",
    "Pairing": "pairing",
    "PRESETS": "store.presets",
    "ProfileStore": "store.profiles",
    "RemoteTarget": "targets.remote",
    "RetrievalConfig": "retrieve",
    "Rule": "target",
    "TrainConfig": "distill.trainer",
    "VLLMTarget": "targets.vllm_target",
    "load_model": "store.models",
    "load_target": "targets.registry",
    "pair": "pairing",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'omnidraft' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
