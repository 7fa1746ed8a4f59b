"""Which CPU kernel runs each frozen linear layer, chosen by timing them on the machine that runs.

Two paths compute the same fp32 `x @ W.T + b` from the one dense weight: stock `F.linear` (MKL's
GEMM/gemv) and oneDNN (`torch.ops.mkldnn._linear_pointwise` on the plain weight, no packed copy).
Which is faster depends on the host and on the number of rows: on one 2-core EPYC MKL's one-row
gemv wins, on another oneDNN wins at every row count (docs/kernels.md). So nothing is assumed:
`kernel_plan` times both paths for every distinct layer shape at the row counts a decode step, a
verification and a prefill use, and `use_kernels` swaps each `nn.Linear` for a `KernelLinear` that
dispatches by row count. The plan is kept per machine and layer shape (measured.py), so a second
load does not time again. Never a second copy of a weight.

This module knows layers and timings only: no tokenizer, no decoding.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Iterator

import torch
from torch import nn

from . import measured
from .notice import one_time

__all__ = [
    "BUCKETS",
    "PATHS",
    "KernelLinear",
    "KernelPlan",
    "kernel_plan",
    "median_ms",
    "stock_kernels",
    "use_kernels",
]

log = logging.getLogger(__name__)

PATHS = ("dense", "onednn")
BUCKETS = (1, 2, 4, 8, 16, 64)  # a call of r rows runs the path chosen for the smallest bucket >= r
PLAN_VERSION = 2  # 2: timed with cold caches


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _shape_key(out_features: int, in_features: int, bias: bool) -> str:
    return f"{out_features}x{in_features}{'+b' if bias else ''}"


class KernelLinear(nn.Module):
    """A frozen fp32 linear layer that runs, for each row count, the path its plan chose.

    `paths[i]` serves calls of at most BUCKETS[i] rows (the last one serves every larger call).
    Training (grad enabled) and non-fp32 inputs always take stock `F.linear`."""

    def __init__(self, linear: nn.Linear, paths: tuple[str, ...]) -> None:
        super().__init__()
        if len(paths) != len(BUCKETS) or any(p not in PATHS for p in paths):
            raise ValueError(f"paths must name one of {PATHS} per bucket {BUCKETS}, got {paths!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same tensors: no copy
        self.paths = paths
        self.stock = False  # True: every call on F.linear (the stock HF row of a benchmark)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stock or torch.is_grad_enabled() or x.dtype != torch.float32:
            return nn.functional.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        path = self.paths[min(bisect_left(BUCKETS, rows), len(BUCKETS) - 1)]
        if path == "dense":
            return nn.functional.linear(x, self.weight, self.bias)
        return _onednn(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, paths {dict(zip(BUCKETS, self.paths))}"


@dataclass(frozen=True)
class KernelPlan:
    """Per layer shape ("OUTxIN[+b]"): the chosen path per bucket and each path's median ms there."""

    host: str
    choices: dict[str, tuple[str, ...]]
    ms: dict[str, dict[str, list[float]]]

    def summary(self) -> list[str]:
        """One line per shape: the chosen path and both timings at each bucket."""
        lines = []
        for shape, paths in sorted(self.choices.items(), key=lambda kv: -_size(kv[0])):
            cells = [
                f"{rows}:{path}({self.ms[shape]['dense'][i]:.2f}/{self.ms[shape]['onednn'][i]:.2f})"
                for i, (rows, path) in enumerate(zip(BUCKETS, paths))
            ]
            lines.append(f"{shape:>16}  " + " ".join(cells))
        return lines


def _size(shape: str) -> int:
    out, _, rest = shape.partition("x")
    return int(out) * int(rest.split("+")[0])


COLD_BYTES = 256 << 20  # weights rotated through per timing: more than a CPU's last-level cache


def median_ms(fn: Any, weights: Any, reps: int) -> float:
    """Median over `reps` passes of the mean ms of `fn(w)` over `weights` (a sequence of inputs), after
    one warm pass."""
    for w in weights:
        fn(w)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        for w in weights:
            fn(w)
        times.append((time.perf_counter() - started) / len(weights))
    return 1000 * median(times)


@torch.inference_mode()
def _time_shape(linear: nn.Linear, reps: int) -> dict[str, list[float]]:
    """Median ms of each path at each bucket's row count. A model's forward streams its weights
    from memory, so each call reads a different copy of the weight, COLD_BYTES in all (the layer's
    own weight when it alone is that large): a single weight timed again and again would stay
    in cache and flatter the one-row paths."""
    b = linear.bias
    copies = max(1, min(32, COLD_BYTES // (linear.weight.numel() * linear.weight.element_size())))
    weights = [linear.weight] + [torch.randn_like(linear.weight) for _ in range(copies - 1)]
    out: dict[str, list[float]] = {p: [] for p in PATHS}
    for rows in BUCKETS:
        x = torch.randn(rows, linear.in_features)
        out["dense"].append(median_ms(lambda w: nn.functional.linear(x, w, b), weights, reps))
        out["onednn"].append(median_ms(lambda w: _onednn(x, w, b), weights, reps))
    return out


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == torch.float32
    ]


def kernel_plan(model: nn.Module, *, cache: Path | None = None, reps: int = 3) -> KernelPlan:
    """The fastest path per bucket for every distinct fp32 linear shape of `model` on this machine:
    read from the per-machine cache, timing only shapes it does not hold yet (then saved)."""
    kind = f"kernel-plan-v{PLAN_VERSION}"
    known = measured.read(kind, root=cache)
    seen: dict[str, nn.Linear] = {}
    for _, _, lin in _linears(model):
        seen.setdefault(_shape_key(lin.out_features, lin.in_features, lin.bias is not None), lin)
    missing = [key for key in seen if key not in known]
    if missing and torch.backends.mkldnn.is_available():
        started = time.perf_counter()
        one_time("timing %d linear kernel shape(s) once on this machine (a few seconds each)", len(missing))
        for key in missing:
            known[key] = _time_shape(seen[key], reps)
        path = measured.update(kind, {key: known[key] for key in missing}, root=cache)
        log.info(
            "timed %d linear shape(s) on this machine in %.1f s; kept in %s",
            len(missing),
            time.perf_counter() - started,
            path,
        )
    ms = {key: known[key] for key in seen if key in known}
    choices = {
        key: tuple(min(PATHS, key=lambda p: t[p][i]) for i in range(len(BUCKETS))) for key, t in ms.items()
    }
    return KernelPlan(host=measured.machine_key(), choices=choices, ms=ms)


def use_kernels(model: nn.Module, plan: KernelPlan | None = None, **kwargs: Any) -> KernelPlan | None:
    """Swap every frozen fp32 nn.Linear of `model` for a `KernelLinear` on `plan` (measured now, or
    read from the cache, when not given). Returns the plan, also kept as `model.kernel_plan`;
    None when oneDNN is not available (the layers stay stock)."""
    if not torch.backends.mkldnn.is_available():
        log.info("oneDNN is not available; keeping the stock linear layers")
        return None
    plan = plan or kernel_plan(model, **kwargs)
    for parent, name, child in _linears(model):
        paths = plan.choices.get(_shape_key(child.out_features, child.in_features, child.bias is not None))
        if paths is not None:
            setattr(parent, name, KernelLinear(child, paths))
    setattr(model, "kernel_plan", plan)  # (a plain attribute of the module)
    return plan


@contextmanager
def stock_kernels(model: nn.Module) -> Iterator[None]:
    """Within the block every `KernelLinear` of `model` runs stock `F.linear` (what an unmodified
    HF model does on this machine); the plan is back afterwards."""
    layers = [m for m in model.modules() if isinstance(m, KernelLinear)]
    for layer in layers:
        layer.stock = True
    try:
        yield
    finally:
        for layer in layers:
            layer.stock = False
