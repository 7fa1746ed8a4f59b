"""distill/adapters.py: per-target LoRA on a frozen shared drafter, and the int8 drafting quantized."""

from __future__ import annotations

import pytest
import torch

from omnidraft.distill.adapters import (
    AdapterConfig,
    adapter_state,
    add_adapter,
    int8_copy,
    int8_learner,
    load_adapter_state,
    set_active,
)

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
            state = {
                k: torch.randn_like(v) * 0.5 for k, v in adapter_state(drafter, name).items()
            }  # adapters that act
            load_adapter_state(drafter, name, state)
            assert all(torch.equal(adapter_state(drafter, name)[k], v) for k, v in state.items())
        set_active(drafter, "qwen")
        a = drafter(x).logits
        set_active(drafter, "gemma")
        b = drafter(x).logits
    assert not torch.allclose(a, b)
    with pytest.raises(KeyError, match="no adapter 'llama'"):
        set_active(drafter, "llama")


def test_int8_copy_shares_the_lora_parameters(drafter):
    set_active(drafter, "qwen")
    quantized = int8_copy(drafter)
    x = torch.tensor([[9, 8, 7, 6]])
    with torch.no_grad():
        before = quantized(x).logits
        for name, p in drafter.named_parameters():
            if ".qwen." in name and "lora_B" in name:
                p.add_(0.3)  # an optimizer step on the training model...
        after = quantized(x).logits
        reference = drafter(x).logits
    assert not torch.allclose(before, after)  # ...is live in the int8 quantized
    assert torch.allclose(after, reference, atol=0.05 * reference.abs().max())
    assert any("quantized" in type(m).__module__ for m in quantized.modules())


def test_the_int8_learner_trains_the_lora_the_copy_drafts_with(drafter):
    set_active(drafter, "qwen")
    quantized = int8_copy(drafter)
    learner = int8_learner(quantized)
    for model in (quantized, learner):
        set_active(model, "qwen")
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if ".qwen." in name and "lora_B" in name:
                p.add_(0.3)  # an adapter that acts
        for token in (9, 8, 7):  # one token a call: the kernel's scale is the row's
            ref, got = quantized(torch.tensor([[token]])).logits, learner(torch.tensor([[token]])).logits
            assert torch.allclose(got, ref, atol=1e-4 * ref.abs().max())
    learner.train()
    learner(torch.tensor([[1, 2, 3, 4]])).logits.square().mean().backward()
    touched = {n for n, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert touched and all(
        ".qwen." in n and "lora_" in n for n in touched
    )  # the shared modules got the gradient


def test_an_adapter_added_after_the_copy_drafts_and_trains_through_it(drafter):
    """A new target's adapter needs no second int8 quantized: the quantized and learner share the training
    model's per-adapter modules and tables, so they draft exactly as a quantized rebuilt from scratch."""
    from omnidraft.distill.adapters import covers

    quantized = int8_copy(drafter)
    learner = int8_learner(quantized)
    model = add_adapter(
        drafter, "llama", AdapterConfig(rank=2, alpha=8)
    )  # another rank and scale than the first two
    assert model is drafter and covers(quantized, drafter) and covers(learner, drafter)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if ".llama." in name and "lora_B" in name:
                p.add_(0.3)  # an adapter that acts
    x = torch.tensor([[4]])
    with torch.no_grad():
        for name in ("llama", "qwen"):
            for m in (quantized, learner):
                set_active(m, name, grads=False)
            rebuilt = int8_copy(drafter)
            set_active(rebuilt, name)
            ref = rebuilt(x).logits
            assert torch.equal(quantized(x).logits, ref)
            assert torch.allclose(learner(x).logits, ref, atol=1e-4 * ref.abs().max())
    mlp = add_adapter(drafter, "mlp", AdapterConfig(rank=2, alpha=4, modules=("gate_proj",)))
    assert not covers(
        quantized, mlp
    )  # LoRA layers on projections the quantized has none on: it must be rebuilt


def test_a_second_target_reuses_the_int8_drafters_copy(draft_tokenizer, tmp_path):
    from omnidraft import TorchDrafter as Drafter
    from omnidraft.runtime.int8 import quantize_int8

    fp32 = tiny_llama(len(draft_tokenizer), seed=2, logit_scale=30.0)
    fp32.save_pretrained(tmp_path)  # where adding the first adapter reloads the fp32 weights from
    draft_tokenizer.save_pretrained(tmp_path)
    d = Drafter(
        quantize_int8(fp32, draft_tokenizer), draft_tokenizer, "tiny-int8", spec=str(tmp_path), int8=True
    )
    small = AdapterConfig(rank=2, alpha=4)
    d.add_adapter("a", small)
    quantized, learner = d.model, d.learner
    d.add_adapter("b", small)
    assert d.model is quantized and d.learner is learner and d.active == "b"
    d.add_adapter("c", AdapterConfig(rank=2, alpha=4, modules=("up_proj",)))
    assert d.model is not quantized and {"a", "b", "c"} <= set(
        d.model.peft_config
    )  # rebuilt, every adapter kept
