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


def test_replay_bench_scores_variants_and_checks_every_output(tiny_drafter, tiny_target, tmp_path):
    from omnidraft.bench.replay import parse_decode, replay_variant, write_replay_report
    from omnidraft.distill.trace_store import ReplayTarget, record

    prompts = [p[:60] for p in load_prompts("gsm8k", 3)]
    traces = [record(tiny_target, p, 20, k=4) for p in prompts]
    replay = ReplayTarget.like(tiny_target, traces)
    rows = [{"dataset": "gsm8k", "drafter": "tiny", "decode": d,
             **replay_variant(tiny_drafter, replay, traces, prompts, {"k": 3, **parse_decode(d)})}
            for d in ("heal=off", "heal=on,k=5,stop=0")]
    assert all(r["identical"] == 3 and 0 <= r["first_accepted"] <= 1 and r["drafted_per_round"] > 0 for r in rows)
    assert rows[1]["drafted_per_round"] >= rows[0]["drafted_per_round"]  # k 5 without early stop drafts more
    table = write_replay_report({"pair": "tiny:tiny", "n": 3, "max_new_tokens": 20, "base": {}, "rows": rows}, tmp_path, "r")
    assert "heal=on,k=5,stop=0" in table and (tmp_path / "r.json").exists()
    for bad, message in (("heal=maybe", "on or off"), ("temperature=1", "KEY=VALUE"), ("k", "KEY=VALUE")):
        with pytest.raises(ValueError, match=message):
            parse_decode(bad)
