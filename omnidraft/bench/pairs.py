"""The bench's pairs: DRAFTER:TARGET specs loaded one pair at a time, on the chosen target backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from ..cli.options import split_pair

if TYPE_CHECKING:
    from ..draft.base import Drafter
    from ..target import Target

__all__ = ["loaded_pairs"]


def loaded_pairs(
    specs: list[str] | None, default: str, target_backend: str = "torch"
) -> Iterator[tuple[str, Drafter, Target]]:
    """(spec, drafter, target) for each DRAFTER:TARGET spec, loaded one pair at a time; the target
    on the engine called `target_backend` (targets/registry.py), with its default options."""
    import omnidraft as od

    from ..targets.registry import engine

    for pair_spec in specs or [default]:
        drafter_spec, target_spec = split_pair(pair_spec)
        target: Target = engine(target_backend).load(target_spec, {})
        yield pair_spec, od.Drafter.load(drafter_spec), target
