"""The static-cache runner gives the logits the dynamic one gives, through feeds, crops back past a
rejected draft, a reset onto a new sequence and a spill past its capacity; on a CUDA machine the
same checks run with graph replay (the device check, docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch

from omnidraft.runtime.causal_runner import CausalRunner
from omnidraft.runtime.static_runner import StaticRunner, static_cache_supported

from .conftest import tiny_gemma3, tiny_llama

DEVICES = [("cpu", False)] + ([("cuda", True)] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES, ids=lambda d: f"{d[0]}{'-graphs' if d[1] else ''}")
def where(request):
    device, graphs = request.param
    model = tiny_llama(97, seed=3).to(device)
    return model, graphs


def _steps(runner: CausalRunner, script: list[tuple]) -> list[torch.Tensor]:
    out = []
    for step in script:
        if step[0] == "extend":
            runner.extend(step[1])
        elif step[0] == "crop":
            runner.crop(step[1])
        elif step[0] == "prefill":
            runner.prefill(step[1])
        else:
            out.append(runner.forward(keep=step[1]).float().cpu())
    return out


SCRIPT = [
    ("prefill", 5),
    ("forward", 1),
    ("extend", [4, 5, 6, 7]),
    ("forward", 5),  # a verify of four drafted tokens
    ("crop", 11),  # two of them rejected
    ("extend", [9]),
    ("forward", 1),
    ("extend", [10, 11]),
    ("forward", 3),
    ("forward", 2),  # logits of cached positions again: re-fed
    ("extend", [12]),
    ("forward", 1),
]


@pytest.mark.parametrize("bucket", [8, 256])  # attention over the cache in spans of 8 positions, or all 64
def test_static_matches_dynamic_through_feeds_and_crops(where, bucket):
    model, graphs = where
    prompt = list(range(1, 10))
    want = _steps(CausalRunner(model, prompt), SCRIPT)
    runner = StaticRunner(model, prompt, capacity=64, graphs=graphs, bucket=bucket)
    got = _steps(runner, SCRIPT)
    assert runner.graph_error is None
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # the same runner, reset onto another sequence, forgets the first one
    runner.reset([3, 1, 4, 1, 5, 9, 2, 6, 5])
    other = _steps(runner, SCRIPT)
    fresh = _steps(CausalRunner(model, [3, 1, 4, 1, 5, 9, 2, 6, 5]), SCRIPT)
    for a, b in zip(fresh, other, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_sequence_past_the_capacity_moves_to_a_dynamic_cache(where):
    model, graphs = where
    runner = StaticRunner(model, list(range(1, 10)), capacity=12, graphs=graphs)
    want = _steps(CausalRunner(model, list(range(1, 10))), SCRIPT)
    got = _steps(runner, SCRIPT)
    assert runner.spilled is not None and runner.ids == runner.spilled.ids
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    runner.reset([1, 2, 3])
    assert runner.spilled is None and runner.kv_len == 0


def test_sliding_window_models_are_refused_by_name():
    model = tiny_gemma3(8)
    assert not static_cache_supported(model)
    with pytest.raises(ValueError, match="sliding-window layers"):
        StaticRunner(model, [1, 2], capacity=16)
    assert static_cache_supported(tiny_llama(64, seed=1))
