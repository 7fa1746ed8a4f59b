"""The base graph of any causal LM that optimum exports, with omnidraft's step on top.

optimum-onnx pins transformers below what this package runs, so the export runs in a Python that
has it (`optimum_python`: the argument, else `$OMNIDRAFT_OPTIMUM_PYTHON`), as a subprocess on a
directory written here: the drafter (adapter merged, fp32) with the config keys transformers 4
reads. optimum exports its "text-generation-with-past" graph (past key/values in, present out);
the LM head is then cut off it, so the graph ends at the final hidden state and the head is
evaluated beside it as for `--head outside`: int8, shortlisted heads and the sidecar work as for
omnidraft's own graphs (docs/onnx.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from ..errors import IncompatibleError, MissingDependencyError

__all__ = ["TASK", "cut_head", "export_base", "exporter_python", "legacy_config", "optimum_python"]

TASK = "text-generation-with-past"
INSTALL = (
    "python -m venv optimum-env && optimum-env/bin/pip install torch optimum-onnx 'transformers<4.58' "
    "onnxruntime, then pass --optimum-python optimum-env/bin/python (or set OMNIDRAFT_OPTIMUM_PYTHON)"
)


def exporter_python(given: str | None, variable: str, needs: str, exporter: str, install: str) -> str:
    """The Python of an exporter that lives in an environment of its own: `given`, else the
    environment `variable`; a clear error with the `install` line where there is none. `needs`
    says why it is apart; `exporter` names it."""
    python = given or os.environ.get(variable)
    if not python:
        raise MissingDependencyError(f"{needs}, so it lives in an environment of its own: {install}")
    if not Path(python).is_file():
        raise MissingDependencyError(f"no Python at {python} to run {exporter}: {install}")
    return python


def optimum_python(given: str | None = None) -> str:
    """The Python that runs optimum's exporter."""
    needs = (
        "exporting through optimum needs a Python with optimum-onnx, which pins transformers < 4.58 "
        "(this package runs 5.x)"
    )
    return exporter_python(given, "OMNIDRAFT_OPTIMUM_PYTHON", needs, "optimum's exporter", INSTALL)


def legacy_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (as transformers 5 writes it) with the rope keys transformers 4 reads added:
    `rope_theta` (and `rope_scaling` unless the default), and for models whose layer types have
    their own rope (Gemma 3), the global one and `rope_local_base_freq`."""
    config = dict(config)
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict):
        return config
    if "full_attention" in rope:
        config["rope_local_base_freq"] = rope.get("sliding_attention", {}).get("rope_theta", 10000.0)
        rope = rope["full_attention"]
    config["rope_theta"] = rope.get("rope_theta", 10000.0)
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return config


def export_base(model: Any, out: Path, python: str) -> None:
    """optimum's graph of `model` (an HF causal LM, fp32, adapters merged) written to `out`, its LM
    head cut off; a clear error naming the architecture when optimum cannot export it."""
    kind = getattr(model.config, "model_type", type(model).__name__)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "model", Path(tmp) / "onnx"
        model.save_pretrained(src)
        config = src / "config.json"
        config.write_text(json.dumps(legacy_config(json.loads(config.read_text())), indent=1))
        run = subprocess.run(
            [python, "-m", "optimum.exporters.onnx", "--model", str(src), "--task", TASK, str(dst)],
            capture_output=True,
            text=True,
        )
        graph = dst / "model.onnx"
        if run.returncode != 0 or not graph.is_file():
            lines = [line for line in (run.stderr or run.stdout).splitlines() if line.strip()]
            reason = next((line for line in reversed(lines) if "Error" in line or "support" in line), "")
            raise IncompatibleError(
                f"optimum cannot export a drafter of architecture {kind!r}: {reason or (lines or ['?'])[-1]}"
            )
        cut_head(graph, out, int(model.config.hidden_size))


def cut_head(src: Path, out: Path, hidden_size: int) -> None:
    """The graph at `src` without the LM head that makes its `logits`: it outputs `hidden` (the
    final hidden states) first, then its present key/values; written to `out`."""
    import onnx

    model = onnx.load(str(src))
    graph = model.graph
    head = next((n for n in graph.node if "logits" in n.output), None)
    if head is None or head.op_type not in ("MatMul", "Gemm"):
        raise IncompatibleError(
            f"{src}: the graph's logits do not come from one MatMul over the hidden states "
            f"({head.op_type if head else 'no logits'}): its head cannot be evaluated outside it"
        )
    graph.node.remove(head)
    graph.node.append(onnx.helper.make_node("Identity", [head.input[0]], ["hidden"], name="omnidraft_hidden"))
    hidden = onnx.helper.make_tensor_value_info(
        "hidden", onnx.TensorProto.FLOAT, ["batch_size", "sequence_length", hidden_size]
    )
    presents = [o for o in graph.output if o.name != "logits"]
    del graph.output[:]
    graph.output.extend([hidden, *presents])
    used = {name for node in graph.node for name in node.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    onnx.save(model, str(out))
