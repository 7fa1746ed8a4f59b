"""What this machine offers omnidraft: versions, optional backends, presets, what was measured on it.

Returns lines of text for `omnidraft doctor` to print. With a drafter, each drafter backend is
tried for real in a child process (the model loaded, a few tokens drafted), so a backend that
crashes this machine shows here and not in a pairing; then which backend a pairing will draft on,
and why. Loads a model in this process only when asked for a target's kernel plan.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from ..errors import MissingModelError
from ..runtime import measured
from ..runtime.kernels import BUCKETS
from ..store import presets

__all__ = ["backends", "clear_cache", "disk", "report", "reset"]

_BACKENDS = {
    "onnxruntime": "ONNX Runtime drafter (export/)",
    "llama_cpp": "llama.cpp (llama-cpp-python)",
    "fastapi": "verification server (serve)",
    "httpx": "remote client",
}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _preset_state(name: str) -> str:
    """Installed or not, whether its file was checked against its pinned SHA-256, and where it is from."""
    preset = presets.PRESETS[name]
    origin = f"{preset.original}; from {preset.source}"
    try:
        path = presets.file_path(preset)
    except MissingModelError as exc:  # it names its pip command
        return f"missing ({exc}); {origin}"
    checked = path.exists() and presets.checked(preset, path)
    pin = f"sha256 {preset.sha256[:12]}... " + ("matched" if checked else "checked at its first load")
    return f"installed, {pin}; {origin}"


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


SMOKE_TIMEOUT_S = 600.0
_DRAFT_CHILD = """
import sys
from omnidraft.draft.base import Drafter
drafter = Drafter.load(sys.argv[1], backend=sys.argv[2])
session = drafter.begin(drafter.tokenizer("def add(a, b):")["input_ids"])
print(len(session.propose(3, stop_confidence=0).ids), "tokens drafted")
"""
_ORT_CHILD = """
import numpy as np, onnx, onnxruntime as ort
from onnx import TensorProto, helper
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "smoke", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
model.ir_version = 8
out = ort.InferenceSession(model.SerializeToString()).run(None, {"x": np.array([-1, 2], "float32")})
assert out[0].tolist() == [0.0, 2.0]
print("a test graph ran")
"""


def _child(code: str, *argv: str) -> str:
    """ "ok (...)" with what the child printed last and its time, or "FAILED: " how it ended."""
    from ..llamacpp.smoke import ending, run_child

    started = time.perf_counter()
    status, out, err = run_child(code, *argv, timeout=SMOKE_TIMEOUT_S)
    if status == 0:
        return f"ok ({out or 'done'}, {time.perf_counter() - started:.1f} s in a child process)"
    return f"FAILED: {ending(status, err, SMOKE_TIMEOUT_S)}"


def _gguf(spec: str) -> str | None:
    """The GGUF file llama.cpp would run for drafter `spec`, or None (not a preset or .gguf)."""
    from ..llamacpp.loading import gguf_file

    try:
        return os.fspath(gguf_file(spec)[0])
    except (ValueError, FileNotFoundError):
        return None


def backends(spec: str) -> list[str]:
    """Each drafter backend tried on drafter `spec` in a child process, then which one a pairing
    drafts on here and why (draft/base.py `Drafter.load`, runtime/backends.py)."""
    from ..draft.base import BACKEND_ENV

    lines = [f"drafter {spec}, each backend tried in a child process:"]
    lines.append(f"  torch: {_child(_DRAFT_CHILD, spec, 'torch')}")
    gguf, llama = _gguf(spec), "no"
    if not _installed("llama_cpp"):
        lines.append(
            "  llama.cpp: not installed (pip install -c constraints.txt '.[llama]', or `make install`)"
        )
    elif gguf is None:
        lines.append("  llama.cpp: not for this drafter (it runs a preset or a .gguf file)")
    else:
        from ..llamacpp.smoke import runs

        verdict = runs(gguf)  # a child process once per machine, build and file; remembered
        llama = "ok" if verdict == "ok" else "broken"
        lines.append(
            f"  llama.cpp: {'ok (loads the file, drafts)' if llama == 'ok' else 'FAILED: ' + verdict}"
        )
    if not _installed("onnxruntime"):
        lines.append("  onnx: not installed (pip install -c constraints.txt '.[onnx]')")
    elif spec.endswith(".onnx"):
        lines.append(f"  onnx: {_child(_DRAFT_CHILD, spec, 'onnx')}")
    else:
        lines.append(f"  onnx: onnxruntime {_child(_ORT_CHILD)}; drafts a graph from `omnidraft export`")
    chosen = os.environ.get(BACKEND_ENV)
    if chosen:
        lines.append(f"a pairing drafts on {chosen}: ${BACKEND_ENV} says so")
    elif llama == "ok":
        names = {spec, os.path.basename(spec).removesuffix(".gguf")}
        timed = [
            f"{key.split('|')[1]} {value:.1f} ms"
            for key, value in sorted(measured.read("drafting-cost").items())
            if key.split("|")[0] in names and "head full" in key
        ]
        lines.append(
            "a pairing drafts on PyTorch, or through the same file on llama.cpp where that drafts a "
            "token faster here and the pairing needs nothing only PyTorch has (learning, adapters, "
            "a profile, a head): "
            + (f"a token timed here: {', '.join(timed)}" if timed else "timed at the first pair()")
            + f"; --drafter-backend torch or ${BACKEND_ENV}=torch keeps it on PyTorch"
        )
    else:
        why = "llama.cpp failed its smoke test here" if llama == "broken" else "no llama.cpp copy to run"
        lines.append(f"a pairing drafts on PyTorch ({why})")
    return lines


# what the cache holds: what is built again at next use (`omnidraft doctor --clear-cache` removes it),
# then what is kept (a user's profiles; the measurements, which `--reset` forgets)
REBUILT = {
    "gguf": "the presets' GGUF files assembled from their packages' parts; llama.cpp drafters' Q8_0 copies",
    "converted": "fp32 copies of the presets that PyTorch or an OpenVINO export reads",
    "openvino": "presets exported to OpenVINO IR",
    "shortlists": "shortlisted drafter heads",
}
KEPT = {
    "profiles": "pairing profiles: adapters, n-gram caches, users' past outputs (never cleared here)",
    "measured": "what was measured on this machine (`omnidraft doctor --reset` forgets it)",
}


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _human(size: int) -> str:
    return f"{size / 2**30:.1f} GB" if size >= 2**30 else f"{size / 2**20:.0f} MB"


def disk() -> list[str]:
    """What the cache holds on disk, by part and for the rebuilt parts by entry."""
    root = presets.cache_dir()
    parts = [(name, root / name) for name in (*REBUILT, *KEPT) if (root / name).is_dir()]
    sizes = {name: _size(path) for name, path in parts}
    lines = [f"cache {root}: {_human(sum(sizes.values()))} (OMNIDRAFT_CACHE moves it)"]
    for name, path in parts:
        lines.append(f"  {name}/ {_human(sizes[name])}: {REBUILT.get(name) or KEPT[name]}")
        if name in REBUILT:
            entries = sorted(p for p in path.iterdir() if not p.name.startswith("."))
            lines += [f"    {p.name} {_human(_size(p))}" for p in entries]
    if any(name in REBUILT for name, _ in parts):
        lines.append("  `omnidraft doctor --clear-cache` removes what is rebuilt at next use")
    return lines


def clear_cache() -> list[str]:
    """Remove the cache's rebuilt parts (REBUILT); profiles and measurements stay. A line each."""
    root = presets.cache_dir()
    lines = []
    for name in REBUILT:
        path = root / name
        if path.is_dir():
            size = _size(path)
            shutil.rmtree(path)
            lines.append(f"removed {path} ({_human(size)}; rebuilt at next use)")
    return lines or [f"nothing to clear under {root}"]


def reset() -> list[str]:
    """Forget every per-machine measurement; one line per file removed."""
    removed = measured.reset()
    return [f"removed {path}" for path in removed] or [f"nothing measured under {measured.directory()}"]


def report(targets: Sequence[str] = (), drafter: str | None = None) -> list[str]:
    """The doctor's lines; with `drafter`, each drafter backend tried on it (`backends`); with
    `targets`, each one's kernel plan (timed now if not cached)."""
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
    lines += _measurements() + _drafter_weights() + disk()
    if drafter is not None:
        lines += backends(drafter)
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
