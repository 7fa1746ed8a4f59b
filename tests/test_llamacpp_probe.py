"""The llama.cpp engine's batch-exactness probe by context, on a fake engine (no model): its grid,
where it stops, and what it gives past the last context it probed."""

from __future__ import annotations

from types import SimpleNamespace

from omnidraft.llamacpp import engine as llama_engine
from omnidraft.llamacpp.engine import LlamaEngine


def fake(rows_by_context: dict[int, int], n_ctx: int = 4096) -> SimpleNamespace:
    probed: list[int] = []

    def probe(prompt: list[int]) -> int:
        probed.append(len(prompt))
        return rows_by_context.get(len(prompt), 3)

    return SimpleNamespace(
        tokenize=lambda text: list(range(len(text))),
        n_ctx=n_ctx,
        reset=lambda: None,
        _probe_exact_rows=probe,
        probed=probed,
    )


def test_every_context_is_probed_within_the_budget_and_a_failing_one_ends_it():
    engine = fake({512: 1})
    limits = LlamaEngine._probe_limits(engine)
    assert engine.probed == [24, 128, 248, 256, 512]
    assert limits == [[128, 3], [248, 3], [256, 3]]  # 256..512: the lower end, 1: left out


def test_past_the_budget_the_probe_stops_and_longer_contexts_read_one_token_a_call(monkeypatch):
    monkeypatch.setattr(llama_engine, "PROBE_BUDGET_S", -1.0)  # spent after the first context
    engine = fake({})
    limits = LlamaEngine._probe_limits(engine)
    assert engine.probed == [24] and limits == [[24, 3]]
    rows_at = LlamaEngine.rows_at
    assert rows_at(SimpleNamespace(exact_limits=[(24, 3)]), 24) == 3
    assert rows_at(SimpleNamespace(exact_limits=[(24, 3)]), 25) == 1
