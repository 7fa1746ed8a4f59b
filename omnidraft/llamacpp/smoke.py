"""Whether this machine's llama.cpp build runs a GGUF file at all, tried in a subprocess.

A llama-cpp-python wheel compiled elsewhere, or with `-march=native` on a CPU that lists features
it does not grant (AMX on some virtual machines), can die with a segmentation fault on its first
decode: no Python exception, the whole process gone. So before omnidraft runs a file on llama.cpp
(a drafter's llama.cpp copy it picks by itself, a llama.cpp target or drafter the user asked for),
a child process loads the file and decodes a few tokens. The verdict is kept per machine, build
and file (measured.py), so the child runs once; `omnidraft doctor --reset` forgets it. This module
does not choose a backend (backends.py does) and does not build llama.cpp (tools/llama_wheel.py).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from ..errors import OmnidraftError
from ..runtime import measured

__all__ = ["LlamaCppBrokenError", "check_runs", "ending", "run_child", "runs"]

log = logging.getLogger(__name__)

KIND = "llama-cpp-smoke"
TIMEOUT_S = 600.0  # a first load may dequantise and repack a large file on a slow machine
REBUILD = (
    "rebuild llama-cpp-python for this CPU: `make install` builds the wheel omnidraft tests "
    "(tools/llama_wheel.py, never AMX), or pass --drafter-backend torch / set "
    "OMNIDRAFT_DRAFTER_BACKEND=torch to keep drafting on PyTorch"
)
_CHILD = """
import sys
from omnidraft.llamacpp.loading import open_llama
llm = open_llama(sys.argv[1], n_ctx=256, smoke_tested=True)
ids = llm.tokenize(b"def add(a, b):")
for n, _ in enumerate(llm.generate(ids, temp=0.0, reset=True)):
    if n >= 3:
        break
print("ok")
"""


class LlamaCppBrokenError(OmnidraftError):
    """This machine's llama.cpp build crashed running a file; the message says how and what to do."""


def _build() -> str:
    """What a verdict is a function of besides the machine: the llama-cpp-python build itself."""
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    files = sorted(lib.glob("*.so*")) if lib.is_dir() else []
    stamp = ",".join(f"{p.name}:{p.stat().st_size}:{int(p.stat().st_mtime)}" for p in files)
    return f"{llama_cpp.__version__}|{stamp}"


def run_child(code: str, *argv: str, timeout: float = TIMEOUT_S) -> tuple[int | None, str, str]:
    """Run `code` in a child Python with `argv`: (its exit status, None for no answer within
    `timeout`; the last line of its stdout; the last line of its stderr)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None, "", ""
    last = lambda text: (text.strip().splitlines() or [""])[-1]  # noqa: E731
    return done.returncode, last(done.stdout), last(done.stderr)


def ending(status: int | None, err: str, timeout: float = TIMEOUT_S) -> str:
    """How a child that did not succeed ended (`run_child`'s status and stderr line), in words."""
    if status is None:
        return f"no answer in {timeout:.0f} s"
    if status < 0:
        return f"killed by {signal.Signals(-status).name}"
    return f"exit status {status}: {(err or 'no output')[:300]}"


def _try(path: str) -> str:
    """ "ok", or how the child that ran `path` ended."""
    status, out, err = run_child(_CHILD, path)
    if status == 0 and out.endswith("ok"):
        return "ok"
    how = ending(status, err)
    return f"{how} (a llama.cpp build this CPU cannot run)" if status is not None and status < 0 else how


def runs(path: str | os.PathLike[str]) -> str:
    """ "ok" when this build of llama.cpp loads `path` and decodes a few tokens in a child process,
    else how the child ended; tried once per machine, build and file, and remembered."""
    path = os.fspath(Path(path).resolve())
    key = f"{_build()}|{path}"
    verdict = str(measured.remembered(KIND, key, lambda: _try(path)))
    if verdict != "ok":
        log.warning("llama.cpp cannot run %s on this machine: %s; %s", Path(path).name, verdict, REBUILD)
    return verdict


def check_runs(path: str | os.PathLike[str]) -> None:
    """Raise LlamaCppBrokenError unless this machine's llama.cpp runs `path` (see `runs`)."""
    verdict = runs(path)
    if verdict != "ok":
        raise LlamaCppBrokenError(
            f"llama.cpp cannot run {Path(path).name} on this machine: {verdict}; {REBUILD}"
        )
