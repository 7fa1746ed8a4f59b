"""Targets and drafters on a device and dtype of the user's choosing: greedy identity per device and
dtype against the same model's own decoding there (cpu fp32 and cpu bf16 here; the GPU check in
tests/test_gpu_check.py), and clear errors for a device this machine lacks."""

from __future__ import annotations

import pytest
import torch

from omnidraft import Drafter, LocalTarget
from omnidraft.target import resolve_device, resolve_dtype

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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_identity_per_dtype_on_the_cpu(saved, dtype):
    target = LocalTarget.load(str(saved / "target"), device="cpu", dtype=dtype)
    drafter = Drafter.load(str(saved / "drafter"), backend="torch", device="cpu", dtype=dtype)
    assert next(target.model.parameters()).dtype == resolve_dtype(dtype)
    pair = drafter.pair(target, k=4)
    for prompt in PROMPTS:
        assert pair.generate(prompt, max_new_tokens=24).token_ids == _greedy(target, prompt, 24)


def test_a_device_or_dtype_this_machine_lacks_is_named():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int4")
