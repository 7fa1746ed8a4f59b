"""`OrtDrafter`: an exported graph (export/onnx.py) on onnxruntime, a drafting backend.

`Drafter.load("drafter.onnx")` (`OrtDrafter.open`) checks the sidecar (format, the .onnx file's SHA-256, the
tokenizer saved beside it against the fingerprint recorded at export) before opening the graph.
A session keeps the KV cache as numpy arrays; a rollback slices them. With a pruned LM head the
graph's logits cover `keep_ids` only and ids are mapped back to the drafter's vocabulary here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..draft.base import Drafter
from ..errors import CorruptFileError, IncompatibleError
from .sidecar import SIDECAR_FORMAT, file_sha256, sidecar_path

__all__ = ["OrtDrafter", "OrtGraph", "OrtStream"]


class _State:
    def __init__(self, past: list[np.ndarray]) -> None:
        self.past = past
        self.hidden: np.ndarray | None = None

    @property
    def length(self) -> int:
        return int(self.past[0].shape[2])


class OrtGraph:
    """An onnxruntime session over an exported drafter graph."""

    def __init__(self, path: str | Path, threads: int | None = None) -> None:
        from ..optional import require

        ort = require("onnxruntime", "an ONNX drafter")

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # idle pool threads must not spin: the target verifies on the same cores right after a draft
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own types for unreadable graphs
            raise CorruptFileError(f"{path}: onnxruntime cannot load this graph: {exc}") from None
        inputs = self.session.get_inputs()
        self.past_names = [i.name for i in inputs if i.name.startswith("past_")]
        if not self.past_names or inputs[0].name != "input_ids":
            raise CorruptFileError(
                f"{path}: not an omnidraft drafter graph (inputs {[i.name for i in inputs]})"
            )
        self.gathers = any(i.name == "support" for i in inputs)  # the head's rows named per call
        names = {i.name for i in inputs}  # optimum's graphs (via_optimum.py) also take these two
        self.masks, self.positions = "attention_mask" in names, "position_ids" in names
        shape = next(i for i in inputs if i.name.startswith("past_")).shape
        self.kv_heads, self.head_dim = int(shape[1]), int(shape[3])
        self.output_names = [o.name for o in self.session.get_outputs()]

    def start(self) -> _State:
        return _State(
            [np.zeros((1, self.kv_heads, 0, self.head_dim), dtype=np.float32) for _ in self.past_names]
        )

    def feed(self, state: _State, ids: list[int], support: np.ndarray | None = None) -> np.ndarray:
        """Feed `ids` after the state's cache; returns the last position's logits (V',), or its
        final hidden state (d,) from a graph without its LM head. A gathering graph takes the ids
        of its support (int64) and returns their logits in that order."""
        feeds = {"input_ids": np.asarray([ids], dtype=np.int64), **dict(zip(self.past_names, state.past))}
        past = state.length
        if self.masks:
            feeds["attention_mask"] = np.ones((1, past + len(ids)), dtype=np.int64)
        if self.positions:
            feeds["position_ids"] = np.arange(past, past + len(ids), dtype=np.int64)[None]
        if self.gathers:
            if support is None:
                raise ValueError("this graph evaluates the head rows named by a support: pass support=")
            feeds["support"] = support
        outputs = self.session.run(self.output_names, feeds)
        if self.output_names[0] == "logits":
            logits, hidden, *present = outputs
        else:
            hidden, *present = outputs
            if hidden.ndim == 3:  # every position's (optimum's graphs): the last one's is the one read
                hidden = hidden[:, -1]
            logits = hidden
        if len({p.shape[2] for p in present}) > 1:
            raise IncompatibleError(
                "this graph keeps a sliding window of keys/values in some layers, and the context "
                f"has outgrown it ({past + len(ids)} tokens): drafting needs every layer's cache whole"
            )
        state.past, state.hidden = present, hidden[0]
        return logits[0]

    @staticmethod
    def crop(state: _State, n: int) -> None:
        if state.length > n:
            state.past = [p[:, :, :n] for p in state.past]


class OrtStream:
    """A `Stream` on an exported graph: the KV cache as numpy arrays, sliced back on a crop. The
    graph gives the last position's logits only: more rows are more calls."""

    gives_hidden = True

    def __init__(self, owner: OrtDrafter, ids: list[int]) -> None:
        self.owner, self.graph = owner, owner.graph
        self.state = self.graph.start()
        self.ids = list(ids)  # the sequence; the cache holds its first state.length tokens

    def extend(self, ids: list[int]) -> None:
        self.ids.extend(ids)

    def crop(self, n: int) -> None:
        del self.ids[n:]
        self.graph.crop(self.state, min(self.state.length, n))

    def logits(self, rows: int = 1, *, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = len(self.ids)
        self.graph.crop(self.state, min(self.state.length, n - rows))  # re-feed positions read again
        out, states = [], []
        for end in range(n - rows + 1, n + 1):
            out.append(
                self.owner.full_logits(
                    self.owner.run(self.state, self.ids[self.state.length : end]), self.owner.support
                )
            )
            states.append(torch.from_numpy(self.state.hidden))
        return torch.stack(out), torch.stack(states) if hidden else None


class OrtDrafter(Drafter, name="onnx"):
    """A drafter running an exported ONNX graph (`Drafter.load("drafter.onnx")`); drafts, cannot learn."""

    backend = "ONNX Runtime"

    def __init__(self, graph: OrtGraph, tokenizer: Any, sidecar: dict[str, Any], name: str) -> None:
        self.graph, self.sidecar, self.name = graph, sidecar, name
        self.vocab_size = int(sidecar["vocab_size"])
        self._init_vocabulary(tokenizer, self.vocab_size)
        keep = sidecar.get("keep_ids")
        self.keep_ids = torch.as_tensor(keep, dtype=torch.long) if keep is not None else None
        self.hidden_size = int(sidecar["hidden_size"])
        self.lm_head: torch.nn.Module | None = None  # the LM head, when the graph ends at the hidden state
        self.head: Any = None  # its shortlisted form (a ShortlistHead), when one is in use
        self.gathers = (
            graph.gathers
        )  # the graph evaluates the head rows of `support` (a shortlist's, else all)
        self._every = torch.arange(self.vocab_size)  # a gathering graph's support without a shortlist
        self.support = self._every  # the rows of the last gathering call
        self._blocks: tuple[Any, ...] = ()  # the blocks `support` was joined from, held so no id is reused
        self._rows = self._every.numpy()  # `support` as the graph's input

    @classmethod
    def from_spec(cls, spec: str, *, threads: int | None = None, **_: Any) -> OrtDrafter:
        return cls.open(spec, threads=threads)

    @classmethod
    def open(cls, path: str | Path, *, threads: int | None = None) -> OrtDrafter:
        """Open an exported drafter; a corrupt graph or a mismatched tokenizer is refused."""
        from transformers import AutoTokenizer

        path = Path(path)
        meta = sidecar_path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no exported drafter at {path}")
        try:
            sidecar = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CorruptFileError(
                f"{meta}: missing or unreadable sidecar ({exc}); export the drafter again"
            ) from None
        if sidecar.get("format") != SIDECAR_FORMAT or sidecar.get("version") != 1:
            raise CorruptFileError(
                f"{meta}: not an omnidraft ONNX drafter sidecar (format {sidecar.get('format')!r})"
            )
        if file_sha256(path) != sidecar.get("onnx_sha256"):
            raise CorruptFileError(
                f"{path}: the file's SHA-256 differs from its sidecar's: truncated or modified; export again"
            )
        tokenizer = AutoTokenizer.from_pretrained(str(path.with_suffix(".tokenizer")))
        drafter = cls(
            OrtGraph(path, threads), tokenizer, sidecar, Path(sidecar.get("drafter") or path.stem).name
        )
        if sidecar.get("head") == "outside":
            drafter.lm_head = _load_head(path.with_suffix(".head.pt"), sidecar)
        if drafter.token_bytes.fingerprint != sidecar.get("tokenizer_fingerprint"):
            raise IncompatibleError(
                f"{path}: the tokenizer beside the graph is not the one it was exported with "
                f"(fingerprint {drafter.token_bytes.fingerprint} vs {sidecar.get('tokenizer_fingerprint')})"
            )
        return drafter

    def run(self, state: _State, ids: list[int]) -> np.ndarray:
        """The graph on `ids` after `state`; a gathering graph is given the support of this call."""
        if not self.gathers:
            return self.graph.feed(state, ids)
        if self.head is None:
            self.support, self._blocks, self._rows = self._every, (), self._every.numpy()
            return self.graph.feed(state, ids, self._rows)
        blocks = tuple(self.head.policy.blocks(None, self.head.step))
        if blocks != self._blocks:  # a policy hands out the same blocks until it changes them
            self.support = torch.cat([b.ids for b in blocks])
            self._blocks, self._rows = blocks, self.support.numpy()
        self.head.support_sizes.append(len(self.support))
        return self.graph.feed(state, ids, self._rows)

    def full_logits(self, logits: np.ndarray, support: torch.Tensor | None = None) -> torch.Tensor:
        """Graph logits as (V,) over the drafter vocabulary (-inf where a pruned head has no row, or
        outside a shortlist); from a graph without its head, its hidden state through the head here;
        from a gathering graph, `support` names the rows (default: those of the last call)."""
        t = torch.from_numpy(logits)
        if self.lm_head is not None:
            with torch.inference_mode():
                return (self.head if self.head is not None else self.lm_head)(t[None])[0].float()
        if self.keep_ids is None and not self.gathers:
            return t
        full = torch.full((self.vocab_size,), float("-inf"))
        full[(self.support if support is None else support) if self.gathers else self.keep_ids] = t
        return full

    def stream(self, ids: list[int]) -> OrtStream:
        return OrtStream(self, ids)

    def use_shortlist(self, kind: str | None, **options: Any) -> None:
        """As `Drafter.use_shortlist`, for a graph exported with its head outside (`omnidraft
        export --head outside`: every policy) or gathered (`--head gather`: static and EvoSpec,
        whose support is known before the call). None or "full": the whole head."""
        from ..shortlist.build import shortlist
        from ..shortlist.shortlisted_head import ShortlistHead

        if self.lm_head is None and not self.gathers:
            raise ValueError(
                f"{self.name}: a shortlist needs a graph exported with its LM head outside or gathered "
                "(--head outside | gather)"
            )
        if self.gathers and kind == "dyna":
            raise ValueError(
                f"{self.name}: a DynaSpec router reads the hidden state of the position it drafts, so its "
                "support is known only after the graph ran: export with --head outside for it"
            )
        with self.lock:
            self.head = (
                None
                if kind in (None, "full")
                else ShortlistHead(
                    self.lm_head, self.vocab_size, shortlist(self, kind, head=self.lm_head, **options)
                )
            )

    def __repr__(self) -> str:
        quantization = self.sidecar.get("quantization") or "fp32"
        return f"OrtDrafter({self.name!r}, vocab {self.vocab_size}, {quantization})"


def _load_head(path: Path, sidecar: dict[str, Any]) -> torch.nn.Module:
    """The LM head saved beside a graph exported without it: checked against the sidecar, int8
    (per-channel dynamic) when the graph is."""
    import io

    if not path.is_file() or file_sha256(path) != sidecar.get("head_sha256"):
        raise CorruptFileError(
            f"{path}: the LM head beside the graph is missing or differs from its sidecar's; export again"
        )
    weight = torch.load(io.BytesIO(path.read_bytes()), weights_only=True)["weight"]
    if tuple(weight.shape) != (int(sidecar["vocab_size"]), int(sidecar["hidden_size"])):
        raise CorruptFileError(
            f"{path}: an LM head of shape {tuple(weight.shape)} does not fit the sidecar's vocabulary "
            f"and hidden size"
        )
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = torch.nn.Parameter(weight, requires_grad=False)
    if sidecar.get("quantization") == "int8":
        from ..runtime.int8 import quantize_int8

        head = quantize_int8(torch.nn.Sequential(head), inplace=True)[0]
    return head
