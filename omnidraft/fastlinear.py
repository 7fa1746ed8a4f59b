"""CPU layout for a frozen target's linear layers: gemv for one row, oneDNN for several.

On x86 CPUs without AMX, PyTorch's default fp32 GEMM (MKL) is fast for a single token (gemv) but
slows sharply from two rows on (measured on this 2-core AMD host: a 151,936 x 896 LM head takes
50 ms for 1 row, 100 ms for 2, 146 ms for 5; oneDNN takes 88 ms for 5). Speculative verification
is exactly the many-rows case, so each nn.Linear is swapped for one that keeps its dense weight for
one-row calls and a oneDNN-packed copy for the rest. One-row steps, which is all that plain
target-alone decoding does, run the unchanged code path. Inference only; costs a second copy of
each weight.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

__all__ = ["use_dual_linear"]

log = logging.getLogger(__name__)


class DualLinear(nn.Module):
    """A frozen linear layer: `F.linear` for one row, a oneDNN-packed weight for more."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from torch.utils import mkldnn

        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._packed = mkldnn.to_mkldnn(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows == 1 or torch.is_grad_enabled() or x.dtype != torch.float32:
            return nn.functional.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features).contiguous()
        return self._packed(flat.to_mkldnn()).to_dense().reshape(*x.shape[:-1], self.out_features)


def use_dual_linear(model: nn.Module) -> int:
    """Swap every fp32 nn.Linear of `model` (frozen) for a `DualLinear`; returns how many."""
    if not torch.backends.mkldnn.is_available():
        log.info("oneDNN is not available; keeping the default linear layers")
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype == torch.float32]
    for parent, name, child in swaps:
        setattr(parent, name, DualLinear(child))
    return len(swaps)
