"""device_sim: exact replay arithmetic, trace validation, and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from omnidraft.device_sim import DeviceProfile, NetworkProfile, Scenario, read_trace, simulate, sweep_k
from omnidraft.device_sim.simulate import acceptance_per_position

DEVICE = DeviceProfile(
    name="paper",
    source="hand-built",
    drafter_ms=10.0,
    target_ms=(100.0, 120.0, 130.0, 140.0),
    prefill_ms_per_token=2.0,
    bookkeeping_ms_per_round=1.0,
)
ROUND = dict(from_cache=0, t_draft=0.01, t_translate=0.0, t_verify=0.1, t_resync=0.0)


def _trace(tmp_path, rounds):
    path = tmp_path / "t.jsonl"
    lines = [json.dumps({"trace": "omnidraft", "version": 1})] + [json.dumps({**ROUND, **r}) for r in rounds]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_replay_is_the_arithmetic_on_paper(tmp_path):
    path = _trace(
        tmp_path,
        [
            dict(context=11, drafted=3, proposed=3, accepted=3, emitted=4),
            dict(context=15, drafted=3, proposed=2, accepted=0, emitted=1),
        ],
    )
    r = simulate(read_trace(path), Scenario(device=DEVICE))
    # round 1: draft 3*10 + prefill 2*10 + forward of 4 tokens 140 + bookkeeping 1 = 191 ms
    # round 2: draft 3*10 + forward of 3 tokens 130 + bookkeeping 1 = 161 ms
    assert r.seconds == pytest.approx(0.352) and r.ttft_s == pytest.approx(0.191) and r.tokens == 5
    # target alone: prefill 2*10 + first forward 100, then 4 more tokens at 100 ms = 520 ms
    assert r.baseline_seconds == pytest.approx(0.520) and r.speedup == pytest.approx(0.520 / 0.352)


def test_remote_placement_adds_one_exchange_per_round(tmp_path):
    path = _trace(tmp_path, [dict(context=1, drafted=2, proposed=2, accepted=2, emitted=3)])
    net = NetworkProfile(
        name="n", source="hand-built", rtt_ms=50.0, bandwidth_mbps=8.0, loss=0.0, overhead_bytes=0
    )
    r = simulate(
        read_trace(path), Scenario(device=DEVICE, server=DEVICE, network=net, id_bytes=4, reply_bytes=16)
    )
    # up = 4*(2 + 1) = 12 bytes, down 16: (12+16)*8 bits / 8000 bits per ms = 0.028 ms
    # draft 2*10 + forward of 3 tokens 130 + bookkeeping 1 + exchange 50.028 (no prefill: a 1-token prompt)
    assert r.seconds * 1000 == pytest.approx(20 + 130 + 1 + 50.028)
    assert r.bytes_sent == 12


def test_the_remote_baseline_is_one_streamed_completion_not_a_round_trip_per_token(tmp_path):
    path = _trace(
        tmp_path,
        [
            dict(context=11, drafted=3, proposed=3, accepted=3, emitted=4),
            dict(context=15, drafted=3, proposed=2, accepted=0, emitted=1),
        ],
    )
    net = NetworkProfile(
        name="n", source="hand-built", rtt_ms=50.0, bandwidth_mbps=1e9, loss=0.0, overhead_bytes=0
    )
    r = simulate(
        read_trace(path), Scenario(device=DEVICE, server=DEVICE, network=net, id_bytes=4, reply_bytes=16)
    )
    # the server alone: one exchange (50 ms) + prefill 2*10 + 5 tokens at 100 ms = 570 ms; 11 prompt ids sent
    assert r.baseline_seconds * 1000 == pytest.approx(570.0, abs=0.01) and r.baseline_bytes_sent == 44
    # speculating: 191 + 161 ms of compute plus one 50 ms exchange per round = 452 ms, 2 forwards for 5 tokens
    assert r.seconds * 1000 == pytest.approx(452.0, abs=0.01) and r.forwards_per_token == pytest.approx(0.4)
    assert r.speculation_pays
    slow = simulate(
        read_trace(path),
        Scenario(
            device=DEVICE,
            server=DEVICE,
            id_bytes=4,
            reply_bytes=16,
            network=NetworkProfile(name="far", source="x", rtt_ms=400.0, overhead_bytes=0),
        ),
    )
    assert not slow.speculation_pays  # at 400 ms a round trip per round loses to one streamed request


def test_loss_costs_expected_resends():
    net = NetworkProfile(name="n", source="x", rtt_ms=100, loss=0.5, bandwidth_mbps=1e9, overhead_bytes=0)
    assert net.exchange_ms(0, 0) == pytest.approx(200.0)


def test_sweep_uses_the_fitted_acceptance(tmp_path):
    path = _trace(
        tmp_path, [dict(context=5, drafted=4, proposed=4, accepted=a, emitted=a + 1) for a in (4, 2, 3, 0)]
    )
    runs = read_trace(path)
    alpha = acceptance_per_position(runs)
    assert alpha == pytest.approx(9 / (9 + 3))
    rows = sweep_k(runs, Scenario(device=DEVICE), range(1, 5))
    assert rows[0][1] == pytest.approx(1 + alpha)


@pytest.mark.parametrize(
    "bad, line", [('{"context": 1}', 2), ("not json", 2), ('{"trace": "omnidraft"}\n{"context": 1, "dr', 3)]
)
def test_malformed_or_truncated_traces_name_the_line(tmp_path, bad, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"trace": "omnidraft", "version": 1}\n' + bad)
    with pytest.raises(ValueError, match=f"bad.jsonl:{line}:"):
        read_trace(path)


def test_profiles_check_their_numbers():
    with pytest.raises(ValueError, match="target_ms"):
        DeviceProfile(name="x", source="y", drafter_ms=1, target_ms=(), prefill_ms_per_token=0)
    with pytest.raises(ValueError, match="loss"):
        NetworkProfile(name="x", source="y", loss=1.5)


def test_device_sim_imports_no_torch():
    code = (
        "import omnidraft.device_sim, omnidraft.device_sim.__main__, sys; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_traces_that_mix_sources_charge_the_drafter_for_drafted_tokens_only(tmp_path):
    path = _trace(
        tmp_path,
        [
            dict(context=11, drafted=0, proposed=3, accepted=3, emitted=4, retrieved=3, retrieved_accepted=3),
            dict(context=15, drafted=2, proposed=4, accepted=1, emitted=2, retrieved=2, retrieved_accepted=0),
        ],
    )
    r = simulate(read_trace(path), Scenario(device=DEVICE))
    # round 1: no drafting + prefill 2*10 + forward of 4 tokens 140 + bookkeeping 1 = 161 ms
    # round 2: draft 2*10 + forward of 5 tokens (140 + 10) + bookkeeping 1 = 171 ms
    assert r.seconds == pytest.approx(0.332) and r.tokens == 6
    (k2,) = [row for row in sweep_k(read_trace(path), Scenario(device=DEVICE), range(2, 3))]
    assert k2[0] == 2  # model part: 2 target tokens from 2 drafted, so k = 2 proposes 2


def test_the_streaming_simulation_bounds_and_the_round_trip():
    """device_sim/streaming.py: wrong guesses never cost a step per token less than decoding alone
    and never commit more than one token a step; right guesses commit several a step; a longer round
    trip never helps; a measured time to first token slows both modes alike."""
    from omnidraft.device_sim.streaming import simulate_streaming

    costs = tuple(150.0 + 5 * n for n in range(16))
    server = DeviceProfile(name="s", source="t", drafter_ms=1.0, target_ms=costs, prefill_ms_per_token=0.4)
    device = DeviceProfile(
        name="d", source="t", drafter_ms=10.0, target_ms=(100.0,), prefill_ms_per_token=0.4
    )
    wrong = simulate_streaming(server, device, rtt_ms=50, acceptance=0.0, tokens=64)
    assert wrong.steps_per_token == 1.0 and wrong.speedup <= 1.0
    speedups = [
        simulate_streaming(server, device, rtt_ms=rtt, acceptance=0.8, tokens=64, seed=1).speedup
        for rtt in (0, 50, 200, 600)
    ]
    assert speedups[0] > 1.5 and all(a >= b for a, b in zip(speedups, speedups[1:]))
    right = simulate_streaming(
        server, device, rtt_ms=0, acceptance=1.0, tokens=64, devices=4, shared_cpu=True
    )
    assert right.steps_per_token < 0.25
    base = simulate_streaming(server, device, rtt_ms=50, acceptance=0.8, tokens=64)
    slow = simulate_streaming(server, device, rtt_ms=50, acceptance=0.8, tokens=64, ttft_s=2.0)
    assert slow.device_tok_s < base.device_tok_s and slow.alone_tok_s < base.alone_tok_s
    assert base.alone_tok_s == pytest.approx(1000 / 150)
    with pytest.raises(ValueError, match="ttft_s"):
        simulate_streaming(server, device, rtt_ms=50, ttft_s=-1)


def test_the_stream_command_prints_its_table(capsys):
    from omnidraft.device_sim.__main__ import main

    main(
        ["stream", "--server", "this-machine:vllm-1cpu:qwen2.5-coder-0.5b", "--device",
         "this-machine:vllm-1cpu:qwen2.5-coder-0.5b", "--rtt", "50", "--acceptance", "0.7",
         "--tokens", "32", "--seeds", "2", "--ttft", "1.5"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "speedup" in out and out.strip().splitlines()[-1].split()[0] == "50"
