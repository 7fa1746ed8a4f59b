"""int8.py: per-channel dynamic int8 for drafters and the SmoothQuant fold of their MLPs."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from omnidraft.distill.adapters import AdapterConfig, add_adapter, int8_twin
from omnidraft.int8 import quantize_int8, smooth_mlps

from .conftest import tiny_llama

X = torch.tensor([[5, 6, 7, 8, 9, 10]])


def test_smoothing_folds_scales_without_changing_the_fp32_model(draft_tokenizer):
    model = tiny_llama(len(draft_tokenizer), seed=3)
    with torch.no_grad():  # give one MLP channel an outlier, as real LLMs have, so the scales are far from 1
        model.model.layers[0].mlp.up_proj.weight[7].mul_(40)
    smoothed = copy.deepcopy(model)
    assert smooth_mlps(smoothed, draft_tokenizer) == 2
    assert not torch.allclose(smoothed.model.layers[0].mlp.down_proj.weight, model.model.layers[0].mlp.down_proj.weight)
    with torch.no_grad():
        assert torch.allclose(smoothed(X).logits, model(X).logits, atol=1e-4)


def test_mlps_with_an_adapter_and_unknown_architectures_are_left_alone(draft_tokenizer):
    peft = add_adapter(tiny_llama(len(draft_tokenizer), seed=4), "a", AdapterConfig(rank=2, alpha=4, modules=("up_proj",)))
    assert smooth_mlps(peft, draft_tokenizer) == 0  # every MLP has a LoRA on up_proj
    assert smooth_mlps(SimpleNamespace(config=SimpleNamespace(model_type="gemma3")), draft_tokenizer) == 0


def test_quantize_int8_copies_quantizes_per_channel_and_stays_close(draft_tokenizer):
    model = tiny_llama(len(draft_tokenizer), seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = quantize_int8(model, draft_tokenizer)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the fp32 model is untouched
    linears = [m for m in q.modules() if "quantized" in type(m).__module__ and hasattr(m, "weight")]
    assert linears and all(m.weight().qscheme() == torch.per_channel_affine for m in linears)
    with torch.no_grad():
        ref, got = model(X).logits, q(X).logits
    assert torch.allclose(got, ref, atol=0.05 * ref.abs().max())


def test_int8_twin_of_an_attention_adapter_model_smooths_its_mlps(draft_tokenizer):
    peft = add_adapter(tiny_llama(len(draft_tokenizer), seed=6), "a", AdapterConfig(rank=2, alpha=4))
    assert smooth_mlps(copy.deepcopy(peft), draft_tokenizer) == 2  # the attention adapters leave the MLPs plain
    twin = int8_twin(peft, draft_tokenizer)
    with torch.no_grad():
        ref, got = peft(X).logits, twin(X).logits
    assert torch.allclose(got, ref, atol=0.05 * ref.abs().max())
    assert any("quantized" in type(m).__module__ for m in twin.modules())
