"""device_sim: what a pairing will feel like on a device and a network, from one recorded run.

Replays omnidraft's per-round JSONL traces under a (device, network, target placement) scenario.
Pure Python: imports no torch, so it runs wherever the traces are.
"""

from __future__ import annotations

from .hardware import DeviceProfile, NetworkProfile, load_profiles
from .simulate import Scenario, SimResult, TraceRound, read_trace, simulate, sweep_k

__all__ = [
    "DeviceProfile",
    "NetworkProfile",
    "Scenario",
    "SimResult",
    "TraceRound",
    "load_profiles",
    "read_trace",
    "simulate",
    "sweep_k",
]
