"""Build llama-cpp-python from its sdist with one change, into a cached wheel (see the Makefile).

    python tools/llama_wheel.py 0.3.36 omnidraft.3 ~/.cache/omnidraft/wheels

The change: ggml's CPU flash attention splits the KV cache across threads for a single query once
the cache holds 512 cells or more (`use_split_kv_path` in ggml-cpu/ops.cpp), and reduces the
threads' partial sums afterwards; several queries in one call take the unsplit path. The two sum
in different orders, so past ~256 tokens of context a multi-token verify gave logits that differ
from one-token decoding, and a lossless verifier could feed only one token a call there
(docs/llamacpp.md). With the split off, one query is computed as each of several is. The engine
still measures which batches are exact (LlamaEngine.exact_limits): a stock build stays correct,
only slower at long contexts. The build enables this CPU's vector features by name, never AMX
(`cpu_flags`). The wheel's version gets a local tag (`+omnidraft.N`, the Makefile's
LLAMA_TAG), so it is told apart from a stock build everywhere, the engine's per-machine memo included.

The build also leaves out what the Python package never loads here: llama.cpp's `common` library
(the sdist forces it on, then installs nothing of it) and the multimodal `mtmd` library
(`LLAVA_BUILD`, imported by llama-cpp-python only for image chat handlers): docs/llamacpp.md,
"Building it".
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

SPLIT = "q->type == GGML_TYPE_F32 && nek1 >= 512;"
UNSPLIT = "q->type == GGML_TYPE_F32 && nek1 >= 512 && false;  /* omnidraft: one query sums as several do */"
COMMON = 'set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)'
NO_COMMON = COMMON.replace(" ON ", " OFF ") + "  # omnidraft: never installed"
# What the Python package does not need, left out of the compile (the module doc)
LEAVE_OUT = ["-DLLAVA_BUILD=OFF"]


def replace_once(path: Path, old: str, new: str, what: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{path}: {what} is not where this patch expects it; update tools/llama_wheel.py")
    path.write_text(text.replace(old, new))


def patch(root: Path, version: str, tag: str) -> None:
    ops = root / "vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp"
    replace_once(ops, SPLIT, UNSPLIT, "the split-KV condition")
    replace_once(root / "CMakeLists.txt", COMMON, NO_COMMON, "the forced common library")
    line = f'__version__ = "{version}"'
    replace_once(root / "llama_cpp/__init__.py", line, f'__version__ = "{version}+{tag}"', f"{line!r}")


def main(version: str, tag: str, wheels: str) -> None:
    out = Path(wheels).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    built = sorted(out.glob(f"llama_cpp_python-{version}+{tag}-*.whl"))
    if built:  # once a machine: the README's line may be run again at no cost
        print(f"already built: {built[-1]}")
        return
    pip = [sys.executable, "-m", "pip"]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        say(f"downloading the llama-cpp-python {version} source")
        subprocess.run(
            [
                *pip,
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={version}",
                "-d",
                tmp,
            ],
            check=True,
        )
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(tmp, filter="data")
        root = Path(tmp) / f"llama_cpp_python-{version}"
        patch(root, version, tag)
        options = [*LEAVE_OUT, os.environ.get("CMAKE_ARGS", ""), *cpu_flags()]
        env = {**os.environ, "CMAKE_ARGS": " ".join(options).strip()}
        say(f"compiling llama.cpp for this CPU ({env['CMAKE_ARGS']}): a few minutes on two cores")
        with Ticker(started):
            subprocess.run([*pip, "wheel", "-q", "--no-deps", str(root), "-w", str(out)], check=True, env=env)
    (wheel,) = sorted(out.glob(f"llama_cpp_python-{version}+{tag}-*.whl"))[-1:]
    say(f"built {wheel} in {time.monotonic() - started:.0f} s; pip install --find-links {out} ... finds it")


def say(line: str) -> None:
    print(f"llama_wheel: {line}", flush=True)


class Ticker:
    """Says every minute that the build still runs (pip -q prints nothing for minutes)."""

    def __init__(self, started: float, every: float = 60.0) -> None:
        self.started, self.every = started, every
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.wait(self.every):
            say(f"still compiling ({time.monotonic() - self.started:.0f} s so far)")

    def __enter__(self) -> Ticker:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()


# ggml's CMake options for the x86 features it can use, by the /proc/cpuinfo flag that offers each
FEATURES = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
    "avx_vnni": "GGML_AVX_VNNI",
}


def cpu_flags() -> list[str]:
    """What `-march=native` would enable, minus AMX: ggml's AMX code dies of SIGILL on a machine
    whose kernel does not grant the AMX tile state (a VM can list amx_tile and still refuse it), so
    the build names this CPU's other features itself. Elsewhere than x86 Linux: native, as stock."""
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return []
    have = set(flags.split(":", 1)[1].split())
    if "avx" not in have:
        return []
    return [
        "-DGGML_NATIVE=OFF",
        *(f"-D{option}={'ON' if flag in have else 'OFF'}" for flag, option in FEATURES.items()),
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
    ]


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: python tools/llama_wheel.py VERSION TAG WHEEL_DIR")
    main(*sys.argv[1:])
