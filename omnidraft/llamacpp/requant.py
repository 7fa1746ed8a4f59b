"""Which weights a llama.cpp drafter runs: the GGUF file as shipped, or the same file requantized
to 8 bits, whichever drafts a request in less time on this machine.

A drafter pays twice per request: once to read the prompt (and each retrieved copy) in batches,
then one step per drafted token. Sub-8-bit block formats without repacked batch kernels (Q4_1 on
some CPUs) read a prompt several times slower than Q8_0 while drafting a token no faster, and a
long prompt then costs more than the drafts save (docs/llamacpp.md). The requantized file keeps
every tensor that is already 8-bit or wider and rewrites the rest as Q8_0: its values stay within
a small fraction of a 4-bit step of the shipped ones, so drafts change little, and verification
keeps every output exact whatever the drafter proposes. Timed once per machine, file and llama.cpp
build, and remembered; the requantized file is written once, atomically, beside the other caches.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Any

from ..runtime.measured import remembered
from ..store.atomic import atomic_path, build_lock

__all__ = ["WEIGHTS", "drafting_weights", "requantized"]

WEIGHTS = ("auto", "shipped", "q8_0")
WIDE = frozenset({0, 1, 7, 32})  # llama_ftype: all F32, mostly F16, Q8_0, BF16: nothing to gain
REFERENCE = (512, 128)  # the request a choice is timed for: prompt tokens read, tokens drafted
TEXT = (
    "Summarize the article above in three sentences. def total(items):\n    return sum(i.price for i in "
    "items)\n"
    "The committee met on Tuesday and agreed to publish its findings before the end of the month. "
)


def requantized(path: str | os.PathLike[str], threads: int | None = None) -> Path:
    """`path` with its sub-8-bit tensors rewritten as Q8_0: made once under the cache directory
    (atomically: a crash leaves no partial file behind) and reused."""
    from ..store.presets import cache_dir
    from .loading import cpu_threads, require_llama_cpp

    path = Path(path)
    out = cache_dir() / "gguf" / f"{path.stem}.{path.stat().st_size}.q8_0.gguf"
    if out.exists():
        return out
    lc = require_llama_cpp()
    from llama_cpp._utils import suppress_stdout_stderr

    params = lc.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = (
        lc.LLAMA_FTYPE_MOSTLY_Q8_0,
        True,
        threads or cpu_threads(),
    )
    with build_lock(out):
        if out.exists():  # another process wrote it while this one waited
            return out
        with atomic_path(out) as tmp:
            with suppress_stdout_stderr(disable=False):
                failed = lc.llama_model_quantize(os.fsencode(path), os.fsencode(tmp), ctypes.byref(params))
            if failed or not tmp.stat().st_size:
                raise RuntimeError(f"llama.cpp could not requantize {path} to Q8_0 (code {failed})")
    return out


def file_type(llm: Any) -> int | None:
    """The GGUF file's `general.file_type` (a llama_ftype), None where it does not say."""
    value = llm.metadata.get("general.file_type")
    return int(value) if value is not None and str(value).isdigit() else None


def request_ms(engine: Any, ids: list[int], *, drafted: int = 16) -> dict[str, float]:
    """ms per prompt token read in batches and per token drafted one at a time, on `engine`."""
    read = []
    for _ in range(2):
        engine.reset()
        started = time.perf_counter()
        engine.logits(ids, 1)
        read.append((time.perf_counter() - started) * 1e3 / len(ids))
    tokens, started = list(ids), time.perf_counter()
    for _ in range(drafted):
        tokens.append(int(engine.logits(tokens, 1)[0].argmax()))
    engine.reset()
    return {
        "read_ms": round(min(read), 4),
        "draft_ms": round((time.perf_counter() - started) * 1e3 / drafted, 3),
    }


def reference_ms(timed: dict[str, float]) -> float:
    """Time for the reference request: REFERENCE's prompt read, then its tokens drafted."""
    return REFERENCE[0] * timed["read_ms"] + REFERENCE[1] * timed["draft_ms"]


def drafting_weights(path: Path, engine: Any, weights: str = "auto", *, threads: int | None = None) -> Path:
    """The file a drafter on `path` runs (`engine`: `path` already loaded). "shipped": `path`;
    "q8_0": its requantization; "auto": whichever takes less time for the reference request here,
    timed once per machine and remembered (a wide file, already 8-bit or more, stays as it is)."""
    if weights not in WEIGHTS:
        raise ValueError(f"llama.cpp drafter weights must be one of {WEIGHTS}, got {weights!r}")
    if weights == "shipped" or (weights == "auto" and file_type(engine.llm) in WIDE):
        return path
    if weights == "q8_0":
        return requantized(path, threads)
    from .engine import LlamaEngine

    def measure() -> dict[str, Any]:
        ids = engine.tokenize(TEXT * 16)[: REFERENCE[0]]
        shipped = request_ms(engine, ids)
        candidate = LlamaEngine(requantized(path, threads), threads=engine.threads, exact_rows=1)
        q8 = request_ms(candidate, ids)
        use = "q8_0" if reference_ms(q8) < reference_ms(shipped) else "shipped"
        return {"shipped": shipped, "q8_0": q8, "use": use}

    timed = remembered("drafter-weights", engine.measure_key(), measure)
    return requantized(path, threads) if timed["use"] == "q8_0" else path
