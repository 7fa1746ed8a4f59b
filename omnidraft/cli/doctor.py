"""What this machine offers omnidraft: versions, optional backends, presets, what was measured on it.

Returns lines of text for `omnidraft doctor` to print; loads a model only when asked for its plan.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from typing import Sequence

import torch

from ..runtime import measured
from ..runtime.kernels import BUCKETS
from ..store import presets

__all__ = ["report", "reset"]

_BACKENDS = {
    "onnxruntime": "ONNX Runtime drafter (export/)",
    "llama_cpp": "llama.cpp (llama-cpp-python)",
    "fastapi": "verification server (serve)",
    "httpx": "remote client",
}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _preset_state(name: str) -> str:
    try:
        presets.require_installed(presets.PRESETS[name])
    except Exception as exc:  # a missing package names its pip command
        return f"missing ({exc})"
    return "installed"


def _drafter_weights() -> list[str]:
    """What each llama.cpp drafter file measured here runs (llamacpp/requant.py)."""
    lines = []
    for key, timed in sorted(measured.read("drafter-weights").items()):
        try:
            use, shipped, q8 = timed["use"], timed["shipped"], timed["q8_0"]
            lines.append(
                f"llama.cpp drafter {key.split('|')[0]}: runs "
                f"{'Q8_0 copy' if use == 'q8_0' else 'as shipped'} "
                f"(ms per prompt token read / drafted token: shipped {shipped['read_ms']:.2f} / "
                f"{shipped['draft_ms']:.1f}, Q8_0 {q8['read_ms']:.2f} / {q8['draft_ms']:.1f})"
            )
        except (KeyError, TypeError, AttributeError):
            lines.append(
                f"llama.cpp drafter {key.split('|')[0]}: unreadable timing (`omnidraft doctor --reset` "
                "clears it)"
            )
    return lines


def _measurements() -> list[str]:
    """One line per kind of measurement kept for this machine."""
    kept = measured.entries()
    lines = [
        f"measured on this machine (key {measured.machine_key()}, under {measured.directory()}): "
        + (", ".join(f"{kind} ({n})" for kind, _, n in kept) if kept else "nothing yet")
    ]
    return lines + (
        ["  a timing taken on a busy machine decides until `omnidraft doctor --reset` forgets it"]
        if kept
        else []
    )


def reset() -> list[str]:
    """Forget every per-machine measurement; one line per file removed."""
    removed = measured.reset()
    return [f"removed {path}" for path in removed] or [f"nothing measured under {measured.directory()}"]


def report(targets: Sequence[str] = ()) -> list[str]:
    """The doctor's lines; with `targets`, each one's kernel plan (timed now if not cached)."""
    lines = [
        f"python {sys.version.split()[0]}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}",
        "oneDNN: "
        + ("available" if torch.backends.mkldnn.is_available() else "NOT available (stock kernels only)"),
    ]
    lines += [
        f"{module:>12}: {'yes' if _installed(module) else 'no '}  {what}"
        for module, what in _BACKENDS.items()
    ]
    lines += [f"preset {name}: {_preset_state(name)}" for name in sorted(presets.PRESETS)]
    lines += _measurements() + _drafter_weights()
    for spec in targets:
        from ..runtime.attention import attention_choice
        from ..runtime.kernels import use_kernels
        from ..store.models import load_model

        model = load_model(spec).model
        lines.append(f"{spec}: {attention_choice(model)}")
        plan = use_kernels(model)
        if plan is None:
            lines.append(f"{spec}: stock kernels (no oneDNN)")
            continue
        lines.append(
            f"{spec}: kernel per layer shape and row count, chosen by median ms (stock F.linear / oneDNN); "
            f"row buckets {BUCKETS}"
        )
        lines += ["  " + line for line in plan.summary()]
    return lines
