"""A llama.cpp build that crashes on this CPU costs a fallback, never the process: the smoke test
in a child process (llamacpp/smoke.py), kept per machine; the drafter backend chosen by flag or
environment variable."""

from __future__ import annotations

import subprocess

import pytest

from omnidraft.llamacpp import smoke
from omnidraft.runtime import backends

CRASH = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"


def test_a_llama_cpp_build_that_crashes_is_never_picked(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(smoke, "_CHILD", CRASH)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    verdict = smoke.runs(gguf)
    assert "SIGSEGV" in verdict and "cannot run tiny.gguf" in caplog.text
    assert backends._candidates(str(gguf)) == ["torch"]  # the copy and "auto" keep to PyTorch
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("the child ran twice"))
    with pytest.raises(smoke.LlamaCppBrokenError, match="SIGSEGV.*--drafter-backend torch"):
        smoke.check_runs(gguf)  # what a llama.cpp target or an explicit llama.cpp drafter raises


def test_a_build_that_runs_is_remembered_as_running(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(smoke, "_CHILD", "print('ok')")
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    assert smoke.runs(gguf) == "ok"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("the child ran twice"))
    smoke.check_runs(gguf)


def test_the_drafter_backend_comes_from_the_flag_or_the_environment(monkeypatch, tiny_drafter, tmp_path):
    import omnidraft as od
    from omnidraft.cli.options import build_parser

    monkeypatch.setenv("OMNIDRAFT_DRAFTER_BACKEND", "llama")
    with pytest.raises(ValueError, match=r"\$OMNIDRAFT_DRAFTER_BACKEND must be one of .*got 'llama'"):
        od.Drafter.load("anything")
    args = build_parser().parse_args(["generate", "hi", "--drafter-backend", "torch"])
    assert args.drafter_backend == "torch"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--drafter-backend", "cuda"])
