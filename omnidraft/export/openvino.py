"""A causal LM exported to OpenVINO IR (optimum-intel's stateful "text-generation-with-past" export,
weights compressed by NNCF), for `OpenVINOTarget` (targets/openvino_target.py).

optimum-intel pins a transformers other than the one this package runs, so the export runs in a
Python that has it (`openvino_python`: the argument, else `$OMNIDRAFT_OPENVINO_PYTHON`), as a
subprocess. What runs the exported model is only the `openvino` runtime, in this process. A preset
(or a .gguf file) is converted once to safetensors (store/models.py) and exported once per weight
format into the cache (`$OMNIDRAFT_CACHE/openvino/`), written atomically, one process at a time.
What this is not: the runtime (the target) or ONNX export (export/onnx.py, export/via_optimum.py).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

from ..errors import IncompatibleError
from ..runtime.notice import one_time

__all__ = ["WEIGHTS", "export_openvino", "exported", "openvino_python"]

log = logging.getLogger("omnidraft.export")

WEIGHTS = ("int8", "int4", "fp16")
INSTALL = (
    "python -m venv openvino-env && openvino-env/bin/pip install torch 'optimum-intel[openvino]' && "
    "openvino-env/bin/pip uninstall -y torchvision, "
    "then set OMNIDRAFT_OPENVINO_PYTHON=openvino-env/bin/python"
)


def openvino_python(given: str | None = None) -> str:
    """The Python that runs optimum-intel's exporter."""
    from .via_optimum import exporter_python

    needs = (
        "exporting to OpenVINO needs a Python with optimum-intel, which pins another transformers than "
        "this package runs"
    )
    return exporter_python(given, "OMNIDRAFT_OPENVINO_PYTHON", needs, "optimum-intel's exporter", INSTALL)


def export_openvino(source: str | os.PathLike[str], out: Path, *, weights: str = "int8", python: str) -> Path:
    """optimum-intel's export of the HF model directory `source` to `out`, weights in `weights`
    (int8 per channel, int4 per group of 128 for every layer, or fp16); a clear error naming the
    reason when it cannot."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    command = [
        python,
        "-m",
        "optimum.commands.optimum_cli",
        "export",
        "openvino",
        "--model",
        os.fspath(source),
    ]
    command += ["--task", "text-generation-with-past", "--weight-format", weights]
    if weights == "int4":
        command += ["--ratio", "1.0", "--group-size", "128"]
    run = subprocess.run([*command, os.fspath(out)], capture_output=True, text=True)
    if run.returncode != 0 or not (out / "openvino_model.xml").is_file():
        lines = [line for line in (run.stderr or run.stdout).splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if "Error" in line or "support" in line), "")
        raise IncompatibleError(f"optimum-intel cannot export {source}: {reason or (lines or ['?'])[-1]}")
    return out


def exported(spec: str, *, weights: str = "int8", python: str | None = None) -> Path:
    """The OpenVINO IR directory of `spec`: an exported directory as it is, else a preset, .gguf
    file, local HF directory or HF id exported once into the cache and found there after."""
    from ..store.atomic import atomic_path, build_lock
    from ..store.models import hf_directory
    from ..store.presets import cache_dir

    given = Path(spec).expanduser()
    if (given / "openvino_model.xml").is_file():
        return given
    source = Path(hf_directory(spec))
    size = sum(p.stat().st_size for p in source.glob("*.safetensors")) if source.is_dir() else 0
    out = cache_dir() / "openvino" / f"{source.name}-{size}-{weights}"
    if (out / "openvino_model.xml").is_file():
        return out
    with build_lock(out):
        if (out / "openvino_model.xml").is_file():
            return out
        python = openvino_python(python)
        one_time("exporting %s to OpenVINO IR (%s weights) once, into %s: about a minute", spec, weights, out)
        started = time.perf_counter()
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out, directory=True) as tmp:
            export_openvino(source, Path(tmp), weights=weights, python=python)
        log.info("exported %s in %.0f s", spec, time.perf_counter() - started)
    return out
