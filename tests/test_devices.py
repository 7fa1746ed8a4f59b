"""Targets and drafters on a device and dtype of the user's choosing: greedy identity per device and
dtype against the same model's own decoding there (cpu fp32 and cpu bf16 here; the GPU check in
tests/test_gpu_check.py), and clear errors for a device this machine lacks."""

from __future__ import annotations

import pytest
import torch

from omnidraft import Drafter, LocalTarget
from omnidraft.runtime.devices import resolve_device, resolve_dtype

from .conftest import tiny_llama

PROMPTS = ["Question: Tom has 3 apples and buys 5 more.", "Question: A train travels 60 miles in 2 hours."]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, draft_tokenizer, target_tokenizer):
    root = tmp_path_factory.mktemp("models")
    for name, tokenizer, seed in (("target", target_tokenizer, 1), ("drafter", draft_tokenizer, 2)):
        tiny_llama(len(tokenizer), seed=seed, logit_scale=30.0).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


def _greedy(target: LocalTarget, prompt: str, n: int) -> list[int]:
    ids = target.tokenizer(prompt, return_tensors="pt")["input_ids"].to(target.model.device)
    out = target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=sorted(target.eos_ids),
        pad_token_id=0,
    )
    return out[0, ids.shape[1] :].tolist()


# (device, dtype, graphs): the CPU always; on a CUDA machine (the device check, docs/gpu.md) also
# the GPU, eager, replaying CUDA graphs, and choosing by measurement
PLACES = [("cpu", "float32", False), ("cpu", "bfloat16", False)]
if torch.cuda.is_available():
    PLACES += [
        ("cuda", "float32", False),
        ("cuda", "bfloat16", False),
        ("cuda", "float32", True),
        ("cuda", "bfloat16", True),
        ("cuda", "bfloat16", None),
    ]


@pytest.mark.parametrize("device,dtype,graphs", PLACES)
def test_greedy_identity_per_device_and_dtype(saved, device, dtype, graphs, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))  # a measured graphs choice is kept there
    target = LocalTarget.load(str(saved / "target"), device=device, dtype=dtype, graphs=graphs, capacity=32)
    drafter = Drafter.load(str(saved / "drafter"), backend="torch", device=device, dtype=dtype)
    assert next(target.model.parameters()).dtype == resolve_dtype(dtype)
    pair = drafter.pair(target, k=4)
    for prompt in PROMPTS:  # 24 new tokens after each prompt: past the capacity, the session spills
        want = _greedy(target, prompt, 24)
        assert pair.generate(prompt, max_new_tokens=24).token_ids == want
        session = target.begin(target.tokenizer(prompt)["input_ids"])
        assert list(session.decode(24)) == want
        del session
    if graphs:
        assert target._slot is not None and target._slot.graph_error is None


def test_graphs_need_a_cuda_device(saved):
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="graphs=True needs a CUDA device"):
            LocalTarget.load(str(saved / "target"), graphs=True)
    assert LocalTarget.load(str(saved / "target")).graphs is False  # the CPU: the dynamic cache


def test_a_device_or_dtype_this_machine_lacks_is_named():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int4")
