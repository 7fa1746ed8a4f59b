"""The README's by-hand install, as a new user runs it: a fresh venv, the README's own lines, then
its Quickstart, every example and `omnidraft doctor` in that venv, each without a crash or a
warning the user did not ask for (the cloud example's server prints only its start line). It
installs gigabytes, so `make test-install` runs it, not `make test`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnidraft.bench.network import free_port

from .conftest import unasked_output

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.install


def readme_install_lines() -> list[str]:
    """The by-hand lines of the README's Install block (what follows "# or by hand")."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Install", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = block.split("# or by hand", 1)[1].splitlines()[1:]
    return [line.split("  #")[0].strip() for line in lines if line.startswith(("python ", "pip "))]


def test_the_readmes_by_hand_install_runs_the_quickstart_and_doctor_quietly(tmp_path):
    lines = readme_install_lines()
    assert any(line.startswith("pip install") for line in lines) and len(lines) >= 3
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    for line in lines:
        command = f"{python} -m {line}" if line.startswith("pip ") else f"{python} {line[len('python ') :]}"
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, (line, done.stderr[-3000:])
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart.replace("max_new_tokens=128", "max_new_tokens=8"))
    out = subprocess.run([str(python), str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not unasked_output(out.stderr), out.stderr[-3000:]  # no warning, no progress bar
    assert "8 tokens in " in out.stdout
    for example in ("local_pairing.py", "chat_streaming.py"):  # every example a user runs alone
        run = subprocess.run(
            [str(python), str(ROOT / "examples" / example), "--max-new-tokens", "8"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0 and not unasked_output(run.stderr), (example, run.stderr[-3000:])
    port = free_port()
    cloud = subprocess.run(
        [str(python), str(ROOT / "examples" / "cloud_target_with_user_adapter.py"), "--port", str(port)]
        + ["--max-new-tokens", "8", "--requests", "1", "--profiles", str(tmp_path / "profiles")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert cloud.returncode == 0, cloud.stderr[-3000:]
    server_lines = unasked_output(cloud.stderr)  # (one-time measurements say so, once)
    assert all(line.startswith("omnidraft serve: ") for line in server_lines), cloud.stderr[-3000:]
    assert "profile of alice@example.com saved" in cloud.stdout, cloud.stdout
    doctor = subprocess.run(
        [str(venv / "bin" / "omnidraft"), "doctor"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert doctor.returncode == 0, doctor.stderr[-3000:]
    assert "FAILED" not in doctor.stdout and "  torch: ok" in doctor.stdout, doctor.stdout
