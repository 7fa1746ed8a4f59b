"""OpenVINO as a target (omnidraft/targets/openvino_target.py): a tiny model exported in the test by
optimum-intel (in the venv `make` builds, .venv-openvino), then verified by OpenVINO's CPU plugin.
The promise tested: greedy output token-identical to OpenVINO decoding one token at a time, with
proposals accepted in full, cut, or rejected outright; the rows a verify reads equal one-row steps.
The real tier exports the shipped 0.5B (int8) and pairs SmolLM2 with it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import omnidraft as od
from omnidraft.errors import MissingDependencyError
from omnidraft.export.openvino import export_openvino, exported, openvino_python

from .conftest import gsm8k_texts, tiny_llama
from .fakes import OracleDrafter

OPENVINO = os.environ.get("OMNIDRAFT_OPENVINO_PYTHON") or str(
    Path(__file__).resolve().parents[1] / ".venv-openvino" / "bin" / "python"
)
PROMPTS = [t[:80] for t in gsm8k_texts("test", 4)] + ["def add(a, b):\n    return"]


@pytest.fixture(scope="module")
def ov_target(target_tokenizer, tmp_path_factory):
    src, out = tmp_path_factory.mktemp("tiny-hf"), tmp_path_factory.mktemp("tiny-ov") / "ir"
    model = tiny_llama(len(target_tokenizer), seed=1, logit_scale=30.0)
    model.generation_config.eos_token_id = 0
    model.save_pretrained(src)
    target_tokenizer.save_pretrained(src)
    export_openvino(src, out, weights="int8", python=openvino_python(OPENVINO))
    return od.OpenVINOTarget(out, tokenizer=target_tokenizer, name="tiny-ov")


def alone(target, prompt: str, n: int) -> list[int]:
    session = target.begin(target.tokenizer(prompt)["input_ids"])
    try:
        return list(session.decode(n))
    finally:
        session.close()


def test_the_engines_verify_rows_are_its_one_token_steps(ov_target):
    """What exactness rests on: the margin measured on this machine, and the rows of a verify of
    several tokens against the same positions decoded one at a time."""
    assert ov_target.margin >= 0.0  # 0 on this CPU with a bf16 KV cache: no position is re-checked
    ids = ov_target.tokenizer(PROMPTS[0])["input_ids"]
    ref = alone(ov_target, PROMPTS[0], 12)
    engine = ov_target.engine
    engine.claim(object())
    rows = [engine.forward(ids, 1)[0]]
    for token in ref[:-1]:
        rows.append(engine.forward([token], 1)[0])
    engine.trim(len(ids))  # keep the prompt: a verify never feeds a prompt token again
    got = engine.forward(ref[:9], 9)
    difference = float(np.abs(got - np.stack(rows[1:10])).max())
    assert difference == 0.0 if ov_target.margin == 0.0 else difference < ov_target.margin
    engine.owner = None


@pytest.mark.parametrize("wrong_at", [None, 0, 2])
def test_greedy_output_is_the_engines_own_one_token_at_a_time(ov_target, wrong_at):
    for prompt in PROMPTS:
        ref = alone(ov_target, prompt, 24)
        drafter = OracleDrafter(ov_target, ref, **({} if wrong_at is None else {"wrong_at": wrong_at}))
        config = od.DecodeConfig(k=5, strategy="ngram", drafts="model", objective="compute")
        out = od.Pairing(drafter, ov_target, config).generate(prompt, max_new_tokens=24)
        assert out.token_ids == ref, prompt
        if wrong_at is None:
            assert out.stats.acceptance_rate == 1.0


def test_positions_within_the_margin_are_decided_by_a_one_row_step_and_stay_exact(ov_target, monkeypatch):
    """Where a CPU's verify rows are not bit-exact, the first close row is decided again by a
    one-row step. Here every row is made close, so every round takes that path (a first call's
    row 0, the prompt's own, excepted)."""
    monkeypatch.setattr(ov_target, "margin", float("inf"))
    for prompt in PROMPTS:
        ref = alone(ov_target, prompt, 24)
        config = od.DecodeConfig(k=5, strategy="ngram", drafts="model", objective="compute")
        out = od.Pairing(OracleDrafter(ov_target, ref), ov_target, config).generate(prompt, max_new_tokens=24)
        assert out.token_ids == ref, prompt
        assert max(r.accepted for r in out.rounds) <= 1  # the round ends at its first re-checked row


def test_a_model_of_another_vocabulary_drafts_and_the_output_stays_the_engines(ov_target, tiny_drafter):
    pair = tiny_drafter.pair(ov_target, k=4, objective="compute")
    for prompt in PROMPTS:
        assert pair.generate(prompt, max_new_tokens=24).token_ids == alone(ov_target, prompt, 24), prompt
    default = tiny_drafter.pair(ov_target)  # the default objective: the floor may stand aside
    assert default.generate(PROMPTS[1], max_new_tokens=24).token_ids == alone(ov_target, PROMPTS[1], 24)


def test_drafting_beside_the_verifies_stays_the_engines_own_output(ov_target, tiny_drafter, monkeypatch):
    """decode/overlap.py: the target given one thread verifies on a worker while the drafter drafts
    on; every output equals the engine decoding alone, and the requests went that way."""
    from omnidraft.decode import overlap

    one = od.OpenVINOTarget(ov_target.engine.path, tokenizer=ov_target.tokenizer, threads=1, name="tiny-ov-1")
    assert one.capabilities.verifies_beside == 1
    monkeypatch.setattr(tiny_drafter, "drafts_beside", True, raising=False)
    threads: list = []
    monkeypatch.setattr(tiny_drafter, "use_threads", threads.append, raising=False)
    monkeypatch.setattr(overlap, "cpu_threads", lambda: 2)
    pair = tiny_drafter.pair(one, k=4, objective="compute", overlap=True)
    for prompt in PROMPTS:
        out = pair.generate(prompt, max_new_tokens=24)
        assert out.token_ids == alone(one, prompt, 24), prompt
    assert threads[:2] == [1, None]  # drafting on the core the target left, then as loaded
    assert sum(r.accepted for r in out.rounds) > 0
    sequential = tiny_drafter.pair(one, k=4, objective="compute")  # (off by default)
    before = len(threads)
    assert sequential.generate(PROMPTS[0], max_new_tokens=8).token_ids == alone(one, PROMPTS[0], 8)
    assert len(threads) == before


def test_a_proposal_is_left_after_the_ids_that_follow_it():
    from omnidraft.decode.overlap import _left

    assert _left([5, 6, 7], 2, [1, 2]) == [5, 6, 7]
    assert _left([5, 6, 7], 2, [1, 2, 5, 6]) == [7]
    assert _left([5, 6, 7], 2, [1, 2, 5, 9]) is None  # the target's token left it
    assert _left([5, 6], 2, [1, 2, 5, 6, 8]) is None  # used up


def test_two_sessions_take_turns_on_the_engines_state(ov_target):
    a, b = (ov_target.begin(ov_target.tokenizer(p)["input_ids"]) for p in PROMPTS[:2])
    got_a, got_b = [], []
    decode_a, decode_b = a.decode(10), b.decode(10)
    for _ in range(10):  # each step finds the other session's sequence in the state and re-reads
        got_a.append(next(decode_a))
        got_b.append(next(decode_b))
    assert got_a == alone(ov_target, PROMPTS[0], 10)
    assert got_b[:1] == alone(ov_target, PROMPTS[1], 1)


def test_costs_are_measured_once_and_a_verify_of_a_few_costs_little_more_than_a_step(ov_target):
    costs = ov_target.verify_costs()
    assert sorted(costs) == list(range(1, 10)) and all(c > 0 for c in costs.values())
    assert ov_target.verify_costs() == costs  # remembered (runtime/measured.py)


def test_the_engine_is_registered_and_bad_paths_and_missing_exporters_are_named(tmp_path, monkeypatch):
    from omnidraft.targets.registry import engine_names

    assert "openvino" in engine_names()
    with pytest.raises(FileNotFoundError, match="no OpenVINO model"):
        od.OpenVINOTarget(tmp_path)
    monkeypatch.delenv("OMNIDRAFT_OPENVINO_PYTHON", raising=False)
    with pytest.raises(MissingDependencyError, match="optimum-intel"):
        openvino_python()
    with pytest.raises(MissingDependencyError, match="no Python at"):
        openvino_python(str(tmp_path / "python"))
    with pytest.raises(ValueError, match="weights must be one of"):
        export_openvino(tmp_path, tmp_path / "out", weights="int3", python=OPENVINO)


@pytest.mark.real
def test_the_shipped_05b_exported_once_pairs_with_smollm2_and_stays_identical(monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_OPENVINO_PYTHON", OPENVINO)
    path = exported("qwen2.5-coder-0.5b")
    assert exported("qwen2.5-coder-0.5b") == path  # once, then found in the cache
    target = od.OpenVINOTarget.load("qwen2.5-coder-0.5b")
    pair = od.Drafter.load("smollm2-135m").pair(target)
    for prompt in ["def fibonacci(n):", gsm8k_texts("test", 1)[0][:200]]:
        assert pair.generate(prompt, max_new_tokens=48).token_ids == alone(target, prompt, 48), prompt


def test_a_server_on_openvino_runs_a_devices_stream_in_its_own_step_loop(
    ov_target, tiny_drafter, monkeypatch
):
    """`omnidraft serve` on OpenVINO serves `/speculate` (server/device_proposals.py `step_loop`):
    the device drafts, each server step verifies its newest proposal; every output is the engine's,
    with proposals accepted in full and rejected. Where a verify costs several steps the server
    takes no draft and decodes alone; at costs like the shipped models'
    (a verify of a few about a step) it takes them. The server waits for each draft here (timing
    apart: docs/remote.md measures it)."""
    import httpx

    from omnidraft.bench.remote import serve_in_thread
    from omnidraft.server.app import ServerConfig, create_app
    from omnidraft.targets.remote import RemoteTarget

    def served(drafter_for) -> dict[str, float]:
        config = ServerConfig(api_key="k", proposal_wait_s=0.5)  # (a step waits for this device's draft)
        url, stop = serve_in_thread(create_app(ov_target, config))
        try:
            remote = RemoteTarget(url, api_key="k", tokenizer=ov_target.tokenizer)
            assert remote.capabilities.drafts_in_engine  # the server says its own step loop takes drafts
            for prompt in PROMPTS[:3]:
                ref = alone(ov_target, prompt, 24)
                config = od.DecodeConfig(k=5, strategy="ngram", drafts="model")
                out = od.Pairing(drafter_for(ref), remote, config).generate(prompt, max_new_tokens=24)
                assert out.token_ids == ref, prompt
                assert out.stats.served == "engine"
            remote.close()
            metrics = httpx.get(url + "/metrics", headers={"authorization": "Bearer k"}).text
        finally:
            stop()
        return {
            k: float(v) for k, v in (line.split(" ", 1) for line in metrics.splitlines() if line[:1] != "#")
        }

    def oracle(ref: list[int]) -> OracleDrafter:
        return OracleDrafter(ov_target, ref)

    steep = {1: 2.0, 2: 4.0, 4: 8.0, 8: 16.0}  # (declared: the tiny model's own curve is flat on some hosts)
    monkeypatch.setattr(ov_target, "verify_costs", lambda context=None: steep)
    assert served(oracle)["omnidraft_accepted_tokens_total"] == 0  # drafts cannot pay here: none taken
    flat = {1: 2.0, 2: 2.0, 4: 2.1, 8: 2.2}  # (slow enough that a step waits for the device)
    monkeypatch.setattr(ov_target, "verify_costs", lambda context=None: flat)
    counters = served(oracle)
    assert counters["omnidraft_accepted_tokens_total"] > 24  # its steps verified the device's drafts
    assert 0 < counters["omnidraft_engine_steps_total"] < 24
    wrong = served(lambda ref: OracleDrafter(ov_target, ref, wrong_at=2))  # every draft's third is wrong
    assert wrong["omnidraft_accepted_tokens_total"] > 0  # (how many: timing, on a loaded machine)
