"""Which LoRA adapter a new pairing drafts with: none, a fresh one to learn into, the one saved in
the user's profile, or a peft adapter directory brought from elsewhere."""

from __future__ import annotations

import os
from typing import Any

from ..draft.picking import Adaptable

__all__ = ["attach_adapter", "shared_adapter"]


def attach_adapter(
    drafter: Any, target: str, user: str | None, *, learn: bool, adapter: Any, saved: dict[str, Any] | None
) -> str | None:
    """Add the pairing's adapter to `drafter` and return its name (None: the base drafter).
    `adapter`: an AdapterConfig for a fresh adapter, or a peft LoRA directory; `saved`: the
    profile's adapter tensors."""
    if isinstance(adapter, (str, os.PathLike)):  # a peft LoRA directory, from any tool
        if saved is not None:
            raise ValueError(f"the profile of {user!r} has its own adapter: load {adapter} for another user")
        from .adapters import load_peft

        adapter, saved = load_peft(adapter)
    if (learn or saved is not None) and not isinstance(drafter, Adaptable):
        if learn:
            raise ValueError(f"{drafter!r} cannot learn (no adapters): pair a PyTorch Drafter to learn")
        return None  # an exported drafter carries the adapter it was exported with
    if not learn and saved is None:
        return None
    from .adapters import config_from_state

    name = drafter.adapter_name(target, user)
    drafter.add_adapter(name, config_from_state(saved) if saved is not None else adapter, saved)
    return name


def shared_adapter(drafter: Any, target: str, user: str | None, store: Any, fingerprint: str) -> str | None:
    """For a named user's learning: the per-target adapter every user shares (the profile of user
    `SHARED_USER`, if saved), loaded beside the user's own as the baseline it must score at least as
    well as before it drafts (learner.py); None: the base drafter is."""
    from ..store.profiles import SHARED_USER

    if user in (None, SHARED_USER):
        return None
    profile = store.load(drafter.name, target, SHARED_USER, fingerprint=fingerprint)
    if profile is None or "adapter" not in profile.tensors:
        return None
    saved = profile.tensors["adapter"]
    return attach_adapter(drafter, target, SHARED_USER, learn=False, adapter=None, saved=saved)
