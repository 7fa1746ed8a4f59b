"""The prepared GPU check runs here on the CPU (the 0.5B shape cut to 2 layers, small contexts;
the static-cache runner runs eagerly here, with graphs on a GPU), and device_sim turns its JSON
into a server profile, refusing one of another version."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu_check import main as gpu_check
from omnidraft.device_sim.gpu import profiles_from_check
from omnidraft.device_sim.hardware import load_profiles


@pytest.fixture(scope="module")
def check_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "check.json"
    gpu_check(
        [
            "--device",
            "cpu",
            "--dtype",
            "bfloat16",
            "--models",
            "qwen2.5-0.5b",
            "--layers",
            "2",
            "--contexts",
            "16",
            "32",
            "--ks",
            "1",
            "2",
            "4",
            "--reps",
            "2",
            "--compile",
            "--out",
            str(out),
        ]
    )
    return out


def test_the_check_measures_every_k_at_every_context(check_json):
    doc = json.loads(check_json.read_text())
    row = doc["models"]["qwen2.5-0.5b"]
    assert doc["format"] == "omnidraft-gpu-check" and doc["version"] == 1
    assert set(row["eager"]) == {"16", "32"} and all(
        row["eager"][c][k] > 0 for c in row["eager"] for k in "124"
    )
    assert row["generate_ms_per_token"] > 0 and "compiled" not in row
    assert all(row["graph"][c][k] > 0 for c in ("16", "32") for k in "124")  # the static cache, eager here


def test_device_sim_builds_a_measured_server_profile_from_it(check_json, tmp_path):
    devices = profiles_from_check(check_json)
    assert len(devices) == 1 and len(devices[0]["target_ms"]) == 4  # m = 1..4, 3 interpolated between 2 and 4
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps({"devices": devices}))
    assert devices[0]["name"] in load_profiles(path).devices


def test_device_sim_refuses_a_check_of_another_version(check_json, tmp_path):
    doc = json.loads(check_json.read_text())
    doc["version"] = 99
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="version 99; this device_sim reads version 1"):
        profiles_from_check(other)
