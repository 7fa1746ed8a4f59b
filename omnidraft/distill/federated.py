"""Adapters averaged across devices, text never leaving them (docs/personalization.md, "Shared
without sharing text").

A device that opts in uploads its LoRA adapter's tensors and how many requests it learned from; the
server keeps one upload per API key per round (a later one replaces it) and, once `min_keys` keys
have uploaded, averages them into the next version of the target's shared adapter, which devices
pull. Safe aggregation:

- an upload is checked before it is kept: LoRA tensors only, one rank, every value finite, and the
  names and shapes of the current shared version (or of the round's first upload);
- each upload's difference from the reference (the current version; for the first, the round's
  coordinate-wise median) is clipped to `clip` times the round's median difference norm, so one
  huge upload moves the average no more than a typical one;
- an upload's weight is its requests, capped at `max_requests`: one key cannot outweigh others;
- FedAvg: reference + the weighted mean of the clipped differences.

A shared adapter only changes what the drafter proposes; the target verifies every token, so a
poisoned upload can at worst slow drafting, never change an output. Versions are files written
atomically (`shared-000001.safetensors`, ...), the round's uploads removed only after the new
version is in place: a crash mid-average loses nothing and the next upload averages again.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..store.atomic import atomic_write_bytes

__all__ = ["AdapterExchange", "Rejected", "check_upload", "decode_state", "encode_state", "fedavg"]

MAX_BYTES = 64 * 2**20  # an upload larger than this is refused unread


class Rejected(ValueError):
    """An upload that is not kept, with the reason a client is told."""


def encode_state(state: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().contiguous().float() for k, v in state.items()})


def decode_state(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    if len(data) > MAX_BYTES:
        raise Rejected(f"an adapter upload is at most {MAX_BYTES} bytes, got {len(data)}")
    try:
        return load(data)
    except Exception as exc:  # noqa: BLE001 - whatever the parser says, the upload is not an adapter
        raise Rejected(f"not a safetensors adapter: {exc}"[:300]) from None


def check_upload(state: dict[str, torch.Tensor], like: dict[str, torch.Tensor] | None) -> None:
    """Raise `Rejected` naming the first problem: not LoRA tensors, more than one rank, a value that
    is not finite, or names and shapes other than `like`'s."""
    if not state or any("lora_" not in k for k in state):
        raise Rejected("an adapter upload holds LoRA tensors only (names with lora_A / lora_B)")
    ranks = {int(v.shape[0]) for k, v in state.items() if "lora_A" in k and v.dim() == 2}
    if len(ranks) != 1 or any(v.dim() != 2 for v in state.values()):
        raise Rejected(f"an adapter upload has one LoRA rank and 2-D tensors; ranks found: {sorted(ranks)}")
    bad = next((k for k, v in sorted(state.items()) if not torch.isfinite(v).all()), None)
    if bad is not None:
        raise Rejected(f"{bad} holds a value that is not finite")
    if like is not None:
        if set(state) != set(like):
            missing, extra = sorted(set(like) - set(state)), sorted(set(state) - set(like))
            raise Rejected(
                f"the adapter's tensors are not the shared one's: missing {missing[:2]}, extra {extra[:2]}"
            )
        wrong = next((k for k in sorted(state) if state[k].shape != like[k].shape), None)
        if wrong is not None:
            raise Rejected(
                f"{wrong} is {tuple(state[wrong].shape)}, the shared adapter's {tuple(like[wrong].shape)}"
            )


def _norm(delta: dict[str, torch.Tensor]) -> float:
    return float(sum(float((v.float() ** 2).sum()) for v in delta.values())) ** 0.5


def fedavg(
    uploads: list[tuple[dict[str, torch.Tensor], int]],
    reference: dict[str, torch.Tensor] | None,
    *,
    clip: float = 2.0,
    max_requests: int = 50,
) -> dict[str, torch.Tensor]:
    """The next shared adapter from (state, requests learned) uploads (see the module doc)."""
    if not uploads:
        raise ValueError("no uploads to average")
    names = list(uploads[0][0])
    if reference is None:
        reference = {k: torch.stack([s[k].float() for s, _ in uploads]).median(dim=0).values for k in names}
    deltas = [{k: s[k].float() - reference[k].float() for k in names} for s, _ in uploads]
    norms = [_norm(d) for d in deltas]
    bound = clip * sorted(norms)[len(norms) // 2] if len(norms) > 1 else float("inf")
    weights = [min(max(requests, 1), max_requests) for _, requests in uploads]
    total = float(sum(weights))
    out = {}
    for k in names:
        moved = sum(
            (w / total) * d[k] * (min(1.0, bound / n) if n > 0 else 1.0)
            for d, n, w in zip(deltas, norms, weights)
        )
        out[k] = reference[k].float() + moved
    return out


@dataclass(frozen=True)
class Round:
    """What the exchange holds now: the shared version, and the keys that uploaded this round."""

    version: int
    uploaded: tuple[int, ...]


class AdapterExchange:
    """One target's shared adapter on disk under `root`: its versions and this round's uploads (one
    per key). `min_keys` keys' uploads make a round."""

    def __init__(
        self, root: str | Path, *, min_keys: int = 2, clip: float = 2.0, max_requests: int = 50
    ) -> None:
        if min_keys < 1:
            raise ValueError(f"min_keys must be >= 1, got {min_keys}")
        self.root = Path(root)
        (self.root / "uploads").mkdir(parents=True, exist_ok=True)
        self.min_keys, self.clip, self.max_requests = min_keys, clip, max_requests
        self._lock = threading.Lock()

    def version(self) -> int:
        found = [int(p.stem.split("-")[1]) for p in self.root.glob("shared-*.safetensors")]
        return max(found, default=0)

    def shared(self) -> tuple[int, bytes | None]:
        """(version, its bytes); (0, None) before the first round."""
        v = self.version()
        return v, (self.root / f"shared-{v:06d}.safetensors").read_bytes() if v else None

    def _uploads(self) -> list[tuple[int, Path]]:
        """This round's uploads, by key: those made against the current version (an upload left from
        a round whose average was written before a crash removed its files is dropped here)."""
        version, out = self.version(), []
        for path in sorted((self.root / "uploads").glob("key-*.safetensors")):
            meta = path.with_suffix(".json")
            try:
                made = json.loads(meta.read_text()).get("version")
            except (OSError, ValueError):
                made = None
            if made != version:
                meta.unlink(missing_ok=True)
                path.unlink(missing_ok=True)
                continue
            out.append((int(path.stem.split("-")[1]), path))
        return out

    def upload(self, key: int, data: bytes, requests: int) -> Round:
        """Keep `key`'s upload for this round (replacing its earlier one), after `check_upload`; average
        the round once `min_keys` keys have uploaded. Raises `Rejected`."""
        if requests < 1:
            raise Rejected(f"an upload says how many requests it learned from (>= 1), got {requests}")
        state = decode_state(data)
        with self._lock:
            version, current = self.shared()
            like = decode_state(current) if current else None
            pending = self._uploads()
            if like is None and pending:
                like = decode_state(pending[0][1].read_bytes())
            check_upload(state, like)
            atomic_write_bytes(self.root / "uploads" / f"key-{key}.safetensors", encode_state(state))
            meta = {"requests": requests, "version": version}  # the state's weight, the round it is for
            atomic_write_bytes(self.root / "uploads" / f"key-{key}.json", json.dumps(meta).encode())
            pending = self._uploads()
            if len(pending) < self.min_keys:
                return Round(version, tuple(k for k, _ in pending))
            self._average(pending, version, like if current else None)
            return Round(version + 1, ())

    def _average(
        self, pending: list[tuple[int, Path]], version: int, reference: dict[str, torch.Tensor] | None
    ) -> None:
        uploads = []
        for _, path in pending:
            requests = json.loads((path.with_suffix(".json")).read_text())["requests"]
            uploads.append((decode_state(path.read_bytes()), int(requests)))
        new = fedavg(uploads, reference, clip=self.clip, max_requests=self.max_requests)
        atomic_write_bytes(self.root / f"shared-{version + 1:06d}.safetensors", encode_state(new))
        for _, path in pending:  # only once the new version is in place
            path.with_suffix(".json").unlink(missing_ok=True)
            path.unlink(missing_ok=True)
