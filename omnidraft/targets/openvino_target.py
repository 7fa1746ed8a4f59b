"""`OpenVINOTarget`: a causal LM exported to OpenVINO IR (optimum-intel's stateful export, see
export/openvino.py), run by OpenVINO's CPU plugin in this process, as a target.

OpenVINO's kernels read each weight once for the many rows of a verify, so verifying a few tokens
costs little more than one decoding step (docs/openvino.md measures it), where llama.cpp's CPU
kernels pay nearly a step a token. The engine keeps one sequence's KV cache in the compiled model's
state; a verify feeds the tokens after the cached prefix and asks for logits of the last M + 1 rows
only (the LM head is cut to those rows, so a prompt's prefill does not compute a row per token), and
a rejected tail is trimmed from the state.

Exactness: a forward of many rows and one of a single row give logits that differ in the last bits,
so a greedy verify could pick another token than decoding one token at a time would. The engine
measures once per machine and model the largest such difference (`margin`); a verified position
whose top two logits are closer than the margin is decided again by a one-row step, so greedy
output is the engine's own one-token-at-a-time output. What this module is not: the exporter
(export/openvino.py) or the verification rule (`omnidraft.target.judge`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..decode.verify import Verdict
from ..errors import MissingDependencyError
from ..target import Capabilities, Rule, SessionBase, TargetBase, judge
from ..translate.codec import ByteCodec
from ..translate.token_bytes import build_token_bytes

__all__ = ["OpenVINOEngine", "OpenVINOTarget"]

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
        # they are stored, so with a quantized cache its rows would differ from one-row decoding
        config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1", "KV_CACHE_PRECISION": "bf16"}
        if threads:
            config["INFERENCE_NUM_THREADS"] = str(threads)
        config.update(properties or {})
        self.compiled = core.compile_model(model, "CPU", config)
        self.request = self.compiled.create_infer_request()
        self.n_vocab = int(model.output("logits").get_partial_shape()[-1].get_length())
        self.cached = 0  # positions in the KV state
        self.owner: Any = None
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
            data = state.state.data
            axis = self._axis(data.shape)
            keep = np.ascontiguousarray(np.take(data, np.arange(n), axis=axis))
            state.state = ov.Tensor(keep)
        self.cached = n

    def _axis(self, shape: tuple[int, ...]) -> int:
        """The sequence axis of a KV state tensor: the one whose length is the cached positions."""
        if self._seq_axis is None or shape[self._seq_axis] != self.cached:  # (batch, heads, seq, dim)
            self._seq_axis = next(i for i in (2, 1, 3, 0) if i < len(shape) and shape[i] == self.cached)
        return self._seq_axis

    def reset(self) -> None:
        self.request.reset_state()
        self.cached = 0

    def claim(self, owner: Any) -> bool:
        """Make `owner` the sequence in the state; False when it was another's (the state is reset)."""
        if self.owner is owner:
            return True
        self.owner = owner
        self.reset()
        return False


class _OpenVINOSession(SessionBase):
    """One generation: `ids` committed, of which the engine's state holds `cached` (all but the
    last committed token, once a call has run)."""

    def __init__(self, owner: OpenVINOTarget, prompt_ids: list[int]) -> None:
        self.owner, self.ids = owner, list(prompt_ids)
        self.cached = 0
        self.prefilled = False  # the last call read the prompt: its first row is decoding's own

    def _rows(self, draft: list[int]) -> np.ndarray:
        """Logits after the pending token and after each drafted one, (len(draft) + 1, V). A first
        call reads the prompt alone first, as decoding alone does, so its rows match."""
        engine = self.owner.engine
        if not engine.claim(self) or engine.cached != self.cached:  # another's sequence was there
            engine.reset()
            self.cached = 0  # read afresh
        self.prefilled = self.cached == 0
        if self.prefilled:
            first = engine.forward(self.ids, 1)
            self.cached = len(self.ids)
            return first if not draft else np.concatenate([first, engine.forward(draft, len(draft))])
        tail = self.ids[self.cached :] + draft
        return engine.forward(tail, len(draft) + 1)

    def verify(
        self,
        proposal: torch.Tensor,
        rule: Rule,
        q: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        *,
        topk: int = 0,
        relax: tuple[torch.Tensor, int] | None = None,
    ) -> Verdict:
        draft = [int(t) for t in proposal.tolist()]
        base = len(self.ids)
        logits = torch.from_numpy(self._rows(draft))
        verdict = judge(logits, proposal, rule, q, generator, base, topk=topk, relax=relax)
        if rule.mode == "greedy" and relax is None:
            verdict = self._exact(logits, draft, verdict)
        self._settle(draft[: verdict.accepted], verdict.token, base)
        return verdict

    def _exact(self, logits: torch.Tensor, draft: list[int], verdict: Verdict) -> Verdict:
        """The greedy verdict as one-token-at-a-time decoding gives it: the first consulted row whose
        top two logits are within the engine's margin is decided again by a one-row step."""
        top = logits[: verdict.accepted + 1].topk(2, dim=-1).values
        close = ((top[:, 0] - top[:, 1]) < self.owner.margin).nonzero()[:, 0]
        close = close[close > 0] if self.prefilled else close  # (the prompt's row is decoding's own)
        if not len(close):
            return verdict
        j = int(close[0])  # row j follows the token at position len(ids) - 1 + j of ids + draft
        at = len(self.ids) - 1 + j
        self.owner.engine.trim(at)
        row = self.owner.engine.forward([(self.ids + draft)[at]], 1)[0]
        return Verdict(j, int(row.argmax()))

    def _settle(self, accepted: list[int], token: int, base: int) -> None:
        """Commit `accepted` and `token`; the state keeps every committed position but the last."""
        self.ids = self.ids[:base] + accepted + [token]
        self.cached = len(self.ids) - 1
        self.owner.engine.trim(self.cached)

    def decode(self, max_tokens: int) -> Iterator[int]:
        """Greedy-decode up to `max_tokens` tokens one at a time (stopping after an end-of-generation
        token): the engine's own decoding, which verification reproduces."""
        for _ in range(max_tokens):
            token = int(self._rows([])[0].argmax())
            self.ids.append(token)
            self.cached = len(self.ids) - 1
            yield token
            if token in self.owner.eos_ids:
                return

    def close(self) -> None:
        """The generation is over: the engine's state may be taken over."""
        if self.owner.engine.owner is self:
            self.owner.engine.owner = None


def _eos_ids(directory: Path, tokenizer: Any) -> frozenset[int]:
    """The ids a generation ends on: the tokenizer's EOS and the generation config's (an instruct
    model's end-of-turn token among them), as HF's `generate` stops."""
    import json

    found = {tokenizer.eos_token_id} if isinstance(tokenizer.eos_token_id, int) else set()
    config = directory / "generation_config.json"
    if config.exists():
        eos = json.loads(config.read_text()).get("eos_token_id")
        found |= set(eos) if isinstance(eos, list) else {eos} if isinstance(eos, int) else set()
    return frozenset(found)


class OpenVINOTarget(TargetBase):
    """A model exported to OpenVINO IR (a directory with openvino_model.xml and its tokenizer) on
    OpenVINO's CPU plugin, verifying in this process. `margin`: logits closer than this at a
    verified position are decided by a one-row step (default: measured once on this machine for
    this model, runtime/openvino_margin.py); `threads`: OpenVINO's inference threads (default:
    every core; fewer leave the others to a drafter drafting beside the verifies, decode/overlap.py)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        tokenizer: Any = None,
        threads: int | None = None,
        margin: float | None = None,
        name: str | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        from ..llamacpp.loading import cpu_threads

        threads = threads or cpu_threads()
        self.engine = OpenVINOEngine(path, threads=threads)
        self.capabilities = Capabilities(in_process=True, decodes_alone=True, verifies_beside=threads)
        self.name = name or self.engine.path.name
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(str(path))
        self.token_bytes = build_token_bytes(self.tokenizer, self.engine.n_vocab)
        self.token_bytes.require_byte_coverage(self.name)
        self.codec = ByteCodec(self.tokenizer, self.token_bytes)
        self.eos_ids = _eos_ids(self.engine.xml.parent, self.tokenizer)
        self.margin = margin if margin is not None else self._measured_margin()

    @classmethod
    def load(cls, spec: str, *, weights: str = "int8", **options: Any) -> OpenVINOTarget:
        """`spec` as OpenVINO IR: an exported directory, or a preset, .gguf file or HF model exported
        once into the cache (export/openvino.py; the export needs `$OMNIDRAFT_OPENVINO_PYTHON`)."""
        from ..export.openvino import exported

        path = exported(spec, weights=weights)
        name = options.pop("name", None) or (spec if not Path(spec).expanduser().is_dir() else None)
        return cls(path, name=name, **options)

    def _measured_margin(self) -> float:
        from ..runtime.openvino_margin import measured_margin

        return measured_margin(self)

    def verify_costs(self, context: int | None = None) -> dict[int, float] | None:
        from ..runtime.openvino_margin import measured_costs

        return measured_costs(self)

    def begin(self, prompt_ids: list[int]) -> _OpenVINOSession:
        if not prompt_ids:
            raise ValueError("the prompt must have at least one token")
        if any(not 0 <= int(i) < self.engine.n_vocab for i in prompt_ids):
            raise ValueError(f"prompt ids must be in [0, {self.engine.n_vocab})")
        return _OpenVINOSession(self, list(prompt_ids))

    def __repr__(self) -> str:
        return f"OpenVINOTarget({self.name!r}, vocab {self.engine.n_vocab})"
