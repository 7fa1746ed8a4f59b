"""Kernel choice by measurement (kernels.py): same numbers on every path, one weight, cached plans."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from omnidraft.runtime import kernels as K
from omnidraft.runtime import measured

from .conftest import tiny_llama


def _fixed_plan(model: nn.Module, path: str) -> K.KernelPlan:
    shapes = {
        K._shape_key(m.out_features, m.in_features, m.bias is not None)
        for m in model.modules()
        if type(m) is nn.Linear
    }
    ms = {s: {p: [1.0] * len(K.BUCKETS) for p in K.PATHS} for s in shapes}
    return K.KernelPlan(host="test", choices={s: (path,) * len(K.BUCKETS) for s in shapes}, ms=ms)


@pytest.mark.parametrize("path", K.PATHS)
@pytest.mark.parametrize("rows", [1, 3, 9, 70])
def test_every_path_computes_the_stock_linear(path, rows):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80).requires_grad_(False)
    layer = K.KernelLinear(linear, (path,) * len(K.BUCKETS))
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        assert torch.allclose(layer(x), linear(x), atol=1e-5)


def test_row_counts_pick_their_bucket_and_training_stays_stock(monkeypatch):
    layer = K.KernelLinear(nn.Linear(8, 8), ("dense", "onednn", "dense", "onednn", "dense", "onednn"))
    used = []
    monkeypatch.setattr(
        K, "_onednn", lambda x, w, b: used.append(x.numel() // 8) or nn.functional.linear(x, w, b)
    )
    with torch.inference_mode():
        for rows in (1, 2, 3, 5, 9, 17, 200):
            layer(torch.randn(rows, 8))
    assert used == [2, 5, 17, 200]  # buckets 2, 8, 64 and beyond-the-last chose oneDNN
    used.clear()
    layer(torch.randn(2, 8, requires_grad=True))  # grad enabled: stock F.linear
    with torch.inference_mode(), K.stock_kernels(layer):
        layer(torch.randn(2, 8))
    assert used == []


def test_use_kernels_keeps_one_copy_and_the_same_greedy_output(tmp_path):
    model = tiny_llama(300, seed=3, logit_scale=30.0)
    weights = {n: p.data_ptr() for n, p in model.named_parameters()}
    ids = torch.tensor([[5, 17, 42, 7]])
    stock = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0
    )
    plan = K.use_kernels(model, cache=tmp_path)
    assert plan is not None and model.kernel_plan is plan
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == weights  # no weight copied
    assert all(type(m) is not nn.Linear for m in model.modules())
    planned = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0
    )
    assert planned.tolist() == stock.tolist()


def test_a_plan_is_timed_once_per_machine_and_shape(tmp_path, monkeypatch):
    timed = []
    real = K._time_shape
    monkeypatch.setattr(K, "_time_shape", lambda lin, reps: timed.append(lin.weight.shape) or real(lin, 1))
    first = K.kernel_plan(tiny_llama(300, seed=3), cache=tmp_path)
    n = len(timed)
    assert n == len(first.choices) > 0
    second = K.kernel_plan(
        tiny_llama(300, seed=4), cache=tmp_path
    )  # same shapes, other weights: nothing timed
    assert len(timed) == n and second.choices == first.choices
    K.kernel_plan(tiny_llama(310, seed=4), cache=tmp_path)  # a new vocabulary: only the new head's shape
    assert timed[n:] == [torch.Size([310, 32])]
    assert all(len(line.split()) == 1 + len(K.BUCKETS) for line in first.summary())


def test_a_corrupt_cache_is_timed_again(tmp_path):
    path = tmp_path / f"kernel-plan-v{K.PLAN_VERSION}-{measured.machine_key()}.json"
    path.write_text("{not json")
    plan = K.kernel_plan(tiny_llama(300, seed=3), cache=tmp_path, reps=1)
    assert plan.choices and json.loads(path.read_text())


def test_fixed_plans_give_identical_logits_on_both_paths():
    model = tiny_llama(300, seed=5)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.inference_mode():
        stock = model(ids).logits
        K.use_kernels(model, _fixed_plan(model, "onednn"))
        assert torch.allclose(model(ids).logits, stock, atol=1e-4)


def test_baseline_and_engine_run_the_same_model_objects_and_kernels(tiny_drafter, target_tokenizer, tmp_path):
    """bench/runner.py's target alone, its peers and omnidraft all call the same KernelLinear objects
    with the same paths; only the stock row switches them to F.linear (no timing asserted)."""
    from collections import defaultdict

    from omnidraft import LocalTarget
    from omnidraft.bench.runner import run_prompts

    model = tiny_llama(len(target_tokenizer), seed=1, logit_scale=30.0)
    K.use_kernels(model, cache=tmp_path)
    pair = tiny_drafter.pair(LocalTarget(model, target_tokenizer, "planned"), k=3)
    layers = [m for m in model.modules() if isinstance(m, K.KernelLinear)]
    phase, seen = ["warm-up"], defaultdict(set)
    handles = [
        m.register_forward_pre_hook(lambda m, _: seen[phase[0]].add((id(m), m.stock, m.paths)))
        for m in layers
    ]
    try:
        results = run_prompts(
            pair,
            ["Question: Tom has 3 apples. How many"],
            10,
            peers=("stock", "lookup"),
            progress=lambda msg: phase.__setitem__(0, msg.split(": ", 1)[1]),
        )
    finally:
        for h in handles:
            h.remove()
    planned = {(id(m), False, m.paths) for m in layers}
    assert seen["target alone"] == seen["omnidraft"] == seen["lookup"] == planned
    assert seen["stock"] == {(id(m), True, m.paths) for m in layers}
    assert not any(m.stock for m in layers)  # the stock row hands the plan back
    assert results[0].identical and set(results[0].peers) == {"stock", "lookup"}


def test_doctor_names_each_llama_cpp_drafters_weights_from_the_memo(tmp_path, monkeypatch):
    """`omnidraft doctor` reports what a llama.cpp drafter file runs here, without timing anything,
    and names an unreadable memo entry instead of failing."""
    from omnidraft.cli import doctor

    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))
    assert not [line for line in doctor.report() if line.startswith("llama.cpp drafter")]
    memo = tmp_path / "measured" / f"drafter-weights-{measured.machine_key()}.json"
    memo.parent.mkdir(parents=True)
    memo.write_text(
        json.dumps(
            {
                "small.Q4_1.gguf|98|0.3|2|True|repack True": {
                    "use": "q8_0",
                    "shipped": {"read_ms": 2.97, "draft_ms": 9.1},
                    "q8_0": {"read_ms": 1.36, "draft_ms": 8.2},
                },
                "broken.gguf|1|0.3|2|True|repack True": {"use": "q8_0"},
            }
        )
    )
    lines = [line for line in doctor.report() if line.startswith("llama.cpp drafter")]
    assert any(
        "small.Q4_1.gguf: runs Q8_0 copy" in line and "shipped 2.97 / 9.1, Q8_0 1.36 / 8.2" in line
        for line in lines
    )
    assert any("broken.gguf: unreadable timing" in line for line in lines)


@pytest.mark.parametrize("grouped_faster", [True, False])
def test_grouped_attention_verifies_with_the_same_logits(tmp_path, monkeypatch, grouped_faster):
    """A verify's attention on the cache's own key/value heads (attention.py) gives transformers'
    numbers bit for bit, after a crop too; where it timed slower the model is left stock."""
    from omnidraft.runtime import attention as A
    from omnidraft.runtime.causal_runner import CausalRunner

    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(
        A, "_time_attention", lambda *a, **k: {"repeated": 1.0, "grouped": 0.5 if grouped_faster else 2.0}
    )
    model = tiny_llama(300, seed=4, logit_scale=30.0)
    ids = torch.randint(1, 300, (90,), generator=torch.Generator().manual_seed(0)).tolist()

    def verifies() -> list[torch.Tensor]:
        runner, out = CausalRunner(model, ids[:60]), []
        runner.forward(1)
        for start in range(60, 90, 5):
            runner.extend(ids[start : start + 5])
            out.append(runner.forward(5).clone())
            runner.crop(start + 3)  # two of five rejected
            runner.extend(ids[start + 3 : start + 5])
        return out

    stock = verifies()
    assert A.use_grouped_attention(model) is grouped_faster
    assert model.config._attn_implementation == (A.NAME if grouped_faster else "sdpa")
    assert (
        "attention grouped" in A.attention_choice(model)
    ) is grouped_faster  # what `omnidraft doctor` says
    assert all(torch.equal(a, b) for a, b in zip(verifies(), stock))
    assert json.loads(
        next((tmp_path / "measured").glob("attention-*.json")).read_text()
    )  # remembered per machine
