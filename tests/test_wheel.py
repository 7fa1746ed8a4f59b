"""The wheel as a user installs it: built from this checkout, installed in a fresh venv, run from a
directory with no checkout beside it (the dependencies come from the test's own environment, so
nothing is downloaded)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, omnidraft command, a working directory outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(ROOT),
        ],
        check=True,
        cwd=tmp,
    )
    (wheel,) = (tmp / "dist").glob("omnidraft-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "omnidraft/shortlist/corpus.jsonl.gz" in names and "omnidraft/py.typed" in names
    assert "omnidraft/bench/data/gsm8k/test.jsonl.gz" in names  # the demo's and bench's prompts
    assert not any(n.startswith(("benchmarks/", "tests/", "data/")) for n in names)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True
    )
    # the dependencies: this environment's site-packages, after the venv's own (so the wheel's
    # omnidraft wins; the editable install's finder is not loaded from a .pth-added directory)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp / "elsewhere"
    work.mkdir()
    return python, venv / "bin" / "omnidraft", work


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMNIDRAFT_DATA")}


def test_the_wheel_generates_and_builds_a_shortlist_without_a_checkout(installed, tmp_path):
    python, command, work = installed
    where = subprocess.run(
        [str(python), "-c", "import omnidraft; print(omnidraft.__file__)"],
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
        env=_env(),
    ).stdout
    assert str(ROOT) not in where and "venv" in where
    out = subprocess.run(
        [
            str(command),
            "generate",
            "def add(a, b):",
            "--pair",
            "smollm2-135m:qwen2.5-coder-0.5b",
            "--max-new-tokens",
            "8",
        ],
        cwd=work,
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert " tokens in " in out.stderr and out.stdout.strip()
    probe = (
        "import omnidraft as od; d = od.Drafter.load('smollm2-135m', backend='torch'); "
        f"d.use_shortlist('static', path={str(tmp_path / 'static.pt')!r}); print(len(d.head.policy.core.ids))"
    )
    out = subprocess.run([str(python), "-c", probe], cwd=work, capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "static.pt").is_file() and int(out.stdout.split()[-1]) > 1000
