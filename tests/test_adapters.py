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


def _act(model, name, scale=0.3):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if f".{name}." in n and "lora_B" in n:
                p.add_(scale)  # an optimizer step: in place, as Adam's


@pytest.mark.parametrize("int8", [False, True])
def test_an_adapter_drafts_merged_into_its_projections_and_steps_are_live(drafter, int8):
    """distill/merged.py: the model drafts compute what the LoRA layers compute (fp32: to float
    rounding; int8: to the kernel's rounding), follow every in-place step and adapter switch, and
    are the base's own weights where the adapter adds nothing."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    from omnidraft.distill.merged import MergedDrafting

    source = int8_copy(drafter) if int8 else drafter
    merged, x = MergedDrafting(), torch.tensor([[9, 8, 7, 6]])
    tolerance = 0.05 if int8 else 1e-5
    with torch.no_grad():
        fresh = merged.model(source, "qwen")  # B = 0: the base's own projections, exactly
        set_active(source, "qwen")
        source.base_model.disable_adapter_layers()
        bare = source(x).logits
        source.base_model.enable_adapter_layers()
        assert torch.equal(fresh(x).logits, bare) and torch.equal(merged.model(source, None)(x).logits, bare)
        for step in range(2):
            _act(drafter, "qwen")
            ref = source(x).logits
            got = merged.model(source, "qwen")(x).logits
            assert torch.allclose(got, ref, atol=tolerance * ref.abs().max()), step
        _act(drafter, "gemma", -0.2)
        set_active(source, "gemma")
        ref = source(x).logits
        assert torch.allclose(merged.model(source, "gemma")(x).logits, ref, atol=tolerance * ref.abs().max())
    shell = merged.model(source, "gemma")
    assert not any(type(m).__name__ == "Linear" and hasattr(m, "lora_A") for m in shell.modules())
    kinds = {type(m) for m in shell.modules()}
    assert (DynamicLinear in kinds) == int8
    assert shell.get_input_embeddings().weight is source.get_input_embeddings().weight  # shared, not copied


def test_the_torch_drafter_drafts_with_the_merged_adapter(draft_tokenizer, tmp_path):
    """`TorchDrafter.drafting_model`: the merged model once an adapter exists, each stream's
    forward on it as it is then; `merge_adapters` off drafts through the LoRA layers."""
    from omnidraft import TorchDrafter as Drafter

    fp32 = tiny_llama(len(draft_tokenizer), seed=2, logit_scale=30.0)
    d = Drafter(fp32, draft_tokenizer, "tiny")
    assert d.drafting_model() is d.model  # no adapter: nothing merged
    d.add_adapter("a", AdapterConfig(rank=2, alpha=4))
    stream = d.stream([5, 6, 7])
    first, _ = stream.logits()
    assert d.drafting_model() is not d.model and stream.runner.model is d.drafting_model()
    _act(d.trainable, "a")
    stream.crop(0)  # (cached positions keep what the weights before the step computed)
    stream.extend([5, 6, 7])
    after, _ = stream.logits()
    with torch.no_grad():
        ref = d.model(torch.tensor([[5, 6, 7]])).logits[0, -1:]
    assert not torch.allclose(first, after) and torch.allclose(after, ref, atol=1e-4)
    d.merge_adapters = False
    assert d.drafting_model() is d.model


def test_the_draft_ms_bench_times_a_drafter_with_and_without_its_adapter_merged(
    draft_tokenizer, tmp_path, monkeypatch, capsys
):
    """`python -m benchmarks.draft_ms --adapter` on a tiny saved drafter: the bare row, merged and
    through the LoRA layers."""
    import json
    import sys

    from benchmarks import draft_ms

    tiny_llama(len(draft_tokenizer), seed=3).save_pretrained(tmp_path)
    draft_tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr(
        sys, "argv", ["draft_ms", "--model", f"tiny={tmp_path}:torch", "--adapter", "--passes", "1"]
    )
    draft_ms.main()
    rows = json.loads(capsys.readouterr().out.split("\n", 3)[-1])
    assert set(rows) == {"tiny", "tiny + adapter, merged", "tiny + adapter, LoRA layers"}
    assert all(len(v) == 1 and v[0] > 0 for v in rows.values())
