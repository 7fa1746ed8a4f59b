"""Where a model runs: a torch dtype and device from what a user passes."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "resolve_device", "resolve_dtype"]


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A torch dtype from a name or a dtype; None is float32."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be one of {sorted(set(DTYPES))} or a torch dtype among them, got {dtype!r}")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch device that exists here; None is the CPU. An absent accelerator is named in the error."""
    try:
        where = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}") from exc
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device is available here (torch {torch.__version__})")
    if where.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS is not available here")
    if where.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}")
    return where
