"""Opening llama.cpp: the module (or how to install it), a preset's or path's GGUF file, and a
`llama_cpp.Llama` with the settings every engine here uses."""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Iterator

from ..errors import MissingDependencyError

__all__ = ["cpu_threads", "gguf_file", "open_llama", "require_llama_cpp"]

INSTALL_HINT = (
    "llama-cpp-python is not installed; `make install` builds it once per machine "
    "(pip install llama-cpp-python==0.3.36 compiles llama.cpp for several minutes)"
)


def cpu_threads() -> int:
    """The CPUs this process may run on (its affinity: a container's or `taskset`'s share, where
    `os.cpu_count()` reports the host's), the threads llama.cpp gets unless told."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def require_llama_cpp() -> Any:
    """The `llama_cpp` module, or a MissingDependencyError that says how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise MissingDependencyError(INSTALL_HINT) from exc
    return llama_cpp


def gguf_file(spec: str | os.PathLike[str]) -> tuple[Path, str]:
    """(path, name) of a preset name or a .gguf path."""
    from ..store.presets import PRESETS, gguf_path

    spec = os.fspath(spec)
    if spec in PRESETS:
        return gguf_path(spec), spec
    path = Path(spec).expanduser()
    if path.suffix != ".gguf":
        raise ValueError(
            f"llama.cpp runs a preset ({', '.join(sorted(PRESETS))}) or a .gguf file, got {spec!r}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    return path, path.stem


@contextlib.contextmanager
def _no_repack(lc: Any) -> Iterator[None]:
    """llama-cpp-python's `Llama` takes no model-parameter for weight repacking: default it off
    while one is built (loading is rare and serialised by the import lock of whoever calls)."""
    module = lc.llama_cpp
    default = module.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    module.llama_model_default_params = params
    try:
        yield
    finally:
        module.llama_model_default_params = default


_LOAD_LOCK = threading.Lock()


def open_llama(
    path: str | os.PathLike[str],
    *,
    n_ctx: int = 4096,
    threads: int | None = None,
    n_batch: int = 512,
    flash_attn: bool = True,
    repack: bool = True,
    smoke_tested: bool = False,
    **extra: Any,
) -> Any:
    """A `llama_cpp.Llama` with the settings every engine here uses, so that a baseline (the
    engine's own `generate`, its own speculative decoding) runs exactly as our sessions do: flash
    attention (faster on CPU here), weights repacked unless `repack=False`. swa_full: a
    sliding-window model (Gemma 3) keeps every position, so any suffix can be removed. Unless
    `smoke_tested`, the file is first run in a child process once per machine and build (smoke.py):
    a build this CPU cannot run raises LlamaCppBrokenError instead of killing this process."""
    lc = require_llama_cpp()
    if not smoke_tested:
        from .smoke import check_runs

        check_runs(path)
    threads = threads or cpu_threads()
    with _LOAD_LOCK, contextlib.nullcontext() if repack else _no_repack(lc):
        llm = lc.Llama(
            model_path=os.fspath(path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            swa_full=True,
            flash_attn=flash_attn,
            verbose=False,
            **extra,
        )
    close_at_exit(llm)
    return llm


_OPEN: list[weakref.ref[Any]] = []  # in the order opened: closed last first (a context before its model)


def close_at_exit(native: Any) -> None:
    """Free `native` (a Llama, a LlamaContext: anything with `close`) before the interpreter tears
    its modules down, should it live until then: llama-cpp-python's own `__del__` runs after that
    and prints a TypeError on every exit of a script that never closed it."""
    _OPEN[:] = [ref for ref in _OPEN if ref() is not None] + [weakref.ref(native)]


@atexit.register
def _close_open() -> None:
    for ref in reversed(_OPEN):
        native = ref()
        if native is not None:
            with contextlib.suppress(Exception):
                native.close()
