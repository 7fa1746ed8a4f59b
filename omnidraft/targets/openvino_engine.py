"""`OpenVINOEngine`: one compiled OpenVINO model (optimum-intel's stateful export, its LM head cut to
the last rows a call asks for) and its infer request, holding one sequence's KV cache. The target
built on it: targets/openvino_target.py; what it measures of this machine: runtime/openvino_margin.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MissingDependencyError

__all__ = ["OpenVINOEngine", "cut_head"]

XML = "openvino_model.xml"
ROWS = "rows"  # the input that picks how many last positions the LM head computes


def _openvino() -> Any:
    try:
        import openvino
    except ImportError:
        raise MissingDependencyError(
            "an OpenVINO target needs the openvino package: pip install openvino"
        ) from None
    return openvino


def cut_head(model: Any) -> Any:
    """`model` with its LM head computed over the last `rows` positions only: a Slice on the hidden
    states before the head's MatMul, its start taken from a new input `rows` (i64, shape (1,))."""
    ov = _openvino()
    ops = ov.opset13
    node = model.output("logits").get_node()
    while node.get_type_name() != "MatMul":  # back from the logits through converts, scales, softcaps
        node = node.input_value(0).get_node()
    hidden = node.input_value(0)
    rows = ops.parameter([1], ov.Type.i64, name=ROWS)
    rows.output(0).get_tensor().set_names({ROWS})
    start = ops.negative(rows)
    stop = ops.constant(np.array([np.iinfo(np.int64).max], dtype=np.int64))
    step = ops.constant(np.array([1], dtype=np.int64))
    axis = ops.constant(np.array([1], dtype=np.int64))
    node.input(0).replace_source_output(ops.slice(hidden, start, stop, step, axis).output(0))
    model.add_parameters([rows])
    model.validate_nodes_and_infer_types()
    return model


class OpenVINOEngine:
    """One compiled model and its infer request: the KV cache of one sequence at a time, held by
    `owner` (a session); a session that finds another owner re-reads its sequence."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        threads: int | None = None,
        properties: dict[str, str] | None = None,
    ) -> None:
        ov = _openvino()
        self.path = Path(path)
        xml = self.path / XML if self.path.is_dir() else self.path
        if not xml.exists():
            raise FileNotFoundError(
                f"no OpenVINO model at {xml}: `OpenVINOTarget.load(spec)` exports a preset or HF model "
                "(docs/openvino.md)"
            )
        self.xml, self.threads = xml, threads
        core = ov.Core()
        model = cut_head(core.read_model(str(xml)))
        self.inputs = {p.get_any_name() for p in model.inputs}
        # a bf16 KV cache, not the default u8: a verify attends to its own new positions before
        # they are stored, so with a quantized cache its rows would differ from one-row decoding.
        # f32 activations, not the bf16 a CPU with AMX defaults to: there a verify's rows differed
        # from one-row steps and every call was slower (docs/openvino.md)
        config = {
            "PERFORMANCE_HINT": "LATENCY",
            "NUM_STREAMS": "1",
            "KV_CACHE_PRECISION": "bf16",
            "INFERENCE_PRECISION_HINT": "f32",
        }
        if threads:
            config["INFERENCE_NUM_THREADS"] = str(threads)
        config.update(properties or {})
        self.compiled = core.compile_model(model, "CPU", config)
        self.request = self.compiled.create_infer_request()
        self.n_vocab = int(model.output("logits").get_partial_shape()[-1].get_length())
        self.cached = 0  # positions in the KV state
        self.owner: object | None = None  # the session whose sequence the state holds
        self._seq_axis: int | None = None

    def forward(self, ids: list[int], rows: int) -> np.ndarray:
        """Feed `ids` after the `cached` positions; the logits (rows, V) of the last `rows` of them."""
        n, past = len(ids), self.cached
        feed = {
            "input_ids": np.asarray([ids], dtype=np.int64),
            "attention_mask": np.ones((1, past + n), dtype=np.int64),
            ROWS: np.asarray([rows], dtype=np.int64),
        }
        if "position_ids" in self.inputs:
            feed["position_ids"] = np.arange(past, past + n, dtype=np.int64)[None]
        if "beam_idx" in self.inputs:
            feed["beam_idx"] = np.zeros(1, dtype=np.int32)
        self.request.infer(feed)
        self.cached += n
        return self.request.get_tensor("logits").data[0, -rows:].copy()

    def trim(self, n: int) -> None:
        """Keep the first `n` positions of the KV state (a rejected tail goes)."""
        if n >= self.cached:
            return
        if n == 0:
            self.reset()
            return
        ov = _openvino()
        for state in self.request.query_state():
            tensor = state.state  # (OpenVINO converts its cache to this; no truncation in its API)
            end = list(tensor.shape)
            end[self._axis(tuple(end))] = n
            state.state = ov.Tensor(tensor, [0] * len(end), end)  # a region of it, not a copy
        self.cached = n

    def _axis(self, shape: tuple[int, ...]) -> int:
        """The sequence axis of a KV state tensor: the one whose length is the cached positions."""
        if self._seq_axis is None or shape[self._seq_axis] != self.cached:  # (batch, heads, seq, dim)
            self._seq_axis = next(i for i in (2, 1, 3, 0) if i < len(shape) and shape[i] == self.cached)
        return self._seq_axis

    def reset(self) -> None:
        self.request.reset_state()
        self.cached = 0

    def claim(self, owner: object) -> bool:
        """Make `owner` the sequence in the state; False when it was another's (the state is reset)."""
        if self.owner is owner:
            return True
        self.owner = owner
        self.reset()
        return False
