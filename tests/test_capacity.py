"""The batched step check runs here on the CPU (a tiny shape), device_sim reads its JSON into a step
profile, and the capacity model behaves as its designs say: streaming alone is priced exactly,
drafts that are never right only cost, the capacity search finds the edge, and bad input names
itself."""

from __future__ import annotations

import json

import pytest

from benchmarks.step_profile import main as step_profile
from omnidraft.device_sim.__main__ import main as device_sim
from omnidraft.device_sim.capacity import StepProfile, capacity, load, read_step_profile
from omnidraft.device_sim.hardware import DeviceProfile

TINY = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
DEVICE = DeviceProfile(
    name="phone", source="test", drafter_ms=5.0, target_ms=(100.0,), prefill_ms_per_token=0.0
)
# a GPU-like step: flat in tokens per row, a little more per row
FLAT = StepProfile(
    name="flat",
    source="test",
    rows=(1, 8, 64),
    tokens=(1, 9),
    ms=((10.0, 11.0), (12.0, 14.0), (24.0, 32.0)),
    measured=False,
)


@pytest.fixture(scope="module")
def profile_json(tmp_path_factory):
    where = tmp_path_factory.mktemp("steps")
    (where / "tiny.json").write_text(json.dumps(TINY))
    out = where / "steps.json"
    step_profile(
        ["--device", "cpu", "--dtype", "float32", "--config", str(where / "tiny.json")]
        + [
            "--rows",
            "1",
            "2",
            "--tokens",
            "1",
            "3",
            "--contexts",
            "16",
            "32",
            "--reps",
            "2",
            "--out",
            str(out),
        ]
    )
    return out


def test_the_step_check_measures_every_row_and_token_count_at_every_context(profile_json):
    doc = json.loads(profile_json.read_text())
    assert doc["format"] == "omnidraft-step-profile" and doc["version"] == 1
    table = doc["models"]["tiny"]["contexts"]
    assert set(table) == {"16", "32"}
    assert all(set(table[c]) == {"1", "2"} and set(table[c]["2"]) == {"1", "3"} for c in table)
    profile = read_step_profile(profile_json, context=32)
    assert profile.rows == (1, 2) and profile.tokens == (1, 3) and profile.measured
    assert profile.cost(2, 6) == pytest.approx(table["32"]["2"]["3"])


def test_a_step_profile_of_another_format_or_context_is_refused_by_name(profile_json, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "omnidraft-gpu-check", "version": 1}))
    with pytest.raises(ValueError, match="not a step profile of version 1 .*benchmarks.step_profile"):
        read_step_profile(bad)
    with pytest.raises(ValueError, match="not measured at context 64; measured: 16, 32"):
        read_step_profile(profile_json, context=64)


def test_cost_interpolates_between_measured_points_and_extrapolates_past_them():
    assert FLAT.cost(1, 1) == 10.0 and FLAT.cost(8, 72) == 14.0
    assert FLAT.cost(1, 5) == pytest.approx(10.5)  # halfway in tokens per row
    assert FLAT.cost(36, 36) == pytest.approx(18.0)  # halfway in rows
    assert FLAT.cost(120, 120) == pytest.approx(24.0 + 12.0 * 56 / 56)  # the last slope in rows


def test_streaming_alone_is_priced_exactly_and_useless_drafts_only_cost():
    alone = load("alone", FLAT, DEVICE, 8)
    assert alone.p50_ms == alone.p95_ms == 12.0 and alone.server_tok_s == pytest.approx(8000 / 12)
    never = load("streaming", FLAT, DEVICE, 8, acceptance=0.0, rtt_ms=20)
    assert never.p50_ms >= 12.0 * 0.99  # a wrong draft never commits more than a step alone
    good = load("streaming", FLAT, DEVICE, 8, acceptance=0.9, rtt_ms=20)
    assert good.p50_ms < alone.p50_ms  # right drafts at a flat step: fewer steps a token
    ngram = load("server-ngram", FLAT, DEVICE, 8, ngram_found=1.0, ngram_acceptance=1.0)
    assert ngram.p95_ms < alone.p95_ms / 2


def test_the_capacity_search_finds_the_largest_count_within_the_target():
    at = lambda n: load("alone", FLAT, DEVICE, n)  # noqa: E731 - 10 ms at 1 row, 24 at 64, linear between
    n, where = capacity(at, target_ms=18.0)
    assert n == 36 and where is not None and where.p95_ms <= 18.0 and at(37).p95_ms > 18.0
    assert capacity(at, target_ms=5.0) == (0, None)
    assert load("round-trip", FLAT, DEVICE, 4, rtt_ms=100).p50_ms > 100 / 4  # a round trip a round


def test_the_command_prints_a_capacity_row_per_design(profile_json, capsys, tmp_path):
    device_sim(
        ["capacity", "--steps", str(profile_json), "--device", "phone-npu-what-if", "--rtt", "20"]
        + ["--target-ms", "1000", "--acceptance", "0.6", "--tokens", "16", "--json", str(tmp_path / "c.json")]
    )
    out = capsys.readouterr().out
    assert "(measured)" in out and all(design in out for design in ("alone", "streaming", "round-trip"))
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["capacity"] >= 1 for r in rows)
    with pytest.raises(SystemExit, match="give --acceptance or --trace"):
        device_sim(["capacity", "--steps", str(profile_json), "--device", "phone-npu-what-if", "--rtt", "20"])


def test_a_prompt_read_in_pieces_is_priced_in_the_servers_steps():
    """With `prompt`, each request's prompt is read `chunk` tokens a step and its first token comes
    with the last piece: alone on one row, 3 pieces then 3 more steps for 4 tokens."""
    from omnidraft.device_sim.streaming import simulate_streaming

    server = DeviceProfile(
        name="s", source="t", drafter_ms=0.0, target_ms=(10.0, 20.0), prefill_ms_per_token=0.0
    )
    r = simulate_streaming(server, DEVICE, rtt_ms=0, acceptance=0.0, budget=0, tokens=4, prompt=5, chunk=2)
    # pieces of 2, 2, 1 tokens: 20 + 20 + 10 ms, the last giving the first token; then 3 steps of 10
    assert r.device_ms_per_token == (pytest.approx(80.0 / 4),)


def test_the_check_against_a_bench_prices_each_measured_row(tmp_path, capsys):
    """`capacity-check` reads `omnidraft bench --remote`'s JSON and prints, per row, the model's
    server tokens/s and median request seconds a token beside the measured ones."""
    rows = [
        {"rtt_ms": 50.0, "devices": n, "row": row, "requests": 4, "tokens": 256, "tok_s": tok_s}
        | {"ttft_s": 0.5, "request_s_per_token_p50": s}
        for n, row, tok_s, s in [(1, "server alone", 5.0, 0.2), (2, "device drafting", 9.0, 0.21)]
    ]
    (tmp_path / "bench.json").write_text(json.dumps(rows))
    profile = "this-machine:vllm-1cpu:qwen2.5-coder-0.5b"
    argv = ["--server", profile, "--device", profile, "--acceptance", "0.76", "--seeds", "2"]
    device_sim(["capacity-check", str(tmp_path / "bench.json"), *argv])
    out = capsys.readouterr().out
    assert out.count("| 50 |") == 2 and "largest error" in out
    from omnidraft.device_sim.capacity import against_bench
    from omnidraft.device_sim.hardware import load_profiles

    vllm = load_profiles().devices[profile]
    (alone, drafting) = against_bench(rows, vllm, vllm, acceptance=0.76, seeds=2)
    # alone: the row's 0.5 s to the first token added, then 64 steps of one token each at 156 ms
    assert alone["predicted_s_per_token_p50"] == pytest.approx((0.5 + 64 * 0.156) / 64, rel=0.02)
    assert alone["error_tok_s"] == pytest.approx(alone["predicted_tok_s"] / 5.0 - 1, abs=1e-3)
    assert drafting["devices"] == 2 and drafting["predicted_tok_s"] > 0
    with pytest.raises(SystemExit, match="not the JSON of `omnidraft bench --remote`"):
        (tmp_path / "bad.json").write_text('[{"row": "server alone"}]')
        device_sim(["capacity-check", str(tmp_path / "bad.json"), *argv])


def test_the_vllm_engines_own_measured_costs_make_a_step_profile(tmp_path, monkeypatch):
    """`step_profile --from-vllm MODEL` turns what a vLLM server measured on this machine (verify
    costs on one row, steps of 16 rows) into a profile the capacity model reads."""
    import torch

    from benchmarks.step_profile import from_vllm_measurements
    from omnidraft.runtime import measured

    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        measured.update("vllm-verify-costs", {"m|args": {str(t): 0.1 + 0.001 * t for t in range(1, 9)}})
        measured.update("vllm-batch-costs", {"m|args|True": {"16": 0.2, "64": 0.6, "128": 1.0}})
        doc = from_vllm_measurements("m")
    finally:
        torch.set_num_threads(threads)
    (tmp_path / "p.json").write_text(json.dumps(doc))
    profile = read_step_profile(tmp_path / "p.json")
    assert profile.rows == (1, 16) and profile.tokens == (1, 4, 8)
    assert profile.cost(1, 4) == pytest.approx(104.0) and profile.cost(16, 64) == pytest.approx(600.0)
    with pytest.raises(SystemExit, match="no vllm-verify-costs measured for other"):
        from_vllm_measurements("other")


def test_a_run_replayed_request_by_request_sends_each_devices_share_in_turn():
    """With `requests`, device d sends requests d, d + devices, ... one after another: alone on a
    server whose step costs 10 ms, RTT 100 ms, two requests of 3 and 5 tokens from one device, each
    prompt read in 0.3 s: the first is heard at 0.05 + 0.3 + 2 steps + 0.05 = 0.42 s, the second
    sent then and heard 0.44 s later."""
    from omnidraft.device_sim.streaming import simulate_streaming

    server = DeviceProfile(name="s", source="t", drafter_ms=0.0, target_ms=(10.0,), prefill_ms_per_token=0.0)
    steps = lambda rows, tokens: 10.0  # noqa: E731 - a flat step
    one = simulate_streaming(
        server, DEVICE, step_ms=steps, rtt_ms=100, acceptance=0.0, budget=0, requests=((3, 0.3), (5, 0.3))
    )
    assert one.device_ms_per_token == (pytest.approx(420 / 3), pytest.approx(440 / 5))
    assert one.server_tok_s == pytest.approx(8 / 0.86)
    # two devices: both prompts read in turn (every row waits), then their rows share each step
    two = simulate_streaming(
        server,
        DEVICE,
        step_ms=steps,
        rtt_ms=100,
        devices=2,
        acceptance=0.0,
        budget=0,
        requests=((3, 0.3), (5, 0.3)),
    )
    assert two.device_ms_per_token == (pytest.approx(720 / 3), pytest.approx(740 / 5))
    assert two.server_tok_s == pytest.approx(8 / 0.74)
    # drafts that are always right need fewer steps, never more
    right = simulate_streaming(
        server, DEVICE, step_ms=steps, rtt_ms=100, acceptance=1.0, budget=4, requests=((3, 0.3), (5, 0.3))
    )
    assert right.server_tok_s >= one.server_tok_s
    with pytest.raises(ValueError, match="every request needs tokens"):
        simulate_streaming(server, DEVICE, rtt_ms=1, requests=((0, 0.1),))


def test_the_check_replays_a_bench_request_by_request_and_fits_the_acceptance_to_one_row(capsys, tmp_path):
    """Rows that list their requests are replayed one by one: each prompt read in its one-device
    time to first token less the round trip (2 devices: both reads queue, then both decode); with
    no --acceptance it is fitted to the one-device drafting row, which the model then meets."""
    from omnidraft.device_sim.capacity import against_bench, fit_acceptance
    from omnidraft.device_sim.hardware import load_profiles

    def row(n: int, name: str, tok_s: float, ttfts: list[float]) -> dict:
        head = {"rtt_ms": 50.0, "devices": n, "row": name, "requests": 2, "tokens": 64, "tok_s": tok_s}
        return head | {"request_s_per_token_p50": 0.2, "request_tokens": [32, 32], "request_ttft_s": ttfts}

    rows = [
        row(1, "server alone", 5.0, [0.55, 0.45]),
        row(1, "device drafting", 9.0, [0.55, 0.45]),
        row(2, "server alone", 9.0, [0.6, 1.0]),
    ]
    profile = "this-machine:vllm-1cpu:qwen2.5-coder-0.5b"
    vllm = load_profiles().devices[profile]
    alone, _, two = against_bench(rows, vllm, vllm, acceptance=0.5, seeds=1)
    step = vllm.target_cost(1) / 1000
    # one device: sent, 25 ms to the server, its read (0.5 s), 31 steps, 25 ms back; then the next
    first, second = 0.05 + 0.5 + 31 * step, 0.05 + 0.4 + 31 * step
    assert alone["predicted_tok_s"] == pytest.approx(64 / (first + second), abs=1e-3)
    assert alone["predicted_s_per_token_p50"] == pytest.approx((first + second) / 2 / 32, abs=1e-3)
    # two devices: the reads take turns (0.5 then 0.4 s), then both rows decode in shared steps
    both = vllm.target_cost(2) / 1000
    assert two["predicted_tok_s"] == pytest.approx(64 / (0.05 + 0.9 + 31 * both), abs=1e-3)
    fitted = fit_acceptance(rows, vllm, vllm, seeds=1)
    (met,) = [
        e
        for e in against_bench(rows, vllm, vllm, acceptance=fitted, seeds=1)
        if e["row"] == "device drafting"
    ]
    assert 0 < fitted < 1 and abs(met["error_tok_s"]) < 0.05  # (one seed: its rate moves in steps)
    (tmp_path / "bench.json").write_text(json.dumps(rows))
    device_sim(
        [
            "capacity-check",
            str(tmp_path / "bench.json"),
            "--server",
            profile,
            "--device",
            profile,
            "--seeds",
            "1",
        ]
    )
    assert f"acceptance {fitted} a token: fitted to the one-device drafting row" in capsys.readouterr().out


def test_the_servers_own_budget_shrinks_with_its_rows_as_the_server_computes_it():
    """`server_costs`: each step takes from a row the draft budget the server computes
    (server/budget.py) for the step's rows: on a compute-bound server (a step costs what one
    sequence of all its tokens costs, past one row's 4) one row drafts 3 (4 tokens a step), four rows
    draft nothing, exactly as the server alone; the device drafts ahead by what the server last said."""
    from omnidraft.device_sim.streaming import FIRST_BUDGET, simulate_streaming
    from omnidraft.server.budget import draft_budget
    from omnidraft.targets.remote_stream import FIRST_BUDGET as DEVICES_FIRST

    assert FIRST_BUDGET == DEVICES_FIRST
    bound = StepProfile(
        name="bound",
        source="test",
        rows=(1, 16),
        tokens=(1, 4, 8),
        ms=((100.0, 105.0, 400.0), (1600.0, 6400.0, 12800.0)),
    )
    costs = bound.server_costs()
    assert costs[:3] == ((1, 0.1), (4, 0.105), (8, 0.4)) and dict(costs)[64] == 6.4
    assert draft_budget(dict(costs), 0.8, 1, 8) == 3 and draft_budget(dict(costs), 0.8, 4, 8) == 0
    server = DeviceProfile(name="s", source="t", drafter_ms=0.0, target_ms=(100.0,), prefill_ms_per_token=0.0)
    run = lambda devices, **kw: simulate_streaming(  # noqa: E731
        server, DEVICE, step_ms=bound.cost, rtt_ms=50, devices=devices, acceptance=0.8, tokens=64, **kw
    )
    four_alone = run(4, budget=0)
    four = run(4, budget=8, server_costs=costs)
    assert four.server_tok_s == pytest.approx(four_alone.server_tok_s)  # the server hands them over
    assert run(1, budget=8, server_costs=costs).server_tok_s > run(1, budget=0).server_tok_s
    with pytest.raises(ValueError, match="a server's budget needs one row"):
        StepProfile(name="x", source="t", rows=(2,), tokens=(1,), ms=((1.0,),)).server_costs()
