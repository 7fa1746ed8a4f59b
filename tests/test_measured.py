"""Per-machine measurements (omnidraft/runtime/measured.py): kept once, shared safely, shown and forgotten."""

from __future__ import annotations

import multiprocessing

from omnidraft.cli import doctor
from omnidraft.runtime import measured


def _write_keys(root: str, prefix: str) -> None:
    from pathlib import Path

    for i in range(25):
        measured.update("probe", {f"{prefix}{i}": i}, root=Path(root))


def test_processes_writing_one_file_lose_no_entry(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_write_keys, args=(str(tmp_path), p)) for p in "ab"]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert all(w.exitcode == 0 for w in workers)
    assert len(measured.read("probe", root=tmp_path)) == 50


def test_doctor_shows_what_was_measured_and_reset_forgets_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIDRAFT_CACHE", str(tmp_path))
    calls = []
    assert measured.remembered("probe", "k", lambda: calls.append(1) or 0.25) == 0.25
    assert any("probe (1)" in line for line in doctor.report())
    assert any("probe-" in line for line in doctor.reset())
    assert measured.entries() == [] and measured.read("probe") == {}
    assert measured.remembered("probe", "k", lambda: calls.append(1) or 0.5) == 0.5  # measured again
    assert len(calls) == 2


def test_a_measurement_line_names_the_model_not_a_version_or_setting():
    from omnidraft.runtime.measured import _named

    llama = "/cache/gguf/qwen2.5-coder-0.5b-instruct.gguf:491400928|0.3.36+omnidraft.3|libggml-base.so:834176"
    assert _named(llama) == "qwen2.5-coder-0.5b-instruct.gguf"
    vino = "qwen2.5-coder-0.5b-int8|0123abcd|51200|openvino 2025.3.0-1-releases/2025/3|threads 4"
    assert _named(vino) == "qwen2.5-coder-0.5b-int8"
    assert _named("/models/drafter|bf16") == "drafter"
