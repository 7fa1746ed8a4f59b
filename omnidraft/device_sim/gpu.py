"""Measured server profiles from the prepared GPU check's JSON (benchmarks/gpu_check.py).

One DeviceProfile per model shape: `target_ms[m - 1]` is the fastest of the eager, the
graph-captured and (where measured) the compiled forward over m new tokens at the chosen context
(linear between the k measured), the prefill cost per token from the longest context's prefill.
The check's format and version are checked first: a JSON from another version is refused with an
error naming both. Imports no torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "VERSION", "profiles_from_check"]

FORMAT, VERSION = "omnidraft-gpu-check", 1
FASTER_FORMS = ("graph", "compiled")  # besides eager: StaticRunner's graphs, gpt-fast's torch.compile


def _read(path: str | Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable GPU check JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(
            f"{path}: not a GPU check JSON (format {doc.get('format') if isinstance(doc, dict) else None!r}, "
            f"expected {FORMAT!r}); write one with python -m benchmarks.gpu_check"
        )
    if doc.get("version") != VERSION:
        raise ValueError(
            f"{path}: GPU check version {doc.get('version')!r}; this device_sim reads version {VERSION}: "
            "rerun the check with this checkout's benchmarks/gpu_check.py"
        )
    return doc


def _interpolated(points: dict[int, float], up_to: int) -> list[float]:
    ks = sorted(points)
    out = []
    for m in range(1, up_to + 1):
        lo = max((k for k in ks if k <= m), default=ks[0])
        hi = min((k for k in ks if k >= m), default=ks[-1])
        share = 0.0 if hi == lo else (m - lo) / (hi - lo)
        out.append(round(points[lo] + share * (points[hi] - points[lo]), 3))
    return out


def profiles_from_check(path: str | Path, context: int | None = None) -> list[dict[str, Any]]:
    """Device profile documents (the `devices` list of a profile file) from one GPU check JSON, at
    `context` tokens of context (default: the middle one measured)."""
    doc = _read(path)
    contexts = sorted(int(c) for c in doc["contexts"])
    at = str(context if context is not None else contexts[len(contexts) // 2])
    slug = re.sub(r"[^a-z0-9]+", "-", str(doc.get("device_name", doc["device"])).lower()).strip("-")
    profiles = []
    for name, row in doc["models"].items():
        if at not in row["eager"]:
            raise ValueError(f"{path}: no measurement at context {at} for {name}; measured: {contexts}")
        best = {int(k): float(v) for k, v in row["eager"][at].items() if k.isdigit()}
        for form in FASTER_FORMS:  # per m, the fastest way measured to run this shape
            for k, v in row.get(form, {}).get(at, {}).items():
                best[int(k)] = min(best.get(int(k), float("inf")), float(v))
        longest = row["eager"][str(contexts[-1])]
        profiles.append(
            {
                "name": f"{slug}-{name}-{doc['dtype']}",
                "drafter_ms": 0.0,
                "source": (
                    f"measured by benchmarks/gpu_check.py on {doc.get('device_name')} "
                    f"(torch {doc.get('torch')}, {doc['dtype']}, random weights of the {name} shape), "
                    f"forwards after {at} tokens of context, the fastest of eager, CUDA graphs and "
                    "torch.compile where measured"
                ),
                "target_ms": _interpolated(best, max(best)),
                "prefill_ms_per_token": round(float(longest["prefill_ms"]) / contexts[-1], 4),
            }
        )
    return profiles
