"""Which engine here runs a model fastest: what `load_target(spec, engine="auto")` and `omnidraft
serve --engine auto` (targets/registry.py) load it on.

The engines that can run `spec` on this machine without a conversion of minutes (`candidates`)
each serve one request alone (a prompt of `PROMPT` tokens, `NEW` new tokens, greedy), timed once
per machine, model and engine build and remembered (runtime/measured.py); the fastest is loaded.
A request's time, prefill included, because engines differ there too: OpenVINO reads a long
prompt faster than llama.cpp, llama.cpp decodes the shipped GGUFs faster (docs/openvino.md).
A pairing then drafts only where that engine lets drafts pay (adaptive/floor.py). Where engines
are within `TIE` of the fastest, the one whose verify of a few tokens costs about one step (an
engine registered `verifies_flat`: OpenVINO, against llama.cpp's CPU kernels' several) is loaded:
a request on it is never slower than the fastest alone beyond that, and drafts can pay there.

Which engines are tried: llama.cpp for a preset or .gguf file its build runs here; OpenVINO where
its runtime is installed and either `spec` is an exported IR directory or an exporter is named
(`$OMNIDRAFT_OPENVINO_PYTHON`: an export takes a minute or two once; then with int8 and with int4
weights, whose speeds differ by host: docs/openvino.md); PyTorch on a GPU, or on a CPU where
nothing else can run `spec`.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Collection, cast

from ..runtime.measured import remembered

if TYPE_CHECKING:
    from ..target import DecodingSession, Target

__all__ = ["candidates", "fastest_engine", "llama_runs", "request_rate"]

log = logging.getLogger("omnidraft")

PROMPT, NEW = 200, 48  # the request each engine is timed on
TIE = 0.97  # engines at least this share of the fastest's rate count as fast as it
TEXT = (
    "The committee met on Tuesday to discuss the budget for the coming year. After a long debate "
    "about the roads, the schools and the library, the members agreed to a plan. "
)


def candidates(spec: str) -> list[str]:
    """The engines tried for `spec` on this machine (see the module doc), in that order."""
    found = []
    if llama_runs(spec):
        found.append("llama.cpp")
    if importlib.util.find_spec("openvino") is not None:
        if (Path(spec).expanduser() / "openvino_model.xml").is_file():
            found.append("openvino")
        elif os.environ.get("OMNIDRAFT_OPENVINO_PYTHON"):
            found += ["openvino", "openvino-int4"]
    if not found or _gpu():
        found.append("torch")
    return found


def fastest_engine(spec: str, load: Callable[[str], Target], flat: Collection[str] = ()) -> str:
    """The candidate engine that served the timed request fastest (the only one, untimed), or one
    within `TIE` of it among `flat` (engines whose verify of a few tokens costs about a step);
    `load(name)` loads `spec` on engine `name`."""
    names = candidates(spec)
    if len(names) == 1:
        return names[0]
    rates = {name: _rate(spec, name, load) for name in names}
    best = max(rates, key=rates.__getitem__)
    tied = [n for n in names if n in flat and rates[n] > 0 and rates[n] >= TIE * rates[best]]
    best = max(tied, key=rates.__getitem__) if tied else best
    log.debug(
        "%s: a request alone takes %s here: the target runs on %s",
        spec,
        ", ".join(f"{NEW / r:.2f} s on {n}" if r > 0 else f"failed on {n}" for n, r in rates.items()),
        best,
    )
    return best


def _rate(spec: str, name: str, load: Callable[[str], Target]) -> float:
    """Tokens a second of one request alone on engine `name`, measured once per machine; 0 where
    the engine cannot load or run `spec` (not kept: tried again next time)."""

    def measure() -> float:
        target = load(name)
        try:
            return request_rate(target)
        finally:
            del target
            gc.collect()

    try:
        return float(
            remembered(
                "request-alone",
                f"{spec}|{name}|{_build(name)}",
                measure,
                about=f"how fast one request decodes alone on {name}",
            )
        )
    except Exception as exc:  # noqa: BLE001 - an engine that cannot run it is simply not chosen
        log.info("%s: not on %s here (%s)", spec, name, exc)
        return 0.0


def request_rate(target: Target) -> float:
    """New tokens a second of one greedy request alone on `target`: a `PROMPT`-token prompt read,
    then `NEW` tokens decoded (after a short request that warms the engine)."""
    ids = list(target.tokenizer(TEXT * 12, add_special_tokens=False)["input_ids"])[:PROMPT]
    _decoded(target, ids[-16:], 4)
    started = time.perf_counter()
    n = _decoded(target, ids, NEW)
    return n / (time.perf_counter() - started)


def _decoded(target: Target, prompt: list[int], n: int) -> int:
    session = cast("DecodingSession", target.begin(prompt))  # (a target that decodes alone)
    try:
        return len(list(session.decode(n)))
    finally:
        session.close()


def llama_runs(spec: str) -> bool:
    """Whether llama.cpp runs `spec` here: a preset or .gguf file its build runs (llamacpp/smoke.py)."""
    from ..store.presets import PRESETS

    if not (spec in PRESETS or spec.endswith(".gguf")) or importlib.util.find_spec("llama_cpp") is None:
        return False
    from ..llamacpp.loading import gguf_file
    from ..llamacpp.smoke import runs

    return runs(gguf_file(spec)[0]) == "ok"


def _gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# each engine's Python module (int4 weights run on the same OpenVINO build)
_ENGINE_MODULES = {
    "llama.cpp": "llama_cpp",
    "openvino": "openvino",
    "openvino-int4": "openvino",
    "torch": "torch",
    "vllm": "vllm",
}


def _build(name: str) -> str:
    """The engine's build, part of what a timing is a function of."""
    module = _ENGINE_MODULES.get(name)
    if module is None or importlib.util.find_spec(module) is None:
        return "?"
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version({"llama_cpp": "llama_cpp_python"}.get(module, module))
    except PackageNotFoundError:
        return "?"
