"""Device and network profiles: the costs the simulator charges, each with where it came from.

A device profile gives the drafter's cost per token (growing with context), the target's cost of
one forward as a function of how many tokens it verifies (a table, linearly interpolated), the
prefill cost per prompt token, and memory figures. A network profile gives RTT, bandwidth and loss.
Profiles are JSON; `profiles/*.json` beside this file ship the measured and what-if ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DeviceProfile", "NetworkProfile", "load_profiles"]

SHIPPED = Path(__file__).with_name("profiles")


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """Costs in milliseconds. `target_ms[m-1]` is one target forward over m new tokens."""

    name: str
    source: str
    drafter_ms: float
    drafter_ms_per_1k_context: float = 0.0
    target_ms: tuple[float, ...]
    prefill_ms_per_token: float
    bookkeeping_ms_per_round: float = 0.0
    drafter_memory_mb: float = 0.0

    def __post_init__(self) -> None:
        if not self.target_ms or any(t <= 0 for t in self.target_ms):
            raise ValueError(
                f"device {self.name!r}: target_ms must be a non-empty list of positive costs, got "
                f"{self.target_ms}"
            )
        if self.drafter_ms < 0 or self.prefill_ms_per_token < 0:
            raise ValueError(f"device {self.name!r}: costs must be >= 0")
        object.__setattr__(self, "target_ms", tuple(float(t) for t in self.target_ms))

    def target_cost(self, m: int) -> float:
        """One target forward over m >= 1 new tokens; past the table, the last slope continues."""
        table = self.target_ms
        if m <= len(table):
            return table[m - 1]
        slope = table[-1] - table[-2] if len(table) > 1 else table[-1]
        return table[-1] + slope * (m - len(table))

    def draft_cost(self, tokens: int, context: int) -> float:
        return tokens * (self.drafter_ms + self.drafter_ms_per_1k_context * context / 1000)


@dataclass(frozen=True, kw_only=True)
class NetworkProfile:
    """`rtt_ms` round trip; `bandwidth_mbps` each way; `loss` of a message, resent after one RTT."""

    name: str
    source: str
    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbps: float = 1e9
    loss: float = 0.0
    overhead_bytes: int = 200

    def __post_init__(self) -> None:
        if self.rtt_ms < 0 or self.bandwidth_mbps <= 0 or not 0 <= self.loss < 1:
            raise ValueError(f"network {self.name!r}: need rtt_ms >= 0, bandwidth_mbps > 0, 0 <= loss < 1")

    def exchange_ms(self, up_bytes: int, down_bytes: int) -> float:
        """Expected time of one request/response: RTT, transfer, and retransmissions after loss."""
        transfer = (up_bytes + down_bytes + 2 * self.overhead_bytes) * 8 / (self.bandwidth_mbps * 1000)
        retries = self.loss / (1 - self.loss)  # expected resends of a message lost with probability `loss`
        return (self.rtt_ms + transfer) * (1 + retries)


LOCAL = NetworkProfile(name="none", source="target on the device: no network")


@dataclass
class _Catalogue:
    devices: dict[str, DeviceProfile] = field(default_factory=dict)
    networks: dict[str, NetworkProfile] = field(default_factory=lambda: {"none": LOCAL})


def load_profiles(*paths: str | Path) -> _Catalogue:
    """The shipped profiles plus any JSON files given: {"devices": [...], "networks": [...]}."""
    cat = _Catalogue()
    for path in [*sorted(SHIPPED.glob("*.json")), *map(Path, paths)]:
        try:
            doc = json.loads(Path(path).read_text())
            for d in doc.get("devices", []):
                cat.devices[d["name"]] = DeviceProfile(**d)
            for n in doc.get("networks", []):
                cat.networks[n["name"]] = NetworkProfile(**n)
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a device_sim profile file: {exc}") from exc
    return cat
