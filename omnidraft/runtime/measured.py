"""What omnidraft measures once on a machine and keeps: the per-machine measurements.

Kernel plans, attention forms, drafting costs per backend, llama.cpp's exact batch sizes and
drafting weights, vLLM verify costs: each is a function of the machine (CPU, torch build, threads)
and never of a request, so it is timed once and kept in one JSON file per kind and machine,
`$OMNIDRAFT_CACHE/measured/<kind>-<machine key>.json`. Every read-modify-write holds a file lock
(processes sharing a cache never lose each other's entries) and writes atomically. A timing taken
while the machine was busy would decide forever: `omnidraft doctor` lists what is kept and
`omnidraft doctor --reset` forgets it, so the next use measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
from pathlib import Path
from typing import Any, Callable

import torch
from filelock import FileLock

from ..store.atomic import atomic_write_bytes
from .notice import one_time

__all__ = ["directory", "entries", "machine_key", "read", "remembered", "reset", "update"]

log = logging.getLogger("omnidraft")


def machine_key() -> str:
    """What a timing is a function of besides its subject: CPU model and flags, torch build, threads."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                cpu += "|" + line.split(":", 1)[1].strip()
    except OSError:
        pass
    threads, onednn = torch.get_num_threads(), torch.backends.mkldnn.is_available()
    raw = f"{cpu}|torch {torch.__version__}|threads {threads}|onednn {onednn}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def directory(root: Path | None = None) -> Path:
    """Where the measurements live: `root`, or `$OMNIDRAFT_CACHE/measured`."""
    if root is not None:
        return root
    from ..store.presets import cache_dir

    return cache_dir() / "measured"


def _path(kind: str, root: Path | None) -> Path:
    return directory(root) / f"{kind}-{machine_key()}.json"


def _load(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):  # absent or unreadable: measured again
        return {}
    return doc if isinstance(doc, dict) else {}


def read(kind: str, *, root: Path | None = None) -> dict[str, Any]:
    """Every entry of `kind` kept for this machine ({} when none)."""
    return _load(_path(kind, root))


def update(kind: str, entries: dict[str, Any], *, root: Path | None = None) -> Path:
    """Merge `entries` into the kept ones of `kind`, under the file lock; the file's path."""
    path = _path(kind, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        known = _load(path)
        known.update(entries)
        atomic_write_bytes(path, json.dumps(known, indent=1, sort_keys=True).encode())
    return path


# what each kind of measurement finds out, and about how long it takes, as its one log line says it
WHAT = {
    "attention": ("which attention kernel is faster", "a second"),
    "drafting-cost": ("what one drafted token costs", "a few seconds"),
    "drafter-read-cost": ("what reading a prompt token costs the drafter", "seconds"),
    "request-alone": ("how fast one request decodes alone", "up to a minute"),
    "target-graphs": ("whether CUDA graphs speed the target up", "seconds"),
    "vllm-verify-costs": ("what a verify of 1-9 tokens costs on vLLM", "under a minute"),
    "vllm-batch-costs": ("what a step of several sequences costs on vLLM", "under a minute"),
    "llama-cpp-smoke": ("whether this llama.cpp build runs the model", "seconds"),
    "llama-exact-rows": ("how many tokens one llama.cpp call verifies bit-exactly", "about ten seconds"),
    "llama-row-costs": ("what a verify of several tokens costs on llama.cpp", "a few seconds"),
    "drafter-weights": ("which weight format drafts fastest on llama.cpp", "under a minute"),
    "openvino-margin": ("how far OpenVINO's verify rows are from one-row steps", "seconds"),
    "openvino-verify-costs-rejected": ("what a verify of several tokens costs on OpenVINO", "seconds"),
}


def remembered(
    kind: str, key: str, measure: Callable[[], Any], *, root: Path | None = None, about: str | None = None
) -> Any:
    """`measure()` for `key`, measured once on this machine and kept (see the module doc). The
    measurement runs outside the lock (it may take seconds); the write merges under it. Its one
    log line says in words what it finds out (`about`, else `WHAT[kind]`) and about how long."""
    known = read(kind, root=root)
    if key in known:
        return known[key]
    what, takes = WHAT.get(kind, (kind, "seconds"))
    one_time(
        "measuring once on this machine: %s, for %s (%s; `omnidraft doctor --reset` forgets it)",
        about or what,
        _named(key),
        takes,
    )
    value = measure()
    update(kind, {key: value}, root=root)
    return value


def _named(key: str) -> str:
    """What a key is about, as a log line says it: the file or model it names (its first part, or
    the first part that is a path), not the versions, sizes and settings that make it unique."""
    parts = key.split("|")
    files = [p for p in parts if p.split(":")[0].endswith((".gguf", ".xml", ".onnx"))]
    named = next(iter(files), next((p for p in parts if p.startswith("/")), parts[0]))
    return Path(named.split(":")[0]).name or named


def entries(*, root: Path | None = None) -> list[tuple[str, Path, int]]:
    """(kind, file, number of entries) for each kind kept for this machine."""
    suffix = f"-{machine_key()}.json"
    found = sorted(directory(root).glob(f"*{suffix}")) if directory(root).is_dir() else []
    return [(p.name[: -len(suffix)], p, len(_load(p))) for p in found]


def reset(*, root: Path | None = None) -> list[Path]:
    """Forget every measurement kept for any machine; the files removed."""
    base = directory(root)
    removed = []
    for path in sorted(base.glob("*.json")) if base.is_dir() else []:
        with FileLock(str(path) + ".lock"):
            path.unlink(missing_ok=True)
        Path(str(path) + ".lock").unlink(missing_ok=True)
        removed.append(path)
    return removed
