"""bench/: prompts, the side-by-side runner on tiny models, partial and final reports."""

from __future__ import annotations

import json

import pytest

from omnidraft.bench.datasets import load_prompts
from omnidraft.bench.report import write_report
from omnidraft.bench.runner import run_prompts, summarize


def test_datasets_load_and_bad_names_are_named(tmp_path):
    assert load_prompts("gsm8k", 2)[0].startswith("Question: ")
    assert "def " in load_prompts("humaneval", 1)[0]
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello"}\n')
    assert load_prompts(str(tmp_path / "p.jsonl"), 5) == ["hello"]
    with pytest.raises(ValueError, match="unknown dataset 'mmlu'"):
        load_prompts("mmlu", 2)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        load_prompts("gsm8k", 0)


def test_runner_reports_after_every_prompt(tiny_drafter, tiny_target, tmp_path):
    pair = tiny_drafter.pair(tiny_target, k=3)
    seen = []
    results = run_prompts(pair, load_prompts("gsm8k", 3), 12, hf=False, done=lambda rs: seen.append(len(rs)))
    assert seen == [1, 2, 3] and all(r.identical for r in results)
    summary = {"pair": "tiny:tiny", "dataset": "gsm8k", **summarize(results)}
    assert summary["identical_rate"] == 1.0 and summary["hf_speedup"] is None
    paths = write_report(tmp_path, "b", [summary], {"tiny:tiny/gsm8k": [r.as_dict() for r in results]})
    assert json.loads(paths["json"].read_text())["summaries"][0]["prompts"] == 3
    assert "tiny:tiny" in paths["md"].read_text() and paths["png"].stat().st_size > 0
