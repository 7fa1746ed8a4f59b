"""Export a drafter to ONNX with its KV cache as graph inputs and outputs: a Llama or Gemma 3
graph of our own (graphs.py), or the base graph of any architecture optimum exports
(via_optimum.py).

The pairing's LoRA adapter is merged into the weights before export (one graph per target). The LM head
may be pruned to the tokens the pairing can use (V' < V; the sidecar lists them). Optional dynamic
int8 quantization uses onnxruntime's quantizer (per-channel weights, MLPs smoothed first as in
int8.py). A parity check against the PyTorch model runs at
export time and its figures go into the JSON sidecar beside the .onnx.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..store.atomic import atomic_path, atomic_write_bytes
from .graphs import HEADS, LlamaGraph, drafter_graph
from .sidecar import SIDECAR_FORMAT, file_sha256, sidecar_path

__all__ = ["ExportOptions", "MergedAdapter", "export_drafter"]

log = logging.getLogger("omnidraft")

OPSET = 17
EXPORTERS = ("omnidraft", "optimum")  # our graphs (Llama, Gemma 3), or optimum's (via_optimum.py)


def _names(layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
    return past, [name.replace("past_", "present_") for name in past]


def _export_graph(graph: LlamaGraph, path: Path) -> None:
    layers = len(graph.layers)
    past_names, present_names = _names(layers)
    ids = torch.tensor([[1, 2, 3]], dtype=torch.long)
    past = [torch.zeros(1, graph.kv_heads, 2, graph.head_dim) for _ in range(2 * layers)]
    gather = graph.head == "gather"
    support = [torch.tensor([0, 2, 3], dtype=torch.long)] if gather else []
    axes = {
        "input_ids": {1: "new"},
        **{n: {2: "past"} for n in past_names},
        **{n: {2: "total"} for n in present_names},
    }
    if gather:
        axes.update({"support": {0: "support"}, "logits": {1: "support"}})
    with torch.no_grad():
        torch.onnx.export(
            graph,
            (ids, *support, *past),
            str(path),
            input_names=["input_ids", *["support"] * gather, *past_names],
            output_names=["logits"] * (graph.head != "outside") + ["hidden", *present_names],
            dynamic_axes=axes,
            opset_version=OPSET,
            dynamo=False,
        )


def _merged_model(model: Any, adapter: dict[str, torch.Tensor] | None, adapter_config: Any) -> Any:
    """An fp32 copy of the drafter with `adapter` folded into its weights (`model` is not changed)."""
    import copy

    model = copy.deepcopy(model).float().eval()
    if adapter is None:
        return model
    from ..distill.adapters import AdapterConfig, add_adapter, load_adapter_state

    peft_model = add_adapter(model, "export", adapter_config or AdapterConfig())
    load_adapter_state(peft_model, "export", adapter)
    return peft_model.merge_and_unload().eval()


def parity(
    model: Any,
    onnx_path: Path,
    keep_ids: Sequence[int] | None,
    prompts: list[list[int]],
    steps: int,
    head: Any = None,
) -> dict[str, Any]:
    """Greedy drafting with the ORT graph vs the PyTorch model over `prompts`, `steps` tokens each;
    `head`: the LM head a graph without one is read through."""
    from ..runtime.causal_runner import CausalRunner
    from .ort_drafter import OrtGraph

    graph = OrtGraph(onnx_path)
    keep = torch.as_tensor(list(keep_ids)) if keep_ids is not None else None
    same = total = top1 = 0
    worst = 0.0
    for ids in prompts:
        runner, state = CausalRunner(model, ids), graph.start()
        logits_ort = graph.feed(state, ids)
        torch_ids, ort_ids = [], []
        for _ in range(steps):
            ref = runner.forward(keep=1)[0].float()
            ref_kept = ref[keep] if keep is not None else ref
            got = torch.from_numpy(logits_ort)
            if head is not None:
                with torch.no_grad():
                    got = head(got[None])[0].float()
            worst = max(worst, float((ref_kept - got).abs().max()))
            top1 += int(ref_kept.argmax()) == int(got.argmax())
            total += 1
            token = int(ref.argmax())
            ort_token = int(keep[got.argmax()]) if keep is not None else int(got.argmax())
            torch_ids.append(token)
            ort_ids.append(ort_token)
            runner.extend([token])
            logits_ort = graph.feed(state, [token])  # follow the PyTorch path so positions compare
        same += torch_ids == ort_ids
    return {
        "prompts": len(prompts),
        "steps": steps,
        "greedy_identical": same,
        "top1_agreement": top1 / max(1, total),
        "max_abs_logit_diff": worst,
    }


@dataclass(frozen=True)
class ExportOptions:
    """How a drafter is exported. `quantize`: None or "int8" (dynamic, onnxruntime's quantizer,
    MLPs smoothed first). `keep_ids`: prune the LM head to these token ids (a head inside the graph
    only). `head`: "inside" (the graph gives logits); "outside" (the graph ends at the final hidden
    state and the LM head's weight is saved beside it, OUT.head.pt, for the drafter to evaluate in
    PyTorch, whole or shortlisted: `OrtDrafter.use_shortlist`); "gather" (the graph takes a
    shortlist support's ids as an input and evaluates just those rows of the head, int8 rows with
    `quantize="int8"`). `exporter`: "omnidraft" (our Llama and Gemma 3 graphs) or "optimum" (the
    base graph of any architecture optimum exports, run in the Python `optimum_python` names:
    via_optimum.py; its head always outside). `parity_prompts`: token ids the export is checked on
    against PyTorch, `parity_steps` greedy steps each."""

    quantize: str | None = None
    keep_ids: Sequence[int] | None = None
    head: str = "inside"
    exporter: str = "omnidraft"
    optimum_python: str | None = None
    parity_prompts: list[list[int]] | None = None
    parity_steps: int = 16

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ValueError(f"exporter must be one of {EXPORTERS}, got {self.exporter!r}")
        if self.exporter == "optimum" and self.head != "outside":
            raise ValueError(
                f"optimum's graph is exported with its LM head outside (head='outside'): {self.head!r}"
            )
        if self.head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {self.head!r}")
        if self.head != "inside" and self.keep_ids is not None:
            raise ValueError(
                f"a pruned head (keep_ids) is a head inside the graph; with the head {self.head}, "
                "shortlist it instead"
            )
        if self.quantize not in (None, "int8"):
            raise ValueError(f"quantize must be None or 'int8', got {self.quantize!r}")


@dataclass(frozen=True)
class MergedAdapter:
    """A pairing's LoRA adapter to merge into the exported weights: its tensors, its peft config
    (None: read from the tensors' shapes) and the id the sidecar records."""

    tensors: dict[str, torch.Tensor]
    config: Any = None
    id: str | None = None


def export_drafter(
    model: Any,
    out: str | Path,
    *,
    name: str,
    tokenizer: Any,
    fingerprint: str,
    adapter: MergedAdapter | None = None,
    options: ExportOptions | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """Export fp32 HF Llama or Gemma 3 `model` (drafter `name`) with `adapter` merged: writes `out`
    (.onnx), its tokenizer beside it (OUT.tokenizer/) and the JSON sidecar (OUT.json); returns the
    sidecar. `options` (or its fields as keywords): see `ExportOptions`."""
    if options is not None and fields:
        raise ValueError(f"pass ExportOptions or its fields as keywords, not both (got {sorted(fields)})")
    options = options or ExportOptions(**fields)
    out = Path(out)
    if out.suffix != ".onnx":
        raise ValueError(f"the export path must end in .onnx, got {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    from tqdm import tqdm

    quantize = options.quantize
    bar = tqdm(total=4 + (quantize == "int8"), desc=f"exporting {name}", unit="step", disable=None)
    bar.set_postfix_str("merging the adapter" if adapter is not None else "preparing the model")
    model = _merged_model(model, adapter.tensors if adapter else None, adapter.config if adapter else None)
    if quantize == "int8":  # same function in fp32; int8 loses less of it (int8.py)
        from ..runtime.int8 import smooth_mlps

        smooth_mlps(model, tokenizer)
    keep_ids = options.keep_ids
    if keep_ids is not None:
        keep_ids = _aligned(sorted(set(int(i) for i in keep_ids)), int(model.config.vocab_size))
    _write_graph(model, out, keep_ids, options, bar)
    _step(bar, "writing the tokenizer and head")
    tokenizer.save_pretrained(str(out.with_suffix(".tokenizer")))
    head_file = _write_head(model, out) if options.head == "outside" else None
    _step(bar, "parity check")
    outside = model.lm_head if options.head == "outside" else None
    prompts, steps = options.parity_prompts, options.parity_steps
    report = (
        parity(model, out, keep_ids, prompts, steps, outside)
        if prompts and options.head != "gather"
        else None
    )
    layout = _layout(out)  # what the graph holds per layer, whoever exported it
    _step(bar, "done")
    bar.close()
    sidecar = {
        "format": SIDECAR_FORMAT,
        "version": 1,
        "drafter": name,
        "tokenizer_fingerprint": fingerprint,
        "vocab_size": int(model.config.vocab_size),
        "hidden_size": int(model.config.hidden_size),
        "layers": layout["layers"],
        "kv_heads": layout["kv_heads"],
        "head_dim": layout["head_dim"],
        "exporter": options.exporter,
        "eos_token_id": tokenizer.eos_token_id,
        "adapter": adapter.id if adapter else None,
        "opset": layout["opset"],
        "quantization": quantize,
        "keep_ids": keep_ids,
        "onnx_sha256": file_sha256(out),
        "onnx_bytes": out.stat().st_size,
        "head": options.head,
        "head_sha256": file_sha256(head_file) if head_file else None,
        "parity": report,
        "export_seconds": round(time.perf_counter() - started, 1),
    }
    atomic_write_bytes(sidecar_path(out), json.dumps(sidecar, indent=1).encode())
    log.info(
        "exported %s (%.1f MB) in %.0f s", out, out.stat().st_size / 2**20, time.perf_counter() - started
    )
    return sidecar


def _write_graph(model: Any, out: Path, keep_ids: list[int] | None, options: ExportOptions, bar: Any) -> None:
    """The graph at `out` (ours or optimum's), int8-quantized if asked; atomic: an interrupted
    export leaves the previous graph, or none."""
    int8 = options.quantize == "int8"
    graph = None
    if options.exporter != "optimum":
        graph = drafter_graph(model, keep_ids, head=options.head, int8_rows=int8)
    with atomic_path(out) as tmp:
        if graph is None:
            from . import via_optimum

            _step(bar, "exporting with optimum")
            via_optimum.export_base(model, tmp, via_optimum.optimum_python(options.optimum_python))
        else:
            _step(bar, "tracing the graph")
            _export_graph(graph.eval(), tmp)
        if int8:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            _step(bar, "quantizing to int8")
            fp32 = tmp.with_name(tmp.name + ".fp32")
            tmp.replace(fp32)
            try:
                quantize_dynamic(
                    str(fp32),
                    str(tmp),
                    weight_type=QuantType.QInt8,
                    per_channel=True,
                    nodes_to_exclude=_reading(fp32, "head_scales"),
                )  # the gathered head's scales stay fp32
            finally:
                fp32.unlink(missing_ok=True)


def _write_head(model: Any, out: Path) -> Path:
    """The LM head's weight beside the graph (OUT.head.pt), for a head evaluated outside it."""
    import io

    head_file = out.with_suffix(".head.pt")
    buffer = io.BytesIO()
    torch.save({"weight": model.lm_head.weight.detach().clone()}, buffer)
    atomic_write_bytes(head_file, buffer.getvalue())
    return head_file


def _layout(path: Path) -> dict[str, int]:
    """The graph's opset and its cache layout (layers, KV heads, head width), read from its
    past key/value inputs, read once from the file."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    past = [i for i in model.graph.input if i.name.startswith("past_")]
    dims = past[0].type.tensor_type.shape.dim
    return {
        "opset": max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
        "layers": len(past) // 2,
        "kv_heads": dims[1].dim_value,
        "head_dim": dims[3].dim_value,
    }


def _step(bar: Any, label: str) -> None:
    bar.update()
    bar.set_postfix_str(label)


def _reading(path: Path, initializer: str) -> list[str]:
    """The names of the nodes of the graph at `path` that read `initializer`."""
    import onnx

    return [
        node.name
        for node in onnx.load(str(path), load_external_data=False).graph.node
        if initializer in node.input
    ]


def _aligned(keep: list[int], vocab: int, block: int = 256) -> list[int]:
    """`keep` padded with the lowest unused ids to a multiple of `block` rows: GEMM kernels run a
    ragged output width on a slow path (an odd 39,237-row head drafted slower than the full 49,152)."""
    if not keep or not all(0 <= i < vocab for i in keep):
        raise ValueError(f"keep_ids must be non-empty ids in [0, {vocab})")
    want = min(vocab, -(-len(keep) // block) * block)
    kept = set(keep)
    extra = [i for i in range(vocab) if i not in kept][: want - len(keep)]
    return sorted(kept | set(extra))
