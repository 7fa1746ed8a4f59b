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
