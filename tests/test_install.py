"""The README's by-hand install, as a new user runs it: a fresh venv and a fresh home directory, the
README's own lines, then from a directory outside the checkout its Quickstart (twice: once set up,
it prints nothing on stderr), every example, `omnidraft doctor`, `omnidraft demo --n 1` and one
`omnidraft bench` line, each without a crash or a line on stderr the user did not ask for
(one-time work says once what it does; the cloud example's server prints its start line).

`make test` runs it first on one of its two pinned workers, beside the other tests; the Quickstart's
speed is compared where nothing runs beside it, by tests/test_quickstart_speed.py. The llama.cpp
wheel the README's first line builds is the one `make` built from nothing with the same tool and
command (copied into the fresh home); everything else starts from nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from omnidraft.bench.network import free_port

from .conftest import unasked_output

ROOT = Path(__file__).resolve().parents[1]
WHEELS = Path(os.environ.get("WHEELS", Path.home() / ".cache" / "omnidraft" / "wheels"))

pytestmark = pytest.mark.install


def readme_install_lines() -> list[str]:
    """The by-hand lines of the README's Install block (what follows "# or by hand")."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Install", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = block.split("# or by hand", 1)[1].splitlines()[1:]
    return [line.split("  #")[0].strip() for line in lines if line.startswith(("python ", "pip "))]


def readme_quickstart() -> tuple[str, float]:
    """The Quickstart's code and the speed (tok/s) its example output line shows."""
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    shown = re.search(r'"128 tokens in [\d.]+ s \(([\d.]+) tok/s\)', code)
    assert shown, "the Quickstart's example line must show 128 tokens and a speed"
    return code, float(shown.group(1))


def quiet(run: subprocess.CompletedProcess[str], what: str, progress: str | None = None) -> None:
    """`run` succeeded and wrote nothing to stderr but one-time work's lines (and, with
    `progress`, its own progress bar, whose lines start so)."""
    assert run.returncode == 0, (what, run.stderr[-3000:])
    unasked = [line for line in unasked_output(run.stderr) if not (progress and line.startswith(progress))]
    assert not unasked, (what, unasked[:20])


def test_the_readmes_by_hand_install_runs_every_command_it_shows_quietly(tmp_path):
    lines = readme_install_lines()
    assert any(line.startswith("pip install") for line in lines) and len(lines) >= 3
    home = tmp_path / "home"
    built = sorted(WHEELS.glob("llama_cpp_python-*.whl"))
    assert built, f"make builds the llama.cpp wheel into {WHEELS} before this test"
    (home / ".cache" / "omnidraft" / "wheels").mkdir(parents=True)
    for wheel in built:
        shutil.copy2(wheel, home / ".cache" / "omnidraft" / "wheels" / wheel.name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python, bin_ = venv / "bin" / "python", venv / "bin"
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and "OMNIDRAFT" not in k
    }
    env["HOME"] = str(home)
    env["PIP_CACHE_DIR"] = str(Path.home() / ".cache" / "pip")  # (downloads only; nothing omnidraft keeps)
    for line in lines:
        command = f"{python} -m {line}" if line.startswith("pip ") else f"{python} {line[len('python ') :]}"
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, (line, done.stderr[-3000:])
    work = tmp_path / "work"  # a user's own directory, not the checkout
    work.mkdir()

    code, _ = readme_quickstart()
    (work / "quickstart.py").write_text(code)
    first = subprocess.run([str(python), "quickstart.py"], cwd=work, env=env, capture_output=True, text=True)
    quiet(first, "the Quickstart, first run")
    again = subprocess.run([str(python), "quickstart.py"], cwd=work, env=env, capture_output=True, text=True)
    assert again.returncode == 0 and not again.stderr.strip(), again.stderr[-3000:]  # nothing once set up
    assert re.search(r"128 tokens in [\d.]+ s \([\d.]+ tok/s\)", again.stdout), again.stdout

    for example, args, shows in (  # every example a user runs alone, and what it prints
        ("local_pairing.py", ["def add(a, b):"], ("def add(a, b):", "8 tokens in ")),
        ("chat_streaming.py", ["Say hello."], ("[finished:",)),
    ):
        run = subprocess.run(
            [str(python), str(ROOT / "examples" / example), *args, "--max-new-tokens", "8"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        quiet(run, example)
        assert all(line in run.stdout for line in shows), (example, run.stdout)
    port = free_port()
    cloud = subprocess.run(
        [str(python), str(ROOT / "examples" / "cloud_target_with_user_adapter.py"), "--port", str(port)]
        + ["--max-new-tokens", "8", "--requests", "1", "--profiles", str(tmp_path / "profiles")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert cloud.returncode == 0, cloud.stderr[-3000:]
    server_lines = unasked_output(cloud.stderr)
    assert all(line.startswith("omnidraft serve: ") for line in server_lines), cloud.stderr[-3000:]
    assert "profile of alice@example.com saved" in cloud.stdout, cloud.stdout
    assert "adapter 0 steps (the first update after" in cloud.stdout, cloud.stdout  # 0 steps, and why
    assert any((tmp_path / "profiles").rglob("*.json"))

    doctor = subprocess.run(
        [str(bin_ / "omnidraft"), "doctor"], cwd=work, env=env, capture_output=True, text=True
    )
    assert doctor.returncode == 0, doctor.stderr[-3000:]
    assert "FAILED" not in doctor.stdout and "  torch: ok" in doctor.stdout, doctor.stdout

    demo = subprocess.run(
        [str(bin_ / "omnidraft"), "demo", "--n", "1", "--repeats", "1", "--max-new-tokens", "32"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    quiet(demo, "omnidraft demo")
    assert "math" in demo.stdout and "x" in demo.stdout, demo.stdout
    bench = subprocess.run(
        [str(bin_ / "omnidraft"), "bench", "--pair", "smollm2-135m:qwen2.5-coder-0.5b", "--dataset", "gsm8k"]
        + [
            "--dataset",
            "humaneval",
            "--n",
            "1",
            "--max-new-tokens",
            "16",
            "--no-peers",
            "--out",
            "bench_out",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    quiet(bench, "omnidraft bench", progress="smollm2-135m:qwen2.5-coder-0.5b ")  # its bar, per prompt
    assert list((work / "bench_out").glob("*.json")), bench.stdout
