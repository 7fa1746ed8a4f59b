"""Benchmark prompts: GSM8K, HumanEval, or any JSONL file with a "prompt" field.

Data is read from $OMNIDRAFT_DATA, else from the repository's own `data/` (see data/README.md).
Nothing is downloaded and nothing outside the repository is read.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

__all__ = ["data_dir", "load_prompts", "load_references"]

HUMANEVAL_TRAIN_FROM = 64


REPO_DATA = Path(__file__).resolve().parents[2] / "data"  # the checkout's data/ (an editable install)


def data_dir() -> Path:
    """The data directory: $OMNIDRAFT_DATA, else the repository's `data/`."""
    path = Path(os.environ["OMNIDRAFT_DATA"]) if os.environ.get("OMNIDRAFT_DATA") else REPO_DATA
    if not (path / "gsm8k").is_dir():
        raise FileNotFoundError(f"no gsm8k/ under the data directory {path}; run from a checkout of the repository "
                                "or set OMNIDRAFT_DATA to a directory laid out like its data/")
    return path


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _gsm8k(part: str) -> list[dict]:
    return _jsonl(data_dir() / "gsm8k" / f"{part}.jsonl")


def _humaneval(part: str) -> list[dict]:
    if part not in ("", "test", "train"):
        raise ValueError(f"unknown HumanEval split {part!r}: use humaneval or humaneval:train")
    rows = _jsonl(data_dir() / "humaneval" / "HumanEval.jsonl.gz")
    return rows[HUMANEVAL_TRAIN_FROM:] if part == "train" else rows


def _gsm8k_prompt(row: dict) -> str:
    return f"Question: {row['question']}\nAnswer: Let's think step by step."


def load_prompts(dataset: str, n: int, *, split: str = "test") -> list[str]:
    """First `n` prompts of `dataset`: "gsm8k", "gsm8k:train", "humaneval", "humaneval:train" or a
    .jsonl path. HumanEval has no train split: "humaneval:train" is problems 64-163, disjoint from
    the first 64 that benchmarks evaluate on."""
    if n < 1:
        raise ValueError(f"number of prompts n must be >= 1, got {n}")
    name, _, part = dataset.partition(":")
    if name == "gsm8k":
        return [_gsm8k_prompt(r) for r in _gsm8k(part or split)[:n]]
    if name == "humaneval":
        return [r["prompt"] for r in _humaneval(part)[:n]]
    path = Path(dataset)
    if path.suffix in (".jsonl", ".gz") and path.is_file():
        rows = _jsonl(path)
        if not rows or any("prompt" not in r for r in rows):
            raise ValueError(f"{path}: every line needs a \"prompt\" field")
        return [r["prompt"] for r in rows[:n]]
    raise ValueError(f"unknown dataset {dataset!r}: use gsm8k, gsm8k:train, humaneval or a path to a .jsonl file")


_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations, "<<48/2=24>>", which no model writes


def load_references(dataset: str, n: int) -> list[tuple[str, str]]:
    """First `n` (prompt, reference continuation) pairs of "gsm8k[:train|:test]" (the worked answer,
    calculator annotations removed, after a space) or "humaneval[:train]" (the canonical solution).
    The prompts are `load_prompts`'s."""
    if n < 1:
        raise ValueError(f"number of prompts n must be >= 1, got {n}")
    name, _, part = dataset.partition(":")
    if name == "gsm8k":
        return [(_gsm8k_prompt(r), " " + _CALCULATOR.sub("", r["answer"])) for r in _gsm8k(part or "test")[:n]]
    if name == "humaneval":
        return [(r["prompt"], r["canonical_solution"]) for r in _humaneval(part)[:n]]
    raise ValueError(f"no reference answers for dataset {dataset!r}: use gsm8k, gsm8k:train, humaneval or humaneval:train")
