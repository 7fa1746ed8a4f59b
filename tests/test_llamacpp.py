"""llama.cpp as drafter and as target (in process, behind the server, inside llama-cpp-python's own
speculative decoding), on the presets' own GGUF files: identity with the engine's own greedy
generation, no stale KV after any rejection, and the server's guarantees on the new backend."""

from __future__ import annotations

import json
import os
import sys

import llama_cpp
import pytest
import torch

import omnidraft as od
from omnidraft.bench.datasets import load_prompts
from omnidraft.errors import MissingDependencyError
from omnidraft.llamacpp.hook import OmnidraftDraftModel
from omnidraft.llamacpp.loading import gguf_file, open_llama
from omnidraft.server.app import ServerConfig, create_app
from omnidraft.store.models import load_tokenizer
from omnidraft.store.presets import gguf_path
from omnidraft.target import Rule
from omnidraft.targets.remote import RemoteTarget

from .conftest import target_greedy

pytestmark = pytest.mark.real

KEY = "llama-key"
AUTH = {"authorization": f"Bearer {KEY}"}
TOKENS = 48


def own_greedy(llm, ids: list[int], n: int, eos: frozenset[int]) -> list[int]:
    """llama-cpp-python's own generation loop, greedy, on `llm` from a fresh context."""
    llm.reset()
    out: list[int] = []
    for token in llm.generate(ids, temp=0.0, reset=True):
        out.append(int(token))
        if len(out) >= n or token in eos:
            break
    return out


@pytest.fixture(scope="module")
def drafter():
    return od.Drafter.load("smollm2-135m", backend="llama.cpp")


@pytest.fixture(scope="module")
def target():
    # the 1.5B runs the same code on a larger model of the same family: one test of its own below
    return od.LlamaCppTarget("qwen2.5-coder-0.5b", n_ctx=2048)


@pytest.fixture(scope="module")
def prompts():
    # the last is long (~700 tokens): past a few hundred tokens of context no batch is exact here
    return [load_prompts(w, 1)[0] for w in ("gsm8k", "humaneval", "code-edit", "summarize")]


@pytest.fixture(scope="module")
def references(target, prompts):
    llm = open_llama(target.engine.path, n_ctx=2048)
    ids = [target.tokenizer(p)["input_ids"] for p in prompts]
    return [own_greedy(llm, i, TOKENS, target.eos_ids) for i in ids]


def test_every_drafts_kind_equals_the_engines_own_greedy_generation(drafter, target, prompts, references):
    """SmolLM2 on llama.cpp drafting for a Qwen GGUF on llama.cpp: model, retrieval and hybrid
    drafts, and the target decoding alone, all give llama.cpp's own greedy tokens, on the shortest
    prompt and the longest (the kinds share the engine's verify, which every prompt tests below)."""
    for prompt, reference in list(zip(prompts, references))[::3]:
        alone = list(target.begin(target.tokenizer(prompt)["input_ids"]).decode(TOKENS))
        assert alone == reference
        for drafts in ("model", "retrieval", "hybrid"):  # (objective "compute": every request speculates)
            out = drafter.pair(target, drafts=drafts, k=5, objective="compute").generate(
                prompt, max_new_tokens=TOKENS
            )
            assert out.token_ids == reference, drafts
            if drafts == "model":
                assert sum(r.accepted for r in out.rounds) > 0


def test_the_15b_on_llama_cpp_gives_its_own_greedy_output(drafter, prompts):
    """Qwen2.5-Coder-1.5B: its session decoding alone and the default pairing (model drafts) give
    llama.cpp's own greedy tokens on the shortest prompt and the longest."""
    target = od.LlamaCppTarget("qwen2.5-coder-1.5b", n_ctx=2048)
    llm = open_llama(target.engine.path, n_ctx=2048)
    for prompt in prompts[::3]:
        ids = target.tokenizer(prompt)["input_ids"]
        reference = own_greedy(llm, ids, TOKENS, target.eos_ids)
        assert list(target.begin(ids).decode(TOKENS)) == reference
        out = drafter.pair(target, k=5, objective="compute").generate(prompt, max_new_tokens=TOKENS)
        assert out.token_ids == reference and sum(r.accepted for r in out.rounds) > 0


def test_a_rejection_at_every_position_leaves_no_stale_kv(target, prompts, references):
    """A proposal wrong at position j (every j of every length): the cache then holds exactly the
    committed ids plus the proposal, no entry past them, and decoding goes on as the engine alone."""
    engine = target.engine
    ids = target.tokenizer(prompts[0])["input_ids"]
    reference = references[0]
    for m in range(1, 7):
        for j in range(m):
            session = target.begin(ids)
            good = reference[:m]
            proposal = good[:j] + [(good[j] + 1) % engine.n_vocab] + good[j + 1 :]
            verdict = session.verify(torch.tensor(proposal), Rule())
            assert (verdict.accepted, verdict.token) == (j, reference[j])
            assert engine.cached == ids + proposal
            assert llama_cpp.llama_memory_seq_pos_max(engine._memory, 0) == len(engine.cached) - 1
            rest = list(session.decode(4))
            assert session.ids == ids + reference[: j + 1 + len(rest)]
            assert llama_cpp.llama_memory_seq_pos_max(engine._memory, 0) == len(engine.cached) - 1


def test_interleaved_sessions_on_their_own_slots_pay_only_for_their_new_tokens(target, prompts, references):
    """A server's sessions take turns: with a KV slot each, a round evaluates only that session's
    new token, and each still gets the engine's own greedy output."""
    served = od.LlamaCppTarget(str(target.engine.path), tokenizer=target.tokenizer, n_ctx=2048, slots=2)
    sessions = [served.begin(served.tokenizer(p)["input_ids"]) for p in prompts[:2]]
    streams = [s.decode(12) for s in sessions]
    out = [[next(st)] for st in streams]  # both prompts evaluated once
    before = served.engine.decoded
    for _ in range(11):
        for stream, got in zip(streams, out):
            got.append(next(stream))
    assert out == [r[:12] for r in references[:2]]
    assert served.engine.decoded - before == 2 * 11


def test_the_draft_model_hook_gives_llama_cpp_python_cross_vocabulary_drafts(
    drafter, target, prompts, references
):
    """`Llama(..., draft_model=OmnidraftDraftModel(...))`: llama-cpp-python verifies omnidraft's
    translated drafts itself; the output is the engine's own greedy output."""
    hook = OmnidraftDraftModel(drafter, target, drafts="hybrid", k=4)
    llm = open_llama(target.engine.path, n_ctx=2048, draft_model=hook)
    for prompt, reference in zip(prompts, references):
        assert own_greedy(llm, target.tokenizer(prompt)["input_ids"], TOKENS, target.eos_ids) == reference
    assert hook.calls > 0 and hook.proposed > 0


def test_the_server_backend_serves_the_engines_greedy_output_and_keeps_its_guarantees(
    drafter, target, prompts, references
):
    from fastapi.testclient import TestClient

    from .test_server_hardening import BAD_BODIES, bad_body

    config = ServerConfig(api_key=KEY, max_sessions=2, ttl_s=600.0, max_tokens=4096)
    with TestClient(create_app(target, config)) as http:
        remote = RemoteTarget("http://testserver", api_key=KEY, client=http)
        assert remote.token_bytes.fingerprint == target.token_bytes.fingerprint
        pair = drafter.pair(remote, k=4)
        assert pair.generate(prompts[0], max_new_tokens=TOKENS).token_ids == references[0]
        ids = target.tokenizer(prompts[0])["input_ids"]
        sid = http.post("/v1/sessions", json={"prompt_ids": ids}, headers=AUTH).json()["session"]
        for body, reason in BAD_BODIES:
            r = http.post(
                f"/v1/sessions/{sid}/verify",
                content=bad_body(len(ids), body),
                headers={**AUTH, "content-type": "application/json"},
            )
            assert r.status_code == 422 and reason in r.text, (body, r.text)
        ok = http.post(
            f"/v1/sessions/{sid}/verify",
            json={"committed": len(ids), "proposal": references[0][:3]},
            headers=AUTH,
        )
        assert ok.status_code == 200 and ok.json()["accepted"] == 3
        stale = http.post(
            f"/v1/sessions/{sid}/verify", json={"committed": len(ids) + 1, "proposal": [5]}, headers=AUTH
        )
        assert stale.status_code == 409 and "stale" in stale.text
        outside = http.post(
            f"/v1/sessions/{sid}/verify", json={"committed": len(ids) + 4, "proposal": [10**7]}, headers=AUTH
        )
        assert outside.status_code == 422
        too_long = http.post("/v1/sessions", json={"prompt_ids": [ids[0]] * 3000}, headers=AUTH)
        assert too_long.status_code in (413, 422, 503), too_long.text
        other = http.post("/v1/sessions", json={"prompt_ids": ids}, headers=AUTH)
        full = http.post("/v1/sessions", json={"prompt_ids": ids}, headers=AUTH)
        assert other.status_code == 200 and full.status_code == 503
        for s in (sid, other.json()["session"]):
            assert http.delete(f"/v1/sessions/{s}", headers=AUTH).status_code == 200
        assert (
            http.post(
                f"/v1/sessions/{sid}/verify", json={"committed": len(ids) + 4, "proposal": []}, headers=AUTH
            ).status_code
            == 404
        )
        echoed = http.post(
            "/v1/completions",
            headers=AUTH,
            json={
                "prompt": ids,
                "max_tokens": 8,
                "temperature": 0,
                "echo": True,
                "logprobs": 2,
                "return_tokens_as_token_ids": True,
            },
        ).json()
        tokens = echoed["choices"][0]["logprobs"]["tokens"]
        assert [int(t.split(":")[1]) for t in tokens] == ids + references[0][:8]


def test_auto_picks_the_faster_drafter_backend_once_per_machine(tmp_path, monkeypatch):
    from omnidraft.llamacpp import drafting as llama_drafter
    from omnidraft.runtime import backends

    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(
        llama_drafter, "drafting_weights", lambda path, engine, weights, **_: path
    )  # timed elsewhere
    times = {"TorchDrafter": 9.0, "LlamaCppDrafter": 4.0}
    monkeypatch.setattr(backends, "draft_ms", lambda d, **_: times[type(d).__name__])
    assert isinstance(od.Drafter.load("smollm2-135m", backend="auto"), od.LlamaCppDrafter)
    (saved,) = tmp_path.joinpath("measured").glob("drafter-backends-*.json")
    assert json.loads(saved.read_text())["smollm2-135m"] == {"torch": 9.0, "llama.cpp": 4.0}
    monkeypatch.setattr(backends, "draft_ms", lambda d, **_: pytest.fail("timed twice"))
    assert isinstance(od.Drafter.load("smollm2-135m", backend="auto"), od.LlamaCppDrafter)


def test_a_drafter_runs_the_weights_that_draft_a_request_faster_here(tmp_path, monkeypatch):
    """A sub-8-bit GGUF file may read prompts slower than its Q8_0 requantization: "auto" times
    both once per machine and runs the faster; the requantized file is written once, atomically,
    and drafts stay lossless (the pairing's greedy output is the target's)."""
    from omnidraft.llamacpp import requant

    machine = os.environ.get(
        "OMNIDRAFT_CACHE"
    )  # the target and its measured costs come from the machine's cache
    target, tok = od.LocalTarget.load("qwen2.5-coder-0.5b"), load_tokenizer("smollm2-135m")
    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))
    shipped = gguf_path("smollm2-135m")
    q8 = od.LlamaCppDrafter("smollm2-135m", tokenizer=tok, weights="q8_0")
    (made,) = tmp_path.joinpath("gguf").glob("*.q8_0.gguf")
    assert q8.engine.path == made and requant.file_type(q8.engine.llm) == llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    assert not list(tmp_path.joinpath("gguf").glob("*.tmp*"))
    assert od.LlamaCppDrafter("smollm2-135m", tokenizer=tok, weights="shipped").engine.path == shipped
    for faster, expect in (("q8_0", made), ("shipped", shipped)):
        monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path / faster))
        monkeypatch.setattr(requant, "requantized", lambda path, threads=None: made)
        monkeypatch.setattr(
            requant,
            "request_ms",
            lambda engine, ids: {
                "read_ms": 1.0 if (engine.path == made) == (faster == "q8_0") else 3.0,
                "draft_ms": 8.0,
            },
        )
        assert od.LlamaCppDrafter("smollm2-135m", tokenizer=tok).engine.path == expect
        monkeypatch.setattr(requant, "request_ms", lambda *a: pytest.fail("timed twice"))
        assert od.LlamaCppDrafter("smollm2-135m", tokenizer=tok).engine.path == expect
    with pytest.raises(ValueError, match="weights must be one of"):
        od.LlamaCppDrafter("smollm2-135m", tokenizer=tok, weights="q4")
    if machine is None:
        monkeypatch.delenv("OMNIDRAFT_CACHE")
    else:
        monkeypatch.setenv("OMNIDRAFT_CACHE", machine)
    prompt = load_prompts("gsm8k", 1)[0]
    assert q8.pair(target, k=5).generate(prompt, max_new_tokens=24).token_ids == target_greedy(
        target, prompt, 24
    )


def test_the_llama_cpp_drafter_refuses_what_it_cannot_do(drafter, tmp_path):
    target = od.LocalTarget.load("qwen2.5-coder-0.5b")
    with pytest.raises(ValueError, match="cannot learn"):
        drafter.pair(target, learn=True)
    with pytest.raises(ValueError, match="hidden states"):
        drafter.pair(target, head=od.HeadConfig())
    with pytest.raises(ValueError, match="llama.cpp runs a preset"):
        gguf_file("Qwen/Qwen2.5-0.5B")
    with pytest.raises(FileNotFoundError):
        gguf_file(str(tmp_path / "missing.gguf"))


def test_without_llama_cpp_python_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(MissingDependencyError, match="make install"):
        od.LlamaCppTarget(str(gguf_path("smollm2-135m")))


def test_an_openai_target_on_llama_cpp_pythons_own_server_is_refused_or_identical(drafter, tmp_path):
    """`python -m llama_cpp.server`: the OpenAI-compatible target probes it at construction and
    either refuses with an error that names what is missing, or verifies to the engine's output."""
    import socket
    import subprocess
    import time

    import httpx

    from omnidraft.errors import IncompatibleError
    from omnidraft.targets.openai_client import OpenAICompletionsTarget

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = gguf_path("qwen2.5-coder-0.5b")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(path),
            "--n_ctx",
            "2048",
            "--logits_all",
            "true",
            "--n_threads",
            "2",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "server.log", "w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        else:
            pytest.fail(f"llama_cpp.server did not start: {(tmp_path / 'server.log').read_text()[-2000:]}")
        target = od.LlamaCppTarget("qwen2.5-coder-0.5b", n_ctx=2048)
        try:
            remote = OpenAICompletionsTarget(url, model=str(path), tokenizer=target.tokenizer, retries=0)
        except IncompatibleError as exc:
            assert "cannot verify drafts" in str(exc) or "echoed" in str(exc), exc
            return
        (prompt,) = load_prompts("gsm8k", 1)
        reference = list(target.begin(target.tokenizer(prompt)["input_ids"]).decode(24))
        assert drafter.pair(remote, k=4).generate(prompt, max_new_tokens=24).token_ids == reference
    finally:
        server.terminate()
        server.wait(timeout=30)
