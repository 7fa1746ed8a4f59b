"""bench/: prompts, the side-by-side runner on tiny models, partial and final reports."""

from __future__ import annotations

import json

import pytest

from omnidraft.bench.datasets import load_prompts
from omnidraft.bench.report import gap_table, write_report
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
    results = run_prompts(pair, load_prompts("gsm8k", 3), 12, peers=(), done=lambda rs: seen.append(len(rs)))
    assert seen == [1, 2, 3] and all(r.identical for r in results)
    summary = {"pair": "tiny:tiny", "dataset": "gsm8k", **summarize(results)}
    assert summary["identical_rate"] == 1.0 and "assisted_speedup" not in summary
    paths = write_report(tmp_path, "b", [summary], {"tiny:tiny/gsm8k": [r.as_dict() for r in results]})
    assert json.loads(paths["json"].read_text())["summaries"][0]["prompts"] == 3
    assert "tiny:tiny" in paths["md"].read_text() and paths["png"].stat().st_size > 0


def test_gap_table_splits_the_time_per_token_and_names_each_lever():
    """Target step 100 ms; the pairing commits a token every 50 ms, 10 of them drafting, 40
    verifying, at τ 3: free drafts would give 100/40, a one-step verify 100/(10 + 100/3)."""
    row = {
        "pair": "d:t",
        "dataset": "gsm8k",
        "target_tok_s": 10.0,
        "omnidraft_tok_s": 20.0,
        "mean_accepted_length": 3.0,
        "time_split": {"draft": 0.2, "translate": 0.0, "verify": 0.8, "resync": 0.0},
    }
    cells = gap_table([row]).splitlines()[2].split(" | ")
    assert cells[2:10] == ["100", "3.00", "50", "10", "40", "0", "2.00×", "2.50×"]
    assert cells[10].rstrip(" |") == f"{100 / (10 + 100 / 3):.2f}×"


def test_replay_bench_scores_variants_and_checks_every_output(tiny_drafter, tiny_target, tmp_path):
    from benchmarks.replay import parse_decode, replay_variant, write_replay_report
    from omnidraft.distill.trace_store import ReplayTarget, record

    prompts = [p[:60] for p in load_prompts("gsm8k", 3)]
    traces = [record(tiny_target, p, 20, k=4) for p in prompts]
    replay = ReplayTarget.like(tiny_target, traces)
    rows = [
        {
            "dataset": "gsm8k",
            "drafter": "tiny",
            "decode": d,
            **replay_variant(tiny_drafter, replay, traces, prompts, {"k": 3, **parse_decode(d)}),
        }
        for d in ("heal=off", "heal=on,k=5,stop=0")
    ]
    assert all(
        r["identical"] == 3 and 0 <= r["first_accepted"] <= 1 and r["drafted_per_round"] > 0 for r in rows
    )
    assert rows[1]["drafted_per_round"] >= rows[0]["drafted_per_round"]  # k 5 without early stop drafts more
    table = write_replay_report(
        {"pair": "tiny:tiny", "n": 3, "max_new_tokens": 20, "base": {}, "rows": rows}, tmp_path, "r"
    )
    assert "heal=on,k=5,stop=0" in table and (tmp_path / "r.json").exists()
    for bad, message in (("heal=maybe", "on or off"), ("temperature=1", "KEY=VALUE"), ("k", "KEY=VALUE")):
        with pytest.raises(ValueError, match=message):
            parse_decode(bad)


def test_references_pair_each_dataset_prompt_with_its_answer():
    from omnidraft.bench.datasets import load_references

    pairs = load_references("gsm8k:train", 3)
    assert [p for p, _ in pairs] == load_prompts("gsm8k:train", 3)
    assert all(
        r.startswith(" ") and "<<" not in r and "####" in r for _, r in pairs
    )  # calculator notes removed
    prompt, solution = load_references("humaneval", 1)[0]
    assert prompt == load_prompts("humaneval", 1)[0] and "return" in solution
    with pytest.raises(ValueError, match="no reference answers for dataset 'mmlu'"):
        load_references("mmlu", 2)


def _ends(draft_tokenizer, target_tokenizer):
    from benchmarks.ngram_cache import TextEnd

    return TextEnd(draft_tokenizer, "tiny-draft"), TextEnd(target_tokenizer, "tiny-target")


def _reference_pairing(drafter_end, target_end, pairs, accuracy, strategy):
    import torch

    from benchmarks.ngram_cache import ReferenceDrafter, reference_traces
    from omnidraft.distill.trace_store import ReplayTarget
    from omnidraft.pairing import DecodeConfig, Pairing

    traces = reference_traces(target_end, pairs)
    oracle = ReferenceDrafter(
        drafter_end, dict(pairs), accuracy=accuracy, generator=torch.Generator().manual_seed(0)
    )
    return Pairing(
        oracle,
        ReplayTarget.like(target_end, traces),
        DecodeConfig(k=4, strategy=strategy, stop_confidence=0.0, drafts="model"),
    ), traces


@pytest.mark.parametrize("accuracy", [1.0, 0.5])
def test_reference_drafter_spells_the_reference_and_errs_at_its_rate(
    draft_tokenizer, target_tokenizer, accuracy
):
    """The engine commits the reference answer whatever the drafter does; a drafter that is always
    right has (almost) every re-tokenized draft accepted, one right half the time far fewer."""
    from omnidraft.bench.datasets import load_references

    pairs = load_references("gsm8k:train", 4)
    pair, traces = _reference_pairing(*_ends(draft_tokenizer, target_tokenizer), pairs, accuracy, "text")
    proposed = accepted = 0
    for (prompt, reference), trace in zip(pairs, traces):
        out = pair.generate(prompt, max_new_tokens=len(trace.continuation) - 1)
        assert out.token_ids == trace.continuation[: len(out.token_ids)] and reference.startswith(out.text)
        proposed += sum(r.proposed for r in out.rounds)
        accepted += sum(r.accepted for r in out.rounds)
    assert accepted / proposed > 0.9 if accuracy == 1.0 else accepted / proposed < 0.6


def test_cache_bench_rows_are_paired_and_reproducible(draft_tokenizer, target_tokenizer):
    from benchmarks.ngram_cache import markdown, run_cache_bench

    drafter_end, target_end = _ends(draft_tokenizer, target_tokenizer)
    run = lambda: run_cache_bench(drafter_end, target_end, dataset="gsm8k:train", n=30, k=4, accuracy=0.8)  # noqa: E731
    first = run()
    assert [(r["cache"].split(" ")[0], r.get("policy")) for r in first["rows"]] == [
        ("none", None),
        ("full", None),
        ("quarter", "lfu"),
        ("quarter", "lfu-da"),
        ("quarter", "lru"),
    ]
    none, full = first["rows"][0], first["rows"][1]
    assert full["tau"] >= none["tau"] and full["ngram_hits_per_round"] > none["ngram_hits_per_round"]
    assert run()["rows"] == first["rows"]  # the drafter's errors are drawn once, from the seed
    assert "| quarter" in markdown(first) and "lfu-da" in markdown(first)
    best = first["offline_optimum"][
        "uses_kept"
    ]  # knowing the future serves at least what the policies did (an
    # estimate in general: a smaller cache drafts differently, so its sequence of uses is not the full one's)
    assert (
        full["uses_kept"] == 1.0
        and all(best >= r["uses_kept"] - 1e-9 for r in first["rows"][2:])
        and "Belady" in markdown(first)
    )


def test_the_offline_optimum_evicts_what_is_next_used_furthest_ahead():
    from benchmarks.ngram_cache import offline_optimum

    a, b, c = (1, 2), (3, 4), (5, 6)
    add, use = (lambda k: (False, k)), (lambda k: (True, k))  # noqa: E731
    # one slot: keep a (used twice soon), not c (added between, used once late), then b is never back
    events = [add(a), add(c), use(a), use(a), add(b), use(c)]
    assert offline_optimum(events, 1) == 2 / 3  # a's two uses; c was not worth its slot over a
    assert offline_optimum(events, 2) == 1.0 and offline_optimum(events, 0) == 0.0
    assert offline_optimum([add(a), add(b)], 1) is None  # no use to serve
    # LRU with one slot would have evicted a for c and hit nothing


def test_default_against_fixed_k_pairs_every_prompt(tiny_drafter, tiny_target):
    from omnidraft.bench.runner import default_against_fixed_k

    prompts = [p[:60] for p in load_prompts("gsm8k", 3)]
    res = default_against_fixed_k(tiny_drafter, tiny_target, prompts, 10, [2, 4])
    assert [r["variant"] for r in res["rows"]] == ["default", "k=2", "k=4"]
    assert all(r["identical"] == 3 for r in res["rows"]) and res["best_fixed"] in ("k=2", "k=4")
    assert (
        res["default_vs_best"]["prompts"] == 3
        and res["default_vs_best"]["low"] <= res["default_vs_best"]["ratio"]
    )
    with pytest.raises(ValueError, match="draft lengths >= 1"):
        default_against_fixed_k(tiny_drafter, tiny_target, prompts, 10, [0])


def test_server_rounds_time_a_round_and_the_targets_own_step_per_context(tiny_target):
    """`python -m benchmarks server-rounds`: per context, the server's time per verify round and the
    target alone's time per decoded token (the floor a round's growth with context is read against)."""
    from benchmarks.server_rounds import round_times

    rows = round_times(tiny_target, [20, 60], rounds=3)
    assert [r["context"] for r in rows] == [20, 60]
    assert all(r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["step_ms"] > 0 for r in rows)


def test_the_hybrid_is_paired_against_model_drafts_and_the_fastest_other_row():
    from omnidraft.bench.sources import RELAXED_ROW, hybrid_against, markdown

    def row(variant, seconds, **extra):
        return {
            "variant": variant,
            "prompt_s": seconds,
            "tok_s": 2 / sum(seconds),
            "speedup": 1.0,
            "tau": 1.0,
            "identical": 2,
            "prompts": 2,
            **extra,
        }

    rows = [
        row("omnidraft model", [2.0, 2.0]),
        row("omnidraft retrieval", [1.1, 1.1]),
        row("omnidraft hybrid", [1.0, 1.2]),
        row("lookup", [1.05, 1.0], label="HF prompt lookup (10)"),
        row(RELAXED_ROW, [0.1, 0.1]),
    ]
    paired = hybrid_against(rows)
    assert (
        paired["best_other"] == "HF prompt lookup (10)"
    )  # the fastest lossless rival; the lossy row is none
    assert paired["hybrid_vs_best"]["ratio"] == pytest.approx((1.05 / 1.0 * 1.0 / 1.2) ** 0.5)
    assert paired["hybrid_vs_model"]["ratio"] == pytest.approx((2.0 / 1.0 * 2.0 / 1.2) ** 0.5)
    assert hybrid_against([r for r in rows if r["variant"] != "omnidraft hybrid"]) == {}
    text = markdown({"datasets": {"rag": {"target_tok_s": 1.0, "rows": rows, **paired}}})
    assert "hybrid vs the fastest other row (HF prompt lookup (10)), paired: 0.935×" in text


def test_the_paired_before_after_report_gives_a_median_ratio_and_checks_outputs():
    """benchmarks/paired.py's report: per prompt, the before tree's seconds over the after tree's
    (median of repeats); a prompt whose outputs differ is counted against "outputs identical"."""
    import argparse

    from benchmarks.paired import report

    def run(seconds: list[float], ids: list[list[int]]) -> list[dict]:
        return [
            {"workload": "w", "prompt": i, "seconds": s, "ids": x}
            for i, (s, x) in enumerate(zip(seconds, ids))
        ]

    same = [[1, 2], [3, 4], [5, 6]]
    runs = {
        "before": [run([2.0, 2.0, 2.0], same), run([2.0, 2.0, 2.0], same)],
        "after": [run([1.0, 1.0, 1.0], same), run([1.0, 1.0, 1.0], [[1, 2], [3, 4], [9]])],
    }
    args = argparse.Namespace(
        pair="a:b", engine="torch", n=3, max_new_tokens=2, repeats=2, workload=["w"], k=0
    )
    row = report(runs, args).splitlines()[-1]
    assert row.startswith("| w | 1.00 | 2.00 | 2.000 | 2.000-2.000 | 2/3 |"), row


def test_vllm_bench_repeats_take_each_requests_median_and_check_every_run():
    """`bench --target-backend vllm --repeats N`: each row's engine ran the prompts N times over;
    a request's seconds are the median of its runs (one run on this host moves 5-20%), and it is
    identical only if every run gave vLLM alone's output."""
    from omnidraft.bench.vllm import ENGINES, per_request

    alone, ours = ENGINES[0], ENGINES[1]
    outputs = {
        alone: [{"s": [([1, 2, 3], 2.0)]}, {"s": [([1, 2, 3], 4.0)]}, {"s": [([1, 2, 3], 3.0)]}],
        ours: [{"s": [([1, 2, 3], 1.0)]}, {"s": [([1, 2], 9.0)]}, {"s": [([1, 2, 4], 1.5)]}],
    }
    rows = {r["row"]: r for r in per_request(outputs, {"s": 1})["s"]}
    assert rows[alone]["seconds"] == 3.0 and rows[alone]["runs"] == [2.0, 4.0, 3.0]
    assert rows[alone]["identical"]
    assert rows[ours]["seconds"] == 1.5 and rows[ours]["tokens"] == 3
    assert not rows[ours]["identical"]  # its third run differed
    outputs[ours][2] = {"s": [([1, 2, 3], 1.5)]}
    again = {r["row"]: r for r in per_request(outputs, {"s": 1})["s"]}
    assert again[ours]["identical"]  # its second run, shorter, stopped early: compared as far as it goes


def test_timed_rows_take_turns_running_first_and_compare_with_the_first_row():
    """bench/llama.time_rows: each round of rows starts one row later than the last, so no row
    always runs first; the first row's output stays every prompt's reference."""
    from omnidraft.bench.baselines import Timed
    from omnidraft.bench.llama import time_rows

    order = []

    def row(name, ids):
        def run(prompt, _ids):
            order.append(name)
            return Timed(ids, 0.1)

        return run

    rows = {"alone": row("alone", [1, 2, 3]), "a": row("a", [1, 2, 3]), "b": row("b", [1, 2, 9])}
    refs: list[list[int]] = []
    results = time_rows(rows, ["p", "q"], lambda _: {"input_ids": [0]}, lambda _: None, refs, repeats=2)
    assert order == [*"alone a b".split(), *"a b alone".split(), *"b alone a".split(), *"alone a b".split()]
    assert refs == [[1, 2, 3], [1, 2, 3]]
    assert [r["identical"] for r in results if r["prompt"] == 0] == [True, True, False]
    assert all(len(r["runs"]) == 2 for r in results)


def test_the_data_is_found_from_a_checkout_the_user_is_in_and_the_error_names_where_it_looked(
    tmp_path, monkeypatch
):
    """A package installed outside the checkout (the README's by-hand install) reads the prompts
    the demo and bench use from its own copy anywhere, and finds the checkout's data/ (the lab's
    train split) from the working directory or one below it; elsewhere the error says where it
    looked and what to do."""
    from omnidraft.bench import datasets

    monkeypatch.delenv("OMNIDRAFT_DATA", raising=False)
    monkeypatch.setattr(datasets, "REPO_DATA", tmp_path / "site-packages" / "data")
    monkeypatch.chdir(tmp_path)
    for workload in ("gsm8k", "humaneval", "mixed", "summarize", "rag", "code-edit", "chat"):
        assert len(load_prompts(workload, 2)) == 2, workload
    with pytest.raises(FileNotFoundError, match="gsm8k/train.jsonl is not in the package .* OMNIDRAFT_DATA"):
        load_prompts("gsm8k:train", 1)
    with pytest.raises(FileNotFoundError, match="site-packages/data nor under .* OMNIDRAFT_DATA"):
        datasets.data_dir()
    checkout = tmp_path / "omnidraft"
    (checkout / "data" / "gsm8k").mkdir(parents=True)
    (checkout / "data" / "gsm8k" / "train.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    (checkout / "examples").mkdir()
    monkeypatch.chdir(checkout / "examples")
    assert datasets.data_dir() == (checkout / "data").resolve()
    assert load_prompts("gsm8k:train", 5) == ["Question: q\nAnswer: Let's think step by step."]
