"""Benchmark prompts: GSM8K, HumanEval, or any JSONL file with a "prompt" field.

The prompts the demo and `omnidraft bench` use (GSM8K's test split, HumanEval, a CNN/DailyMail
sample) ship in the package (`omnidraft/bench/data/`, each with its license). What only the lab and
the tests read (GSM8K's train split, vocabulary files) is in the repository's `data/`
(data/README.md), found beside the package or from the working directory; $OMNIDRAFT_DATA, a
directory laid out like either, comes first. Nothing is downloaded.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

__all__ = ["WORKLOADS", "data_dir", "dataset_file", "gsm8k_rows", "load_prompts", "load_references"]

HUMANEVAL_TRAIN_FROM = 64

PACKAGED = Path(__file__).resolve().parent / "data"  # what ships in the wheel
REPO_DATA = Path(__file__).resolve().parents[2] / "data"  # the checkout's data/ (an editable install)


def _candidates() -> list[Path]:
    if os.environ.get("OMNIDRAFT_DATA"):
        return [Path(os.environ["OMNIDRAFT_DATA"])]
    here = Path.cwd().resolve()
    return [REPO_DATA, *(d / "data" for d in (here, *here.parents))]


def data_dir() -> Path:
    """The repository's data directory: $OMNIDRAFT_DATA, else the checkout's `data/` (an editable
    install), else the `data/` of the working directory or of a directory above it (a checkout the
    user is in, with the package installed elsewhere)."""
    tried = _candidates()
    for path in tried:
        if (path / "tokenizers").is_dir() or (path / "gsm8k").is_dir():
            return path
    raise FileNotFoundError(_not_found("the repository's data/", tried))


def _not_found(what: str, tried: list[Path]) -> str:
    return (
        f"{what} is not in the package and not under {tried[0]}"
        + (f" nor under {tried[1]} and the directories above" if tried[1:] else "")
        + "; run from a checkout of the repository (its data/) or set OMNIDRAFT_DATA to a directory laid "
        "out like its data/"
    )


def dataset_file(relative: str) -> Path:
    """A dataset file by its path under a data directory ("gsm8k/test.jsonl"), plain or gzipped:
    from $OMNIDRAFT_DATA if it has it, else the package's copy, else the repository's data/."""
    given = os.environ.get("OMNIDRAFT_DATA")
    tried = [Path(given), PACKAGED] if given else [PACKAGED, *_candidates()]
    for base in tried:
        for name in (relative, relative + ".gz"):
            if (base / name).is_file():
                return base / name
    raise FileNotFoundError(_not_found(relative, [d for d in tried if d != PACKAGED]))


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def gsm8k_rows(part: str = "test") -> list[dict]:
    """GSM8K's rows ("question", "answer") of the "test" split (shipped) or "train" (a checkout)."""
    if part not in ("test", "train"):
        raise ValueError(f"unknown GSM8K split {part!r}: use gsm8k or gsm8k:train")
    return _jsonl(dataset_file(f"gsm8k/{part}.jsonl"))


def _humaneval(part: str) -> list[dict]:
    if part not in ("", "test", "train"):
        raise ValueError(f"unknown HumanEval split {part!r}: use humaneval or humaneval:train")
    rows = _jsonl(dataset_file("humaneval/HumanEval.jsonl.gz"))
    return rows[HUMANEVAL_TRAIN_FROM:] if part == "train" else rows


def _gsm8k_prompt(row: dict) -> str:
    return f"Question: {row['question']}\nAnswer: Let's think step by step."


def _cnndm() -> list[dict]:
    return _jsonl(dataset_file("cnndm/train_sample.jsonl"))


def _words(text: str, n: int) -> str:
    words = text.split()
    return " ".join(words[:n]) + (" ..." if len(words) > n else "")


def _summarize(n: int) -> list[str]:
    """An article (its first 350 words), then a request for a summary in its own words."""
    return [
        f"Article: {_words(r['article'], 350)}\n\nSummarize the article above in three sentences, "
        "keeping its own wording.\nSummary:"
        for r in _cnndm()[:n]
    ]


def _rag(n: int) -> list[str]:
    """Three articles (150 words each, from the second half of the sample) and a question that the
    one named by i % 3 answers: which document reports its first highlight, quoted."""
    rows = _cnndm()[50:]
    return [_rag_prompt(rows, 3 * i, i % 3) for i in range(n)]


def _rag_prompt(rows: list[dict], first: int, answer: int) -> str:
    """Three articles from `rows[first:]` (150 words each) and the question document `answer` answers."""
    docs = [rows[(first + j) % len(rows)] for j in range(3)]
    fact = docs[answer]["highlights"].split("\n")[0].strip().rstrip(".")
    context = "\n".join(f"[{j + 1}] {_words(d['article'], 150)}" for j, d in enumerate(docs))
    return (
        f"Documents:\n{context}\n\nQuestion: Which document reports that {fact}? Name it and quote the "
        "sentences of that document that say so.\nAnswer:"
    )


_DOCSTRING = re.compile(r"\n\s*(\"\"\"|\'\'\')[\s\S]*?\1\n", re.M)


def _code_edit(n: int) -> list[str]:
    """A HumanEval canonical solution with its docstring stripped, to be rewritten with type hints
    and a docstring (most of the body is copied)."""
    out = []
    for r in _humaneval("")[:n]:
        code = _DOCSTRING.sub("\n", r["prompt"], count=1).rstrip() + "\n" + r["canonical_solution"].rstrip()
        out.append(
            f"# Original code:\n{code}\n\n# The same code, rewritten with type hints on every function and a "
            "docstring for the entry point; the logic is unchanged:\n"
        )
    return out


def _chat(n: int) -> list[str]:
    """A GSM8K question and its worked answer as a first turn, then a follow-up quoting a line of it."""
    return [_chat_prompt(r) for r in gsm8k_rows("test")[:n]]


def _chat_prompt(r: dict) -> str:
    answer = _CALCULATOR.sub("", r["answer"]).replace("####", "The answer is")
    lines = [ln for ln in answer.split("\n") if ln.strip()]
    quoted = lines[len(lines) // 2 - 1] if len(lines) > 1 else lines[0]
    return (
        f'User: {r["question"]}\nAssistant: {answer}\nUser: You wrote "{quoted}" Explain that step again, '
        "repeating your calculation.\nAssistant:"
    )


def _mixed(n: int, start: int) -> list[str]:
    """Spec-Bench's six categories in turn (chat, translation, summarization, QA, math, RAG), the
    j-th prompt of each built from the j-th item of its source (CNN/DM articles 10-49 and from 80,
    GSM8K test problems from 200 and 300, none of which the other workloads use). "mixed" starts at
    j = 0 and is held out (never used to tune anything); "mixed:dev" starts at j = 10."""
    articles, problems = _cnndm(), gsm8k_rows("test")
    out = []
    for i in range(n):
        j = start + i // 6
        kind = i % 6
        if kind == 0:
            out.append(_chat_prompt(problems[200 + j]))
        elif kind == 1:
            out.append(f"Translate into French:\n{_words(articles[30 + j % 20]['article'], 60)}\nFrench:")
        elif kind == 2:
            text = _words(articles[10 + j % 20]["article"], 200)
            out.append(f"Article: {text}\n\nSummarize the article above in two sentences.\nSummary:")
        elif kind == 3:
            article = articles[30 + (j + 10) % 20]
            first = article["highlights"].split("\n")[0].strip().rstrip(".")
            text = _words(article["article"], 200)
            out.append(
                f"Article: {text}\n\nQuestion: What does the article report about this: {first}?\nAnswer:"
            )
        elif kind == 4:
            out.append(_gsm8k_prompt(problems[300 + j]))
        else:
            out.append(_rag_prompt(articles, 80 + 3 * j, j % 3))
    return out


WORKLOADS = {
    "summarize": _summarize,
    "rag": _rag,
    "code-edit": _code_edit,
    "chat": _chat,
    "mixed": lambda n: _mixed(n, 0),
    "mixed:dev": lambda n: _mixed(n, 10),
}


def load_prompts(dataset: str, n: int, *, split: str = "test") -> list[str]:
    """First `n` prompts of `dataset`: "gsm8k", "gsm8k:train", "humaneval", "humaneval:train", one of
    the copy-heavy WORKLOADS ("summarize", "rag", "code-edit", "chat"; docs/retrieval.md says how
    each is built) or a .jsonl path. HumanEval has no train split: "humaneval:train" is problems
    64-163, disjoint from the first 64 that benchmarks evaluate on."""
    if n < 1:
        raise ValueError(f"number of prompts n must be >= 1, got {n}")
    if dataset in WORKLOADS:
        return WORKLOADS[dataset](n)
    name, _, part = dataset.partition(":")
    if name == "gsm8k":
        return [_gsm8k_prompt(r) for r in gsm8k_rows(part or split)[:n]]
    if name == "humaneval":
        return [r["prompt"] for r in _humaneval(part)[:n]]
    path = Path(dataset)
    if path.suffix in (".jsonl", ".gz") and path.is_file():
        rows = _jsonl(path)
        if not rows or any("prompt" not in r for r in rows):
            raise ValueError(f'{path}: every line needs a "prompt" field')
        return [r["prompt"] for r in rows[:n]]
    raise ValueError(
        f"unknown dataset {dataset!r}: use gsm8k, gsm8k:train, humaneval, humaneval:train, "
        f"{', '.join(WORKLOADS)} or a path to a .jsonl file"
    )


_CALCULATOR = re.compile(
    r"<<[^<>]*>>"
)  # GSM8K's calculator annotations, "<<48/2=24>>", which no model writes


def load_references(dataset: str, n: int) -> list[tuple[str, str]]:
    """First `n` (prompt, reference continuation) pairs of "gsm8k[:train|:test]" (the worked answer,
    calculator annotations removed, after a space) or "humaneval[:train]" (the canonical solution).
    The prompts are `load_prompts`'s."""
    if n < 1:
        raise ValueError(f"number of prompts n must be >= 1, got {n}")
    name, _, part = dataset.partition(":")
    if name == "gsm8k":
        return [
            (_gsm8k_prompt(r), " " + _CALCULATOR.sub("", r["answer"])) for r in gsm8k_rows(part or "test")[:n]
        ]
    if name == "humaneval":
        return [(r["prompt"], r["canonical_solution"]) for r in _humaneval(part)[:n]]
    raise ValueError(
        f"no reference answers for dataset {dataset!r}: use gsm8k, gsm8k:train, humaneval or humaneval:train"
    )
