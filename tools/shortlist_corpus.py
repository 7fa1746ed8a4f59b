"""Write the shortlist training text that ships in the package (omnidraft/shortlist/corpus.jsonl.gz)
from the datasets (omnidraft/bench/data/ and the checkout's data/): GSM8K train questions and
worked answers (400), HumanEval problems 64-163 with their solutions, the second half of the
CNN/DailyMail sample. Never the prompts the
benchmarks evaluate. Run after changing any of those files:

    .venv/bin/python tools/shortlist_corpus.py
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from omnidraft.bench.datasets import dataset_file, load_references

OUT = Path(__file__).resolve().parents[1] / "omnidraft" / "shortlist" / "corpus.jsonl.gz"


def texts() -> list[str]:
    out = [p + a for p, a in load_references("gsm8k:train", 400)]
    out += [p + a for p, a in load_references("humaneval:train", 100)]
    path = dataset_file("cnndm/train_sample.jsonl")
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return out + [r["article"] for r in rows[len(rows) // 2 :]]


def encode(items: list[str]) -> bytes:
    """The file's bytes: one JSON string per line, gzip with no timestamp (reproducible)."""
    return gzip.compress("".join(json.dumps(t) + "\n" for t in items).encode(), compresslevel=9, mtime=0)


if __name__ == "__main__":
    OUT.write_bytes(encode(texts()))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
