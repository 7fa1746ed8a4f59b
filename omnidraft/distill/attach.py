"""Which LoRA adapter a new pairing drafts with: none, a fresh one to learn into, the one saved in
the user's profile, or a peft adapter directory brought from elsewhere.

A named user who starts learning with no adapter of their own starts from the per-target adapter
every user shares (the profile of `SHARED_USER`), when one is saved and has the shape asked for: a
new user drafts as well as the shared adapter from the first request, and learns from there
(docs/personalization.md). The user's adapter is still their own: it is saved in their profile,
and the shared one is left as it was."""

from __future__ import annotations

import os
from typing import Any

from ..draft.picking import Adaptable

__all__ = ["attach_adapter", "shared_adapter", "shared_state"]


def attach_adapter(
    drafter: Any,
    target: str,
    user: str | None,
    *,
    learn: bool,
    adapter: Any,
    saved: dict[str, Any] | None,
    shared: dict[str, Any] | None = None,
) -> str | None:
    """Add the pairing's adapter to `drafter` and return its name (None: the base drafter).
    `adapter`: an AdapterConfig for a fresh adapter, or a peft LoRA directory; `saved`: the
    profile's adapter tensors; `shared`: the shared adapter's tensors, which a learning user's new
    adapter starts from (the module doc)."""
    if isinstance(adapter, (str, os.PathLike)):  # a peft LoRA directory, from any tool
        if saved is not None:
            raise ValueError(f"the profile of {user!r} has its own adapter: load {adapter} for another user")
        from .adapters import load_peft

        adapter, saved = load_peft(adapter)
    elif learn and saved is None and shared is not None and _fits(adapter, shared):
        saved = shared  # copied into the user's own adapter's parameters
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


def _fits(adapter: Any, state: dict[str, Any]) -> bool:
    """Whether a new adapter of shape `adapter` (an AdapterConfig; None: any) can start as `state`."""
    from .adapters import config_from_state

    have = config_from_state(state)
    return adapter is None or (adapter.rank, adapter.alpha, sorted(adapter.modules)) == (
        have.rank,
        have.alpha,
        sorted(have.modules),
    )


def shared_state(
    drafter: Any, target: str, user: str | None, store: Any, fingerprint: str
) -> dict[str, Any] | None:
    """For a named user: the tensors of the per-target adapter every user shares (the profile of
    user `SHARED_USER`), or None where none is saved (or `user` is that user, or None)."""
    from ..store.profiles import SHARED_USER

    if user in (None, SHARED_USER):
        return None
    profile = store.load(drafter.name, target, SHARED_USER, fingerprint=fingerprint)
    if profile is None or "adapter" not in profile.tensors:
        return None
    state: dict[str, Any] = profile.tensors["adapter"]
    return state


def shared_adapter(drafter: Any, target: str, shared: dict[str, Any] | None) -> str | None:
    """The shared adapter (`shared`: its tensors, from `shared_state`) loaded beside a learning
    user's own as the baseline it must score at least as well as before it drafts (learner.py);
    None: the base drafter is."""
    from ..store.profiles import SHARED_USER

    if shared is None:
        return None
    return attach_adapter(drafter, target, SHARED_USER, learn=False, adapter=None, saved=shared)
