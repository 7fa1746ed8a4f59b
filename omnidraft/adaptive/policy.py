"""Fallback draft-length policy for a pairing with no trained acceptance head: hysteresis on the
observed acceptance. Grow slowly after a fully accepted draft, shrink at once after a rejection,
so a new pairing is never stuck at a draft length that the target keeps cutting. Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Hysteresis"]


@dataclass(frozen=True, kw_only=True)
class Hysteresis:
    """k in [k_min, k_max]; +`grow` after full acceptance; after n of m accepted, at most n + 1."""

    k_min: int = 2
    k_max: int = 16
    grow: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got k_min={self.k_min}, k_max={self.k_max}")
        if self.grow < 1:
            raise ValueError(f"grow must be >= 1, got {self.grow}")

    def next_k(self, k: int, proposed: int, accepted: int) -> int:
        """Draft length for the next round after `accepted` of `proposed` target tokens were accepted."""
        if proposed == 0:
            return k
        if accepted >= proposed:
            return min(self.k_max, k + self.grow)
        return max(self.k_min, min(k, accepted + 1))
