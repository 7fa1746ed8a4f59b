"""Every example in examples/ runs, as a user would run it, on the shipped models."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.real


def _run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_local_pairing():
    out = _run("examples/local_pairing.py", "def add(a, b):", "--max-new-tokens", "12")
    assert out.startswith("def add(a, b):") and "tokens," in out


def test_chat_streaming():
    out = _run("examples/chat_streaming.py", "Say hello.", "--max-new-tokens", "8")
    assert "[finished:" in out


def test_cloud_target_with_user_adapter(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _run(
        "examples/cloud_target_with_user_adapter.py",
        "--port",
        str(port),
        "--max-new-tokens",
        "12",
        "--requests",
        "1",
        "--profiles",
        str(tmp_path),
    )
    assert "profile of alice@example.com saved" in out
    assert any(tmp_path.rglob("*.json"))
