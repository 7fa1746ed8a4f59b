"""`load_target(spec, engine="auto")` and `omnidraft serve --engine auto` (the default): the engine
that serves one request alone fastest here, among those that can run the model without a long
conversion (omnidraft/targets/fastest.py)."""

from __future__ import annotations

import pytest

import omnidraft as od
from omnidraft.runtime import measured
from omnidraft.targets import fastest
from omnidraft.targets.registry import ENGINES, Engine, register_engine


@pytest.fixture
def engines(tiny_target, monkeypatch, tmp_path):
    """Two toy engines serving the tiny target, their loads counted; measurements kept in tmp."""
    monkeypatch.setattr(measured, "directory", lambda root=None: tmp_path / "measured")
    loads: list[str] = []

    def loader(name):
        def load(spec, options):
            loads.append(name)
            if name == "broken":
                raise RuntimeError("this engine cannot run it")
            return tiny_target

        return load

    for name in ("fast", "slow", "broken"):
        register_engine(Engine(name, f"toy {name}", loader(name)))
    yield loads
    for name in ("fast", "slow", "broken"):
        ENGINES.pop(name, None)


def test_the_fastest_candidate_is_chosen_once_a_machine_and_a_failing_one_never(engines, monkeypatch):
    monkeypatch.setattr(fastest, "candidates", lambda spec: ["slow", "fast", "broken"])
    rates = {"slow": 10.0, "fast": 30.0}
    monkeypatch.setattr(fastest, "request_rate", lambda target: rates[engines[-1]])
    assert od.load_target("tiny", engine="auto") is not None
    assert engines == ["slow", "fast", "broken", "fast"]  # each timed once, then the fastest loaded
    assert fastest.fastest_engine("tiny", lambda name: ENGINES[name].load("tiny", {})) == "fast"
    assert engines[4:] == ["broken"]  # the timings are kept; a failure is not, so it is tried again


@pytest.mark.parametrize("slow_rate, chosen", [(29.5, "slow"), (25.0, "fast")])
def test_an_engine_that_verifies_flat_is_taken_within_a_tie_of_the_fastest(
    engines, monkeypatch, slow_rate, chosen
):
    """Within `TIE` of the fastest alone, the engine whose verify costs about a step (OpenVINO's)
    is loaded: a request on it is within the floor of the fastest, and drafts can pay there."""
    monkeypatch.setattr(fastest, "candidates", lambda spec: ["fast", "slow"])
    rates = {"slow": slow_rate, "fast": 30.0}
    monkeypatch.setattr(fastest, "request_rate", lambda target: rates[engines[-1]])
    load = lambda name: ENGINES[name].load("tiny", {})  # noqa: E731
    assert fastest.fastest_engine(f"tiny-{slow_rate}", load, flat=("slow",)) == chosen


def test_a_single_candidate_is_taken_untimed_and_a_named_engine_as_named(engines, monkeypatch):
    monkeypatch.setattr(fastest, "candidates", lambda spec: ["slow"])
    assert fastest.fastest_engine("tiny", lambda name: ENGINES[name].load("tiny", {})) == "slow"
    assert engines == []
    od.load_target("tiny", engine="fast")
    assert engines == ["fast"]
    with pytest.raises(ValueError, match="no target engine 'nope'"):
        od.load_target("tiny", engine="nope")


def test_openvino_is_registered_as_verifying_flat_and_llama_cpp_not():
    assert ENGINES["openvino"].verifies_flat and ENGINES["openvino-int4"].verifies_flat
    assert not ENGINES["llama.cpp"].verifies_flat


def test_a_model_directory_runs_on_pytorch_and_openvino_needs_an_exporter_or_ir(tmp_path, monkeypatch):
    monkeypatch.delenv("OMNIDRAFT_OPENVINO_PYTHON", raising=False)
    monkeypatch.setattr(fastest, "_gpu", lambda: False)
    assert fastest.candidates(str(tmp_path)) == ["torch"]
    (tmp_path / "openvino_model.xml").write_text("<net/>")
    assert fastest.candidates(str(tmp_path)) == ["openvino"]
    monkeypatch.setattr(fastest, "_gpu", lambda: True)
    assert fastest.candidates(str(tmp_path)) == ["openvino", "torch"]
    monkeypatch.setenv("OMNIDRAFT_OPENVINO_PYTHON", "python")  # an exporter: int8 and int4 exports tried
    assert fastest.candidates(str(tmp_path / "hf-model")) == ["openvino", "openvino-int4", "torch"]


def test_a_request_alone_is_timed_on_the_target_itself(tiny_target):
    assert fastest.request_rate(tiny_target) > 0


def test_serve_defaults_to_the_fastest_engine_and_says_which(engines, monkeypatch, capsys):
    from omnidraft.server.drain import DrainingServer

    from .test_cli_runs import run_cli

    monkeypatch.setattr(DrainingServer, "run", lambda self, **_: None)
    monkeypatch.setattr(fastest, "candidates", lambda spec: ["slow", "fast"])
    monkeypatch.setattr(fastest, "request_rate", lambda target: {"slow": 1.0, "fast": 2.0}[engines[-1]])
    assert run_cli(["serve", "--target", "tiny", "--no-auth"]) == 0
    assert "on fast (the fastest engine here)" in capsys.readouterr().err


def test_each_engines_timing_is_kept_against_its_build_int4_included():
    """A timing is a function of the engine's build: OpenVINO with int4 weights is OpenVINO's."""
    assert fastest._build("openvino-int4") == fastest._build("openvino") != "?"
    assert fastest._build("no-such-engine") == "?"
