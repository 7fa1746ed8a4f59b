"""What an OpenVINO target measures once per machine and model (kept by runtime/measured.py): the
largest difference between a verify's many-row logits and decoding one token at a time (the
target's exactness margin), and what verifying n tokens costs.

The margin: calibration text is decoded one token at a time, keeping each step's logits; the same
positions are then read again as verifies read them (the pending token and up to eight more in one
forward, from the state decoding left, after the prompt). The margin is `SAFETY` times the largest
absolute difference seen: a verified position whose top two logits are closer than that is decided
by a one-row step (targets/openvino_target.py). Where a verify's rows are bit-identical to one-row
steps (OpenVINO's CPU kernels with a bf16 KV cache here: docs/openvino.md) it is 0: none is.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .measured import remembered

if TYPE_CHECKING:
    from ..targets.openvino_engine import OpenVINOEngine

__all__ = ["measured_costs", "measured_margin", "model_key"]

SAFETY = 4.0
TEXTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n',
    "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many",
    "The committee met on Tuesday to discuss the budget. After a long debate, the members agreed",
)
COST_CONTEXT = 200  # tokens of context before the tokens whose costs are measured


def model_key(engine: OpenVINOEngine) -> str:
    """The model's identity for the measurement store: its IR's size and a hash of its graph, and
    OpenVINO's version, thread count and precision."""
    import openvino

    xml = engine.xml
    digest = hashlib.sha256(xml.read_bytes()).hexdigest()[:16]
    weights = xml.with_suffix(".bin")
    size = weights.stat().st_size if weights.exists() else 0
    precision = engine.compiled.get_property("INFERENCE_PRECISION_HINT").to_string()
    return (
        f"{xml.parent.name}|{digest}|{size}|openvino {openvino.__version__}|threads {engine.threads}"
        f"|{precision}"
    )


def measured_margin(engine: OpenVINOEngine, tokenizer: Any) -> float:
    """The exactness margin of `engine`'s verifies (the module docstring), measured once."""
    return float(remembered("openvino-margin", model_key(engine), lambda: _margin(engine, tokenizer)))


def measured_costs(engine: OpenVINOEngine, tokenizer: Any) -> dict[int, float]:
    """Seconds to verify n tokens on `engine` after COST_CONTEXT tokens, measured once."""
    costs = remembered("openvino-verify-costs-rejected", model_key(engine), lambda: _costs(engine, tokenizer))
    return {int(n): float(s) for n, s in costs.items()}


def _margin(engine: OpenVINOEngine, tokenizer: Any, steps: int = 24, most: int = 8) -> float:
    worst = 0.0
    for text in TEXTS:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        engine.claim(object())
        rows, seq = [engine.forward(ids, 1)[0]], list(ids)
        for _ in range(steps):  # one token at a time, as decoding alone
            seq.append(int(rows[-1].argmax()))
            rows.append(engine.forward([seq[-1]], 1)[0])
        # the same positions, `most` + 1 rows a forward, from the first generated token on: a verify
        # never feeds a prompt token again (the prompt's prefill is a call of many rows, whose kernels
        # differ from a verify's)
        for start in range(len(ids) + 1, len(seq), most):
            engine.trim(start - 1)
            got = engine.forward(seq[start - 1 : start + most], min(most + 1, len(seq) - start + 1))
            want = np.stack(rows[start - len(ids) : start - len(ids) + len(got)])
            worst = max(worst, float(np.abs(got - want).max()))
    engine.owner = None
    return SAFETY * worst


def _costs(engine: OpenVINOEngine, tokenizer: Any, up_to: int = 9, reps: int = 5) -> dict[str, float]:
    """Seconds to verify n tokens whose n - 1 proposed ones are all rejected, as a round pays it: the
    forward, the trim of the rejected positions (OpenVINO reads every state tensor back,
    docs/openvino.md) and what that trim costs the next step (the state set is converted back on
    the next call), less one plain step; n = 1 is the plain step (decoding alone), measured after
    a step, never after a trim."""
    text = TEXTS[0] * 24
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    feed = iter(ids[COST_CONTEXT:] * 8)
    engine.claim(object())
    engine.forward(ids[:COST_CONTEXT], 1)
    steps: list[float] = []
    rounds: dict[int, list[float]] = {n: [] for n in range(2, up_to + 1)}
    for _ in range(reps):  # interleaved, so that a slow moment spreads over every n
        for n in rounds:
            engine.forward([next(feed)], 1)  # a plain step first: nothing left over from a trim
            started = time.perf_counter()
            engine.forward([next(feed)], 1)
            steps.append(time.perf_counter() - started)
            started = time.perf_counter()
            engine.forward([next(feed) for _ in range(n)], n)
            engine.trim(engine.cached - n + 1)
            engine.forward([next(feed)], 1)
            rounds[n].append(time.perf_counter() - started)
    engine.owner = None
    engine.reset()
    step = sorted(steps)[len(steps) // 2]
    costs = {n: sorted(t)[len(t) // 2] - step for n, t in rounds.items()}
    return {"1": step, **{str(n): max(step, c) for n, c in costs.items()}}
