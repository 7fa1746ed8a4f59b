"""int8.py: per-channel dynamic int8 for drafters and the SmoothQuant fold of their MLPs."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from omnidraft.distill.adapters import AdapterConfig, add_adapter, int8_copy
from omnidraft.runtime.int8 import (
    FakeInt8Linear,
    fake_int8,
    int8_rows,
    int8_weight,
    quantize_int8,
    smooth_mlps,
)

from .conftest import tiny_llama

X = torch.tensor([[5, 6, 7, 8, 9, 10]])


def test_smoothing_folds_scales_without_changing_the_fp32_model(draft_tokenizer):
    model = tiny_llama(len(draft_tokenizer), seed=3)
    with torch.no_grad():  # give one MLP channel an outlier, as real LLMs have, so the scales are far from 1
        model.model.layers[0].mlp.up_proj.weight[7].mul_(40)
    smoothed = copy.deepcopy(model)
    assert smooth_mlps(smoothed, draft_tokenizer) == 2
    assert not torch.allclose(
        smoothed.model.layers[0].mlp.down_proj.weight, model.model.layers[0].mlp.down_proj.weight
    )
    with torch.no_grad():
        assert torch.allclose(smoothed(X).logits, model(X).logits, atol=1e-4)


def test_mlps_with_an_adapter_and_unknown_architectures_are_left_alone(draft_tokenizer):
    peft = add_adapter(
        tiny_llama(len(draft_tokenizer), seed=4), "a", AdapterConfig(rank=2, alpha=4, modules=("up_proj",))
    )
    assert smooth_mlps(peft, draft_tokenizer) == 0  # every MLP has a LoRA on up_proj
    assert smooth_mlps(SimpleNamespace(config=SimpleNamespace(model_type="gemma3")), draft_tokenizer) == 0


def test_quantize_int8_copies_quantizes_per_channel_and_stays_close(draft_tokenizer):
    model = tiny_llama(len(draft_tokenizer), seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = quantize_int8(model, draft_tokenizer)
    assert all(
        torch.equal(v, before[k]) for k, v in model.state_dict().items()
    )  # the fp32 model is untouched
    linears = [m for m in q.modules() if "quantized" in type(m).__module__ and hasattr(m, "weight")]
    assert linears and all(m.weight().qscheme() == torch.per_channel_affine for m in linears)
    with torch.no_grad():
        ref, got = model(X).logits, q(X).logits
    assert torch.allclose(got, ref, atol=0.05 * ref.abs().max())


def test_int8_weight_is_the_weight_quantize_int8_gives_a_linear():
    """One rule for a linear's int8 weight: `int8_weight` (adapters merged into an int8 drafter, the
    exported head's rows) equals what `quantize_int8` builds, values and scales, a zero row too."""
    torch.manual_seed(0)
    weight = torch.randn(48, 40) * torch.rand(48, 1)
    weight[3] = 0.0
    weight[5, :4] = torch.tensor([1.0, 0.5, -0.25, 127.5 / 255])  # halves of a step: ties to round
    linear = nn.Linear(40, 48, bias=False)
    linear.weight = nn.Parameter(weight)
    reference, _ = quantize_int8(nn.Sequential(linear))[0]._weight_bias()
    got = int8_weight(weight)
    assert torch.equal(got.int_repr(), reference.int_repr())
    assert torch.equal(got.q_per_channel_scales(), reference.q_per_channel_scales())
    assert not got.q_per_channel_zero_points().any()
    values, scales = int8_rows(weight)
    assert torch.equal(values, reference.int_repr()) and torch.equal(
        scales, got.q_per_channel_scales().float()
    )


def test_int8_copy_of_an_attention_adapter_model_smooths_its_mlps(draft_tokenizer):
    peft = add_adapter(tiny_llama(len(draft_tokenizer), seed=6), "a", AdapterConfig(rank=2, alpha=4))
    assert (
        smooth_mlps(copy.deepcopy(peft), draft_tokenizer) == 2
    )  # the attention adapters leave the MLPs plain
    quantized = int8_copy(peft, draft_tokenizer)
    with torch.no_grad():
        ref, got = peft(X).logits, quantized(X).logits
    assert torch.allclose(got, ref, atol=0.05 * ref.abs().max())
    assert any("quantized" in type(m).__module__ for m in quantized.modules())


def test_fake_int8_computes_what_the_int8_kernels_compute_one_token_at_a_time(draft_tokenizer):
    q = quantize_int8(tiny_llama(len(draft_tokenizer), seed=8), draft_tokenizer)
    fake = fake_int8(q)
    assert not any("quantized" in type(m).__module__ for m in fake.modules())
    assert (
        fake.model.embed_tokens.weight is q.model.embed_tokens.weight
    )  # nothing is copied: it reads q's tensors
    int8_linears = sum(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in q.modules())
    assert int8_linears and sum(isinstance(m, FakeInt8Linear) for m in fake.modules()) == int8_linears
    with torch.no_grad():  # a decode step: one row per call, where the kernel's per-call scale is the row's
        for token in X[0].tolist():
            ref, got = q(torch.tensor([[token]])).logits, fake(torch.tensor([[token]])).logits
            assert torch.allclose(got, ref, atol=1e-4 * ref.abs().max())
        fp32 = tiny_llama(len(draft_tokenizer), seed=8)(X).logits
    assert not torch.allclose(
        fake(X).logits, fp32, atol=1e-4 * fp32.abs().max()
    )  # it is the int8 function, not the fp32 one


def test_fake_int8_passes_gradients_straight_through_and_keeps_its_weights_frozen():
    linear = quantize_int8(torch.nn.Sequential(torch.nn.Linear(16, 8)))
    fake = fake_int8(linear)
    x = torch.randn(3, 16, requires_grad=True)
    fake(x).sum().backward()
    assert torch.allclose(
        x.grad, fake[0].weight.sum(0).expand(3, 16)
    )  # d(xW^T)/dx, rounding passed straight through
    assert not list(fake.parameters())  # the int8 weights are buffers: nothing to train
    with pytest.raises(ValueError, match="needs a model with dynamic int8 linears"):
        fake_int8(torch.nn.Sequential(torch.nn.Linear(4, 4)))
