"""What mypy checks at `make lint`: every built-in target is a `Target`, its session a
`TargetSession` (a member missing, or one with another signature, fails the check). Nothing here
runs: the imports are for the type checker only."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..distill.trace_store import ReplayTarget
    from ..llamacpp.llama_target import LlamaCppTarget
    from ..target import (
        BatchingTarget,
        ChunkedSession,
        DecodingSession,
        EngineSession,
        ScoringSession,
        StreamingSession,
        Target,
        TargetSession,
    )
    from .local import LocalTarget
    from .openai_client import OpenAICompletionsTarget
    from .openvino_target import OpenVINOTarget
    from .remote import RemoteTarget
    from .vllm_target import VLLMTarget

    def _targets(
        local: LocalTarget,
        llama: LlamaCppTarget,
        vllm: VLLMTarget,
        openvino: OpenVINOTarget,
        remote: RemoteTarget,
        openai: OpenAICompletionsTarget,
        replay: ReplayTarget,
    ) -> list[Target]:
        return [local, llama, vllm, openvino, remote, openai, replay]

    def _sessions(
        target: LocalTarget | LlamaCppTarget | VLLMTarget | OpenVINOTarget | RemoteTarget,
    ) -> TargetSession:
        return target.begin([])

    # each engine's sessions against what its capabilities promise (target.py's session protocols)
    def _decoding(
        local: LocalTarget, llama: LlamaCppTarget, openvino: OpenVINOTarget, remote: RemoteTarget
    ) -> list[DecodingSession]:
        return [local.begin([]), llama.begin([]), openvino.begin([]), remote.begin([])]

    def _scoring(local: LocalTarget, llama: LlamaCppTarget) -> list[ScoringSession]:
        return [local.begin([]), llama.begin([])]

    def _chunked(local: LocalTarget) -> ChunkedSession:
        return local.begin([])

    def _engine(remote: RemoteTarget) -> EngineSession:
        return remote.begin([])

    def _streaming(vllm: VLLMTarget) -> StreamingSession:
        return vllm.begin([])

    def _batching(vllm: VLLMTarget) -> BatchingTarget:
        return vllm
