"""Dynamic int8 for drafters: per-channel weights, with SmoothQuant-style smoothing of the MLPs.

Dynamic int8 cuts a drafter's step on CPU to about a third and costs acceptance, because each call
scales its activations by one number and a few channels of the MLP activations are far larger
than the rest. Two fixes: per-channel weight scales, and moving the activation outliers of each
MLP into its weights before quantizing (SmoothQuant, Xiao et al. 2023): the down projection's
input channel j is divided by s_j in the up projection's output and multiplied back in the down
projection's weights, and likewise the gate/up input through the post-attention RMSNorm. In fp32
both folds leave the model's function unchanged. Scales come from a forward over `CALIBRATION`, a
few sentences of prose, arithmetic and code (at load time). What each fix is worth:
docs/drafter-acceptance.md.

`fake_int8` turns a quantized model into one that trains, sharing its weights: each int8 linear
is read by a `FakeInt8Linear` that computes what the int8 kernel computes, in fp32 with gradients.
An adapter trained through it learns the function the drafter drafts with, quantization error
included (distill/adapters.int8_learner).

For drafters only. The target is never quantized dynamically: per-call activation scales make a
k-token verify differ from k single steps, so greedy identity would not hold. MLPs with a LoRA
adapter on their projections are left unsmoothed (the fold would change what the adapter sees).
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import torch
from torch import nn

__all__ = [
    "CALIBRATION",
    "FakeInt8Linear",
    "fake_int8",
    "int8_qconfig",
    "int8_rows",
    "int8_weight",
    "quantize_int8",
    "smooth_mlps",
]

CALIBRATION = (
    "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. "
    "How many clips did Natalia sell altogether in April and May?\nAnswer: Let's think step by step. "
    "In May she sold 48 / 2 = 24 clips. Altogether she sold 48 + 24 = 72 clips.\n#### 72",
    'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nprint([fib(i) for i in range(10)])\n",
    "The committee met on Tuesday to review the budget. After a long discussion, the members agreed that "
    "the new library would open in the spring, and that its reading rooms would stay open until ten at "
    "night.",
    '{"id": 17, "name": "sensor-a", "values": [0.5, 1.25, -3.0], "ok": true}\n'
    "SELECT name, COUNT(*) FROM orders WHERE total > 100 GROUP BY name ORDER BY 2 DESC;",
)

_NORM_FOLD = ("llama", "qwen2", "mistral")  # RMSNorm computes weight * x_hat: a scale folds into its weight


def int8_qconfig(per_channel: bool = True) -> Any:
    """int8 weights with one scale per output channel (or per tensor), activations scaled per call."""
    q = torch.ao.quantization
    return q.per_channel_dynamic_qconfig if per_channel else q.default_dynamic_qconfig


@torch.no_grad()
def smooth_mlps(model: Any, tokenizer: Any, *, down_alpha: float = 0.75, gate_alpha: float = 0.5) -> int:
    """Fold SmoothQuant scales into every plain MLP of `model` (in place); returns how many.

    For the down projection s_j = a_j^alpha / w_j^(1 - alpha), a_j the largest |input| of channel
    j over `CALIBRATION` and w_j the largest |weight| of input column j; alpha = `down_alpha`
    (0.75 measured best of 0.5-1.0), `gate_alpha` (0.5) for the gate/up input. A model whose
    architecture is not known to compute its norm as weight * x_hat is left as it is (returns 0).
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in _NORM_FOLD:
        return 0
    layers = [m for m in model.modules() if _plain_mlp(m)]
    peak = _input_peaks(
        model, tokenizer, [p for layer in layers for p in (layer.mlp.gate_proj, layer.mlp.down_proj)]
    )
    for layer in layers:
        mlp = layer.mlp
        s = _scales(peak[mlp.down_proj], mlp.down_proj.weight.abs().amax(0), down_alpha)
        mlp.down_proj.weight.mul_(s[None, :])
        mlp.up_proj.weight.div_(s[:, None])
        w = torch.maximum(mlp.gate_proj.weight.abs().amax(0), mlp.up_proj.weight.abs().amax(0))
        s = _scales(peak[mlp.gate_proj], w, gate_alpha)
        layer.post_attention_layernorm.weight.div_(s)
        mlp.gate_proj.weight.mul_(s[None, :])
        mlp.up_proj.weight.mul_(s[None, :])
    return len(layers)


def _plain_mlp(layer: nn.Module) -> bool:
    """A decoder layer whose gated MLP projections are all plain nn.Linear (no adapter on them)."""
    mlp, norm = getattr(layer, "mlp", None), getattr(layer, "post_attention_layernorm", None)
    return (
        mlp is not None
        and norm is not None
        and isinstance(getattr(norm, "weight", None), torch.Tensor)
        and all(type(getattr(mlp, p, None)) is nn.Linear for p in ("gate_proj", "up_proj", "down_proj"))
    )


def _input_peaks(model: Any, tokenizer: Any, linears: list[nn.Module]) -> dict[nn.Module, torch.Tensor]:
    """Largest |input| per channel of each of `linears` over the calibration texts."""
    peak: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].detach().abs().flatten(0, -2).amax(0)
        peak[module] = torch.maximum(peak[module], x) if module in peak else x

    hooks = [linear.register_forward_pre_hook(record) for linear in linears]
    try:
        for text in CALIBRATION:
            model(input_ids=torch.tensor([tokenizer(text)["input_ids"]]))
    finally:
        for hook in hooks:
            hook.remove()
    return peak


def _scales(activation: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    return activation.clamp_min(1e-5) ** alpha / weight.clamp_min(1e-5) ** (1 - alpha)


def quantize_int8(
    model: Any,
    tokenizer: Any | None = None,
    *,
    inplace: bool = False,
    only: set[str] | None = None,
    per_channel: bool = True,
) -> Any:
    """Dynamic int8 copy of `model` (or `model` itself with `inplace`): its MLPs smoothed when a
    `tokenizer` is given for the calibration forward, then every nn.Linear (or those named in
    `only`) quantized with per-channel weights (one scale per tensor with `per_channel=False`,
    kept for comparison: `python -m benchmarks replay --drafter int8-per-tensor`)."""
    if not inplace:
        model = copy.deepcopy(model)
    if tokenizer is not None:
        smooth_mlps(model, tokenizer)
    linears = {n for n, m in model.named_modules() if type(m) is nn.Linear and (only is None or n in only)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ao.quantization.quantize_dynamic(
            model, {n: int8_qconfig(per_channel) for n in linears}, dtype=torch.qint8, inplace=True
        )
    return model.eval()


def int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in) as the int8 tensor `quantize_int8` gives a linear layer: symmetric, one
    scale per output channel, the row's largest |w| over 127.5 (torch.ao's per-channel weight
    observer, computed directly, and the same quantize call), without building a module."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / 127.5).clamp_min(torch.finfo(torch.float32).eps)
    zeros = torch.zeros(weight.shape[0], dtype=torch.long)
    return torch.quantize_per_channel(weight, scales.double(), zeros, 0, torch.qint8)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 values (V, d) and per-row scales (V,) of `int8_weight`: row i is approximately
    values[i] * scales[i]."""
    q = int8_weight(weight)
    return q.int_repr().clone(), q.q_per_channel_scales().float()


ACTIVATION_LEVELS = 127  # x86/fbgemm dynamic linears quantize activations to 7-bit uint8 (reduce_range)


class FakeInt8Linear(nn.Module):
    """A dynamic int8 linear in fp32, for training through it: the int8 weights of `source` (a
    torch.ao dynamic quantized Linear, read at each call and shared, not copied) dequantized, and
    each input row quantized as the kernel quantizes one call (asymmetric, `ACTIVATION_LEVELS` steps
    between min(x, 0) and max(x, 0)), with a straight-through gradient. On one row (a decode step)
    it matches the kernel to float rounding; over a longer call the kernel shares one scale across
    the rows, this keeps one per row. It has no parameters: nothing of it trains. The kernel's
    packed weights are unpacked once, at the first call, and kept (one byte a weight): unpacking
    them at every call cost more than the matmul itself."""

    source: Any  # a torch.ao dynamic quantized Linear, whose weight() and bias() are methods

    def __init__(self, source: nn.Module) -> None:
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.__dict__["source"] = source  # not a submodule: its weights stay the quantized model's
        self.__dict__["unpacked"] = None  # (int8 weight, bias), at the first call

    def int8_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The source's int8 weight (a quantized tensor) and its bias, unpacked once."""
        if self.__dict__["unpacked"] is None:
            self.__dict__["unpacked"] = (self.source.weight(), self.source.bias())
        return self.__dict__["unpacked"]

    @property
    def weight(self) -> torch.Tensor:
        return self.int8_weights()[0].dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo = x.detach().amin(-1, keepdim=True).clamp(max=0)
        hi = x.detach().amax(-1, keepdim=True).clamp(min=0)
        scale = ((hi - lo) / ACTIVATION_LEVELS).clamp_min(torch.finfo(x.dtype).tiny)
        zero = torch.round(-lo / scale)
        q = (torch.clamp(torch.round(x.detach() / scale) + zero, 0, ACTIVATION_LEVELS) - zero) * scale
        weight, bias = self.int8_weights()
        return nn.functional.linear(x + (q - x.detach()), weight.dequantize(), bias)


def fake_int8(model: Any) -> Any:
    """`model` (dynamically quantized) as a model that trains: the same module tree, sharing every
    tensor of `model` (no weight is copied), with each int8 linear a `FakeInt8Linear` over it: the
    same function in fp32, differentiable in its inputs (see module doc)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    swaps = {name: m for name, m in model.named_modules() if isinstance(m, DynamicLinear)}
    if not swaps:
        raise ValueError(
            "fake_int8 needs a model with dynamic int8 linears (quantize_int8); this one has none"
        )
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers(), swaps.values())}
    copied = copy.deepcopy(
        model, shared
    )  # copies the module tree; every tensor and int8 linear stays the same object
    for name in swaps:
        parent, _, child = name.rpartition(".")
        setattr(copied.get_submodule(parent) if parent else copied, child, FakeInt8Linear(swaps[name]))
    return copied
