"""distill/adapters.py: per-target LoRA on a frozen shared drafter, and the int8 drafting twin."""

from __future__ import annotations

import pytest
import torch

from omnidraft.distill.adapters import (AdapterConfig, adapter_state, add_adapter, int8_learner, int8_twin, load_adapter_state,
                                       set_active)

from .conftest import tiny_llama


@pytest.fixture()
def drafter():
    base = tiny_llama(300, seed=7)
    model = add_adapter(base, "qwen", AdapterConfig(rank=4, alpha=8))
    return add_adapter(model, "gemma", AdapterConfig(rank=4, alpha=8))


def test_gradients_flow_only_into_the_active_adapter(drafter):
    set_active(drafter, "qwen")
    drafter.train()
    loss = drafter(torch.tensor([[1, 2, 3, 4]])).logits.square().mean()
    loss.backward()
    touched = {n for n, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert touched and all(".qwen." in n and "lora_" in n for n in touched)
    assert all(not p.requires_grad for n, p in drafter.named_parameters() if "lora_" not in n)


def test_switching_adapters_switches_outputs_and_state_round_trips(drafter):
    x = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        for name in ("qwen", "gemma"):
            state = {k: torch.randn_like(v) * 0.5 for k, v in adapter_state(drafter, name).items()}  # adapters that act
            load_adapter_state(drafter, name, state)
            assert all(torch.equal(adapter_state(drafter, name)[k], v) for k, v in state.items())
        set_active(drafter, "qwen")
        a = drafter(x).logits
        set_active(drafter, "gemma")
        b = drafter(x).logits
    assert not torch.allclose(a, b)
    with pytest.raises(KeyError, match="no adapter 'llama'"):
        set_active(drafter, "llama")


def test_int8_twin_shares_the_lora_parameters(drafter):
    set_active(drafter, "qwen")
    twin = int8_twin(drafter)
    x = torch.tensor([[9, 8, 7, 6]])
    with torch.no_grad():
        before = twin(x).logits
        for name, p in drafter.named_parameters():
            if ".qwen." in name and "lora_B" in name:
                p.add_(0.3)  # an optimizer step on the training model...
        after = twin(x).logits
        reference = drafter(x).logits
    assert not torch.allclose(before, after)  # ...is live in the int8 twin
    assert torch.allclose(after, reference, atol=0.05 * reference.abs().max())
    assert any("quantized" in type(m).__module__ for m in twin.modules())


def test_the_int8_learner_trains_the_lora_the_twin_drafts_with(drafter):
    set_active(drafter, "qwen")
    twin = int8_twin(drafter)
    learner = int8_learner(twin)
    for model in (twin, learner):
        set_active(model, "qwen")
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if ".qwen." in name and "lora_B" in name:
                p.add_(0.3)  # an adapter that acts
        for token in (9, 8, 7):  # one token a call: the kernel's scale is the row's
            ref, got = twin(torch.tensor([[token]])).logits, learner(torch.tensor([[token]])).logits
            assert torch.allclose(got, ref, atol=1e-4 * ref.abs().max())
    learner.train()
    learner(torch.tensor([[1, 2, 3, 4]])).logits.square().mean().backward()
    touched = {n for n, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert touched and all(".qwen." in n and "lora_" in n for n in touched)  # the shared modules got the gradient
