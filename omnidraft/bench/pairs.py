"""The bench's pairs: DRAFTER:TARGET specs loaded one pair at a time, on the chosen target backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from ..cli_options import split_pair

if TYPE_CHECKING:
    from ..draft import Drafter
    from ..target import Target

__all__ = ["loaded_pairs"]


def loaded_pairs(
    specs: list[str] | None, default: str, target_backend: str = "torch"
) -> Iterator[tuple[str, Drafter, Target]]:
    """(spec, drafter, target) for each DRAFTER:TARGET spec, loaded one pair at a time; the target
    on PyTorch, or (`target_backend`) on "llama.cpp" or "vllm"."""
    import omnidraft as od

    for pair_spec in specs or [default]:
        drafter_spec, target_spec = split_pair(pair_spec)
        target: Target = (
            od.LlamaCppTarget(target_spec)
            if target_backend == "llama.cpp"
            else od.VLLMTarget.load(target_spec)
            if target_backend == "vllm"
            else od.LocalTarget.load(target_spec)
        )
        yield pair_spec, od.Drafter.load(drafter_spec), target
