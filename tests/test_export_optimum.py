"""export/via_optimum.py: the base graph of any architecture optimum exports, run in optimum's own
environment (`make` builds .venv-optimum), its head cut off and evaluated beside it: logits within
a stated tolerance of PyTorch for a tiny Qwen 2 and a tiny Gemma 3 (and the real SmolLM2 and
Gemma 3 270M), drafting on onnxruntime, and a clear error for what optimum cannot export."""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

import omnidraft as od
from omnidraft.errors import IncompatibleError, MissingDependencyError
from omnidraft.export.onnx import export_drafter
from omnidraft.export.sidecar import sidecar_path
from omnidraft.export.via_optimum import legacy_config, optimum_python

from .conftest import tiny_gemma3, tiny_llama
from .test_pairing import PROMPTS

OPTIMUM = os.environ.get("OMNIDRAFT_OPTIMUM_PYTHON") or str(
    Path(__file__).resolve().parents[1] / ".venv-optimum" / "bin" / "python"
)
TOLERANCE = 1e-3  # the largest |logit| difference to PyTorch allowed in fp32


def tiny_qwen2(vocab: int):
    """A third architecture: a 2-layer Qwen 2 (q/k/v biases), random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).eval()


def _export(model, tokenizer, fingerprint, out, prompts, **options):
    return export_drafter(
        model,
        out,
        name=out.stem,
        tokenizer=tokenizer,
        fingerprint=fingerprint,
        parity_prompts=prompts,
        parity_steps=8,
        head="outside",
        exporter="optimum",
        optimum_python=OPTIMUM,
        **options,
    )


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "llama"])
def test_optimums_graph_of_a_tiny_model_matches_pytorch_and_drafts(arch, tiny_drafter, tmp_path):
    tokenizer = tiny_drafter.tokenizer
    models = {"qwen2": partial(tiny_qwen2, len(tokenizer)), "gemma3": partial(tiny_gemma3, 512)}
    model = models.get(arch, partial(tiny_llama, len(tokenizer), seed=3))()
    if arch == "gemma3":  # the tiny Gemma's 64 ids: prompts within them
        prompts = [[i % 64 for i in tokenizer(p)["input_ids"]] for p in PROMPTS[:2]]
    else:
        prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    out = tmp_path / f"{arch}.onnx"
    fingerprint = tiny_drafter.token_bytes.fingerprint
    sidecar = _export(model, tokenizer, fingerprint, out, prompts)
    assert sidecar["exporter"] == "optimum" and sidecar["head"] == "outside"
    assert sidecar["parity"]["max_abs_logit_diff"] < TOLERANCE
    assert sidecar["parity"]["greedy_identical"] == len(prompts)
    if arch == "qwen2":  # the same vocabulary as the tiny drafter: it drafts through the pairing
        drafter = od.Drafter.load(str(out))
        ids = drafter.tokenizer(PROMPTS[0])["input_ids"]
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0, -1]
        got = drafter.full_logits(drafter.run(drafter.graph.start(), ids))
        assert float((got - want).abs().max()) < TOLERANCE


def test_int8_through_optimum_keeps_greedy_agreement(tiny_drafter, tmp_path):
    tokenizer = tiny_drafter.tokenizer
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    sidecar = _export(
        tiny_qwen2(len(tokenizer)),
        tokenizer,
        tiny_drafter.token_bytes.fingerprint,
        tmp_path / "q8.onnx",
        prompts,
        quantize="int8",
    )
    assert sidecar["quantization"] == "int8" and sidecar["parity"]["top1_agreement"] >= 0.75
    meta = json.loads(sidecar_path(tmp_path / "q8.onnx").read_text())
    assert meta["onnx_sha256"] == sidecar["onnx_sha256"]  # loads only with its sidecar, as before


def test_an_architecture_optimum_cannot_export_is_named(tiny_drafter, tmp_path):
    """A Python whose optimum refuses (stand-in: a script that fails as optimum does)."""
    fake = tmp_path / "python"
    fake.write_text(
        f"#!{sys.executable}\nimport sys\n"
        "print('ValueError: Trying to export a qwen2 model, that is a custom or unsupported "
        "architecture', file=sys.stderr)\nsys.exit(1)\n"
    )
    fake.chmod(0o755)
    with pytest.raises(IncompatibleError, match="architecture 'qwen2'.*unsupported"):
        export_drafter(
            tiny_qwen2(len(tiny_drafter.tokenizer)),
            tmp_path / "x.onnx",
            name="x",
            tokenizer=tiny_drafter.tokenizer,
            fingerprint="f",
            head="outside",
            exporter="optimum",
            optimum_python=str(fake),
        )
    assert not (tmp_path / "x.onnx").exists()  # nothing half-written is left


def test_where_optimum_lives_and_what_it_reads_are_explained(monkeypatch, tiny_drafter, tmp_path):
    monkeypatch.delenv("OMNIDRAFT_OPTIMUM_PYTHON", raising=False)
    with pytest.raises(MissingDependencyError, match="transformers < 4.58"):
        optimum_python(None)
    with pytest.raises(MissingDependencyError, match="no Python at"):
        optimum_python(str(tmp_path / "none"))
    with pytest.raises(ValueError, match="head outside"):
        export_drafter(
            tiny_drafter.model,
            tmp_path / "y.onnx",
            name="y",
            tokenizer=None,
            fingerprint="f",
            exporter="optimum",
        )
    gemma = {
        "rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
    }
    assert legacy_config(gemma)["rope_theta"] == 1e6 and legacy_config(gemma)["rope_local_base_freq"] == 1e4
    llama = {"rope_parameters": {"rope_theta": 1e5, "rope_type": "llama3", "factor": 8.0}}
    assert legacy_config(llama)["rope_theta"] == 1e5 and legacy_config(llama)["rope_scaling"]["factor"] == 8.0


@pytest.mark.real
@pytest.mark.parametrize("spec", ["gemma3-270m"])  # SmolLM2's architecture: the tiny Llama above
def test_the_real_drafters_exported_through_optimum_match_pytorch(spec, tmp_path):
    from omnidraft.store.models import load_model

    loaded = load_model(spec)
    prompts = [loaded.tokenizer(p)["input_ids"] for p in PROMPTS[:1]]
    fingerprint = od.Drafter.load(spec).token_bytes.fingerprint
    sidecar = _export(loaded.model, loaded.tokenizer, fingerprint, tmp_path / f"{spec}.onnx", prompts)
    assert sidecar["parity"]["greedy_identical"] == 1
    assert sidecar["parity"]["max_abs_logit_diff"] < 0.05  # real logits run to ~30: fp32 summation order
