"""The repository runs on its own: a copy with nothing beside it passes tests and finds its data."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SKIP = {".git", ".venv", "__pycache__", ".pytest_cache", "bench_out", "build"}


def _files() -> list[Path]:
    """What a clone holds: git's tracked and untracked-unignored files (every file outside a checkout)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if p.is_file() and not _SKIP & set(p.relative_to(ROOT).parts)]


def test_no_code_reads_outside_the_repository():
    pattern = re.compile(r"\.\./shared|[\"']shared[\"']\s*/\s*[\"']data|parents\[2\]\s*/\s*[\"']shared")
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _files()
        if p.suffix == ".py"
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line) and p.name != Path(__file__).name
    ]
    assert not hits, f"code that reads a shared/ beside the repository: {hits}"


def test_a_copy_with_nothing_beside_it_passes_its_data_tests(tmp_path):
    """Copy the repository alone into an empty directory and run the tests that read data there."""
    copy = tmp_path / "alone" / "omnidraft"
    for src in _files():
        dst = copy / src.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    assert not (copy.parent / "shared").exists() and not (copy.parent.parent / "shared").exists()
    env = {k: v for k, v in os.environ.items() if k != "OMNIDRAFT_DATA"}
    env["PYTHONPATH"] = str(copy)  # the copy's package, not the checkout's editable install
    probe = "import omnidraft.bench.datasets as d; print(d.data_dir())"
    where = subprocess.run(
        [sys.executable, "-c", probe], cwd=copy, env=env, capture_output=True, text=True, check=True
    )
    assert Path(where.stdout.strip()) == copy / "data"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not real",
            "tests/test_bench.py",
            "tests/test_translate.py",
            "-k",
            "dataset or reference or vocab",
        ],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout
