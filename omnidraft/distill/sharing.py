"""A device's side of the adapter exchange (`pair(remote_target, learn=True, share=True)`; the
server's side is federated.py; docs/personalization.md, "Shared without sharing text").

A pairing that shares drafts for a `RemoteTarget` whose server runs `--share-adapters`. When it is
made it pulls the target's shared adapter: a fresh adapter starts from it (or, before the first
version, from an initialisation every device of the target makes alike, so their uploads average
coordinate by coordinate). Every `every` requests learned from, once the learner has caught up and
no request runs, it uploads its adapter's LoRA tensors and the number of requests they learned from
(nothing else leaves the device), first pulling the shared adapter: when its version is new, the
own adapter is re-based on it and keeps its own residual, own + (new shared - the version it was
based on), so each upload is made against the newest version the device has seen. A server that
refuses an upload, or cannot be reached, leaves the adapter as it was; the reason is kept in
`last_error`, and the next sync tries again.
"""

from __future__ import annotations

import hashlib
import math
import threading
from typing import Any

import torch

__all__ = ["AdapterSharing"]


class AdapterSharing:
    """One pairing's adapter exchange with its remote target's server (see the module doc)."""

    def __init__(self, pairing: Any, *, every: int = 10) -> None:
        target = pairing.target
        if not (hasattr(target, "upload_adapter") and hasattr(target, "shared_adapter")):
            raise ValueError(
                f"share=True shares the adapter with the server a pairing drafts for: {target!r} is not a "
                "RemoteTarget (od.RemoteTarget(url) to a server started with --share-adapters DIR)"
            )
        if pairing.learner is None or pairing.adapter is None:
            raise ValueError(
                "share=True shares what the pairing learns: pair(target, learn=True, share=True)"
            )
        if every < 1:
            raise ValueError(f"share_every must be >= 1 request, got {every}")
        self.pairing, self.target, self.every = pairing, target, every
        self.version = 0  # the shared version the adapter is based on (0: none yet)
        self.base: dict[str, torch.Tensor] | None = None  # that version's tensors (or the common start)
        self.learned = 0  # requests learned from since the last upload
        self.uploads = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._start()

    def _state(self) -> dict[str, torch.Tensor]:
        from .adapters import adapter_state

        drafter = self.pairing.drafter
        with drafter.lock:
            return {k: v.float() for k, v in adapter_state(drafter.trainable, self.pairing.adapter).items()}

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        from .adapters import load_adapter_state

        drafter = self.pairing.drafter
        with drafter.lock:
            load_adapter_state(drafter.trainable, self.pairing.adapter, state)

    def _start(self) -> None:
        """A fresh adapter starts from the shared version, or from the start every device of this
        target makes alike; an adapter with steps of its own keeps them (re-based at the next sync)."""
        fresh = self.pairing.steps == 0
        try:
            version, shared = self.target.shared_adapter()
        except Exception as exc:  # noqa: BLE001 - unreachable now: start alone, sync later
            version, shared, self.last_error = 0, None, _reason(exc)
        own = self._state()
        if shared is not None and set(shared) == set(own):
            self.version, self.base = version, shared
            if fresh:
                self._load(shared)
        elif fresh:
            self.base = common_start(own, self.pairing.target.name)
            self._load(self.base)
        else:
            self.base = own

    def after_request(self) -> None:
        """A request was learned from: every `every` of them, a sync in the background."""
        with self._lock:
            self.learned += 1
            if self.learned < self.every or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self._sync_quietly, name="omnidraft-share", daemon=True)
            self._thread.start()

    def _sync_quietly(self) -> None:
        try:
            self.sync()
        except Exception as exc:  # noqa: BLE001 - a thread has nobody to raise to: kept, tried again later
            self.last_error = _reason(exc)

    def sync(self) -> int:
        """Pull the shared adapter and re-base on it when its version is new, then upload the
        adapter (after the learning queued so far): an upload is always made against the newest
        version this device has seen. Returns the version the adapter is based on now."""
        learner = self.pairing.learner
        if learner is not None:
            learner.wait()
        version, shared = self.target.shared_adapter()
        if shared is not None and version != self.version:
            with self.pairing.drafter.lock:  # (read and re-based in one hold: no learner step between)
                own = self._state()
                if set(shared) != set(own):
                    raise ValueError(f"the server's shared adapter v{version} is not this adapter's shape")
                base = self.base or shared
                self._load({k: shared[k].float() + own[k] - base[k].float() for k in own})
            self.version, self.base = version, shared
        with self._lock:
            requests, self.learned = max(1, self.learned), 0
        self.target.upload_adapter(self._state(), requests)
        self.uploads += 1
        self.last_error = None
        return self.version

    def wait(self, timeout: float | None = None) -> None:
        """Block until a background sync now running is done."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)


def _reason(exc: Exception) -> str:
    """What `last_error` keeps of a failed exchange."""
    return f"{type(exc).__name__}: {exc}"[:300]


def common_start(state: dict[str, torch.Tensor], target: str) -> dict[str, torch.Tensor]:
    """LoRA's own initialisation (A uniform as PyTorch's Linear, B zero), drawn from a generator
    seeded by the target's name and each tensor's name: every device of a target starts alike."""
    out = {}
    for name in sorted(state):
        tensor = torch.empty_like(state[name], dtype=torch.float32)
        if "lora_A" in name:
            seed = int.from_bytes(hashlib.sha256(f"{target}|{name}".encode()).digest()[:8], "little")
            generator = torch.Generator().manual_seed(seed)
            torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
        else:
            tensor.zero_()
        out[name] = tensor
    return out
