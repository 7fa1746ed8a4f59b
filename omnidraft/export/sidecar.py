"""The exported drafter's sidecar: its format name, where it lives beside the graph, and the
graph file's digest that ties the two together. Shared by the exporter and the loader."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["SIDECAR_FORMAT", "file_sha256", "sidecar_path"]

SIDECAR_FORMAT = "omnidraft.onnx-drafter"


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sidecar_path(onnx: str | Path) -> Path:
    return Path(str(onnx) + ".json")
