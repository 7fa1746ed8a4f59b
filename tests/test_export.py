"""export/: the ONNX drafter graph, its onnxruntime backend, parity and refusal of bad files."""

from __future__ import annotations

import json

import pytest
import torch

import omnidraft as od
from omnidraft.errors import CorruptFileError, IncompatibleError
from omnidraft.export.graphs import Gemma3Graph, LlamaGraph, drafter_graph
from omnidraft.export.onnx import export_drafter
from omnidraft.export.ort_drafter import OrtDrafter
from omnidraft.runtime.causal_runner import CausalRunner

from .conftest import target_greedy, tiny_gemma3
from .test_pairing import PROMPTS


@pytest.fixture(scope="module")
def exported(tiny_drafter, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    prompts = [tiny_drafter.tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    sidecar = export_drafter(
        tiny_drafter.model,
        out,
        name="tiny-drafter",
        tokenizer=tiny_drafter.tokenizer,
        fingerprint=tiny_drafter.token_bytes.fingerprint,
        parity_prompts=prompts,
        parity_steps=12,
    )
    return out, sidecar


def test_graph_equals_the_hf_forward_with_and_without_past(tiny_drafter):
    graph = LlamaGraph(tiny_drafter.model).eval()
    ids = tiny_drafter.tokenizer(PROMPTS[0])["input_ids"]
    with torch.no_grad():
        logits, hidden, *present = graph(torch.tensor([ids[:-3]]), *graph.empty_past())
        logits2, _, *_ = graph(torch.tensor([ids[-3:]]), *present)
    runner = CausalRunner(tiny_drafter.model, ids[:-3])
    torch.testing.assert_close(logits[0], runner.forward(keep=1)[0], atol=1e-4, rtol=1e-4)
    runner.extend(ids[-3:])
    torch.testing.assert_close(logits2[0], runner.forward(keep=1)[0], atol=1e-4, rtol=1e-4)
    assert hidden.shape == (1, tiny_drafter.hidden_size)


def test_the_gemma3_graph_equals_the_hf_forward_past_its_sliding_window():
    """Gemma 3: scaled embedding, (1 + w) norms, q/k norms, local layers with their own rotary base
    and a window of 4 (crossed here), global layers; with and without past."""
    torch.manual_seed(0)
    model = tiny_gemma3(4)
    for layer in model.model.layers:  # non-zero norm weights, so that (1 + w) is tested
        for norm in (
            layer.input_layernorm,
            layer.post_attention_layernorm,
            layer.self_attn.q_norm,
            layer.self_attn.k_norm,
        ):
            norm.weight.data.normal_(0, 0.3)
    ids = torch.randint(0, 64, (14,)).tolist()
    graph = drafter_graph(model).eval()
    assert isinstance(graph, Gemma3Graph)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([ids])).logits[0]
        logits, hidden, *present = graph(torch.tensor([ids[:9]]), *graph.empty_past())
        logits2, _, *_ = graph(torch.tensor([ids[9:]]), *present)
    torch.testing.assert_close(logits[0], full[8], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits2[0], full[-1], atol=1e-4, rtol=1e-4)
    assert hidden.shape == (1, 32)
    with pytest.raises(ValueError, match="Llama and Gemma 3"):
        drafter_graph(type("M", (), {"config": type("C", (), {"model_type": "mistral"})()})())


def test_export_parity_is_recorded_and_greedy_identical(exported):
    out, sidecar = exported
    assert sidecar["parity"]["greedy_identical"] == 3 and sidecar["parity"]["top1_agreement"] == 1.0
    assert json.loads(out.with_name(out.name + ".json").read_text())["onnx_sha256"] == sidecar["onnx_sha256"]


def test_ort_drafts_equal_pytorch_drafts(exported, tiny_drafter):
    drafter = od.Drafter.load(str(exported[0]))
    for prompt in PROMPTS[:3]:
        ids = tiny_drafter.tokenizer(prompt)["input_ids"]
        a, b = tiny_drafter.begin(ids), drafter.begin(ids)
        for keep, tail in [(2, [5]), (0, []), (6, [])]:  # rollbacks of every kind between drafts
            assert a.propose(6, stop_confidence=0).ids == b.propose(6, stop_confidence=0).ids
            a.commit(keep, tail)
            b.commit(keep, tail)


def test_engine_with_the_ort_drafter_is_target_greedy(exported, tiny_target):
    pair = od.Drafter.load(str(exported[0])).pair(tiny_target, k=4)
    for prompt in PROMPTS[:4]:
        assert pair.generate(prompt, max_new_tokens=24).token_ids == target_greedy(tiny_target, prompt, 24)


def test_pruned_int8_export_maps_ids_back(tiny_drafter, tiny_target, tmp_path):
    keep = list(range(0, len(tiny_drafter.token_bytes), 2)) + [tiny_drafter.tokenizer.eos_token_id]
    out = tmp_path / "pruned.onnx"
    sidecar = export_drafter(
        tiny_drafter.model,
        out,
        name="tiny",
        tokenizer=tiny_drafter.tokenizer,
        quantize="int8",
        fingerprint=tiny_drafter.token_bytes.fingerprint,
        keep_ids=keep,
        parity_prompts=[tiny_drafter.tokenizer(PROMPTS[0])["input_ids"]],
    )
    assert 0 <= sidecar["parity"]["top1_agreement"] <= 1 and sidecar["quantization"] == "int8"
    kept = sidecar["keep_ids"]
    assert set(keep) <= set(kept) and len(kept) == 256  # padded to a whole block of rows
    drafter = od.Drafter.load(str(out))
    draft = drafter.begin(tiny_drafter.tokenizer(PROMPTS[1])["input_ids"]).propose(8, stop_confidence=0)
    assert all(t in set(kept) for t in draft.ids)
    pair = drafter.pair(tiny_target, k=4)
    assert pair.generate(PROMPTS[1], max_new_tokens=16).token_ids == target_greedy(
        tiny_target, PROMPTS[1], 16
    )


def test_corrupt_graph_or_foreign_tokenizer_is_refused(exported, tmp_path, target_tokenizer):
    import shutil

    src, _ = exported
    bad = tmp_path / "bad.onnx"
    shutil.copy(src, bad)
    shutil.copy(src.with_name(src.name + ".json"), tmp_path / "bad.onnx.json")
    shutil.copytree(src.with_suffix(".tokenizer"), tmp_path / "bad.tokenizer")
    bad.write_bytes(bad.read_bytes()[:1000])
    with pytest.raises(CorruptFileError, match="SHA-256"):
        OrtDrafter.open(bad)
    shutil.copy(src, bad)
    target_tokenizer.save_pretrained(str(tmp_path / "bad.tokenizer"))
    with pytest.raises(IncompatibleError, match="tokenizer"):
        OrtDrafter.open(bad)
    (tmp_path / "bad.onnx.json").write_text("{not json")
    with pytest.raises(CorruptFileError, match="sidecar"):
        OrtDrafter.open(bad)


def test_an_onnx_drafter_refuses_to_learn(exported, tiny_target):
    with pytest.raises(ValueError, match="cannot learn"):
        od.Drafter.load(str(exported[0])).pair(tiny_target, learn=True)


def test_a_head_outside_the_graph_drafts_whole_or_shortlisted(
    tiny_drafter, tiny_target, tmp_path, monkeypatch
):
    """`head="outside"`: the graph ends at the hidden state; the head beside it gives the graph-inside
    drafts, and each shortlist policy keeps the target's greedy output (DynaSpec's clusters from the
    head beside the graph, or a file the PyTorch drafter built); a tampered head file is refused."""
    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))
    out = tmp_path / "outside.onnx"
    sidecar = export_drafter(
        tiny_drafter.model,
        out,
        name="tiny-drafter",
        tokenizer=tiny_drafter.tokenizer,
        fingerprint=tiny_drafter.token_bytes.fingerprint,
        head="outside",
    )
    assert sidecar["head"] == "outside" and out.with_suffix(".head.pt").is_file()
    drafter = od.Drafter.load(str(out))
    ids = tiny_drafter.tokenizer(PROMPTS[0])["input_ids"]
    assert (
        drafter.begin(ids).propose(6, stop_confidence=0).ids
        == tiny_drafter.begin(ids).propose(6, stop_confidence=0).ids
    )
    router = tmp_path / "router.pt"
    from omnidraft.shortlist.build import shortlist

    shortlist(tiny_drafter, "dyna", size=256, clusters=8, path=router)
    for kind, options in [
        ("static", {"size": 256}),
        ("evo", {"size": 256}),
        ("dyna", {"size": 256, "clusters": 8}),
        ("dyna", {"size": 256, "clusters": 8, "path": router}),
    ]:
        drafter.use_shortlist(kind, **options)
        pair = drafter.pair(tiny_target, k=4)
        assert pair.generate(PROMPTS[1], max_new_tokens=16).token_ids == target_greedy(
            tiny_target, PROMPTS[1], 16
        ), kind
    with pytest.raises(ValueError, match="outside"):
        od.Drafter.load(str(exported_inside(tiny_drafter, tmp_path))).use_shortlist("static")
    out.with_suffix(".head.pt").write_bytes(b"torn")
    with pytest.raises(CorruptFileError, match="LM head"):
        od.Drafter.load(str(out))


def exported_inside(tiny_drafter, tmp_path):
    out = tmp_path / "inside.onnx"
    export_drafter(
        tiny_drafter.model,
        out,
        name="tiny-drafter",
        tokenizer=tiny_drafter.tokenizer,
        fingerprint=tiny_drafter.token_bytes.fingerprint,
    )
    return out


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_gathering_graph_evaluates_just_the_support(
    tiny_drafter, tiny_target, tmp_path, monkeypatch, quantize
):
    """`head="gather"`: the graph takes the support's ids and evaluates only those head rows. On the
    support its logits are the full head's (fp32: the same rows; int8: the rows `int8_rows` gives the
    head, dequantized); static and EvoSpec keep the target's greedy output; DynaSpec, whose support
    depends on the graph's own hidden state, is refused; without a shortlist every row is gathered."""
    from omnidraft.runtime.int8 import int8_rows

    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))
    out = tmp_path / "gather.onnx"
    sidecar = export_drafter(
        tiny_drafter.model,
        out,
        name="tiny-drafter",
        tokenizer=tiny_drafter.tokenizer,
        fingerprint=tiny_drafter.token_bytes.fingerprint,
        head="gather",
        quantize=quantize,
    )
    assert sidecar["head"] == "gather"
    drafter = od.Drafter.load(str(out))
    assert drafter.gathers and drafter.lm_head is None
    ids = tiny_drafter.tokenizer(PROMPTS[0])["input_ids"]
    weight = tiny_drafter.model.get_output_embeddings().weight.detach().float()
    if quantize:
        rows, scales = int8_rows(weight)
        weight = rows.float() * scales[:, None]
    support = torch.tensor([3, 17, 0, 250, 99])
    state = drafter.graph.start()
    got = torch.from_numpy(drafter.graph.feed(state, ids, support.numpy()))
    want = torch.from_numpy(state.hidden) @ weight[support].T
    assert (got - want).abs().max() < 1e-4  # fp32 and int8 alike: ~1e-6
    if quantize is None:
        full = CausalRunner(tiny_drafter.model, ids).forward(keep=1)[0]
        assert (got - full[support]).abs().max() < 1e-4
        assert (
            drafter.begin(ids).propose(6, stop_confidence=0).ids
            == tiny_drafter.begin(ids).propose(6, stop_confidence=0).ids
        )
    with pytest.raises(ValueError, match="outside"):
        drafter.use_shortlist("dyna", size=256, clusters=8)
    for kind in ("static", "evo"):
        drafter.use_shortlist(kind, size=256)
        pair = drafter.pair(tiny_target, k=4)
        assert pair.generate(PROMPTS[1], max_new_tokens=16).token_ids == target_greedy(
            tiny_target, PROMPTS[1], 16
        ), kind
        assert 256 <= max(drafter.head.support_sizes) < drafter.vocab_size
