"""Every example in examples/ runs, as a user would run it, on the shipped models."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import unasked_output

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.real


def _run(*args: str, quiet: bool = True) -> str:
    """The example's output; `quiet`: it printed nothing else (no warning, no progress bar but the
    one-time work's on a machine's first run)."""
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not quiet or not unasked_output(out.stderr), out.stderr[-3000:]
    return out.stdout


def test_the_readme_quickstart_runs_quietly_and_prints_its_stats(tmp_path):
    """The README's Quickstart block as written, with fewer tokens: the text, then the stats line."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "quickstart.py"
    script.write_text(block.replace("max_new_tokens=128", "max_new_tokens=8"))
    out = _run(str(script))
    assert "8 tokens in " in out and ("tau " in out or "decoded by the target alone" in out)


def test_local_pairing():
    out = _run("examples/local_pairing.py", "def add(a, b):", "--max-new-tokens", "12")
    assert out.startswith("def add(a, b):") and "12 tokens in " in out


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
        quiet=False,  # the server it starts logs its start
    )
    assert "profile of alice@example.com saved" in out
    assert "adapter 0 steps (the first update after" in out  # 0 steps, and why
    assert any(tmp_path.rglob("*.json"))
