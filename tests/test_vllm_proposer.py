"""omnidraft's proposer inside vLLM's speculative step (targets/vllm_proposer.py), without an
engine: which batch row holds which announced request, rows of other requests, a failing drafter,
and the engine rounds (engine_proposals.py) settling verdicts inferred from the committed ids."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from omnidraft.targets.vllm_proposer import EngineProposer, proposer_config


def _proposer(k: int = 4, max_len: int = 64) -> EngineProposer:
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_len),
    )
    return EngineProposer(config)


class Echo:
    """Rounds that propose the next `n` integers after the last id, and remember their calls."""

    def __init__(self, n: int = 3) -> None:
        self.n, self.opened, self.seen = n, None, []

    def open(self, ids, drafter_ids=None):
        self.opened = (list(ids), drafter_ids)

    def prepare(self, ids):
        self.prepared = list(ids)

    def next(self, ids, limit, remaining):
        self.seen.append(list(ids))
        return [ids[-1] + 1 + i for i in range(self.n)][:limit]


def _batch(*rows: list[int], width: int = 64) -> tuple[np.ndarray, np.ndarray]:
    table = np.zeros((len(rows), width), dtype=np.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return np.array([len(r) for r in rows]), table


def test_the_config_names_this_proposer_for_vllm():
    config = proposer_config(6)
    assert config["method"] == "custom_class" and config["num_speculative_tokens"] == 6
    module, name = config["model"].rsplit(".", 1)
    assert getattr(__import__(module, fromlist=[name]), name) is EngineProposer


def test_rows_find_their_announced_request_even_when_the_batch_is_reordered():
    proposer = _proposer()
    a, b = Echo(), Echo(2)
    proposer.expect([10, 11], a, max_tokens=20, drafter_ids=[7])
    proposer.expect([50, 51, 52], b, max_tokens=20)
    n, table = _batch([99, 98, 97], [10, 11, 12], [50, 51, 52, 53])  # row 0: another request
    assert proposer.propose([[97], [12], [53]], n, table) == [[], [13, 14, 15], [54, 55]]
    assert a.opened == ([10, 11], [7]) and a.seen == [[10, 11, 12]]
    # the batch was condensed: b now in row 0, a in row 1, each with its newly committed ids
    n, table = _batch([50, 51, 52, 53, 54, 60], [10, 11, 12, 13, 20])
    assert proposer.propose([[54, 60], [13, 20]], n, table) == [[61, 62], [21, 22, 23]]
    assert b.seen[-1] == [50, 51, 52, 53, 54, 60] and a.seen[-1] == [10, 11, 12, 13, 20]


def test_no_draft_past_the_engine_k_the_request_budget_or_after_it_is_forgotten():
    proposer = _proposer(k=2)
    rounds = Echo(5)
    seq = proposer.expect([1, 2], rounds, max_tokens=3)
    n, table = _batch([1, 2, 3])
    assert proposer.propose([[3]], n, table) == [[4]]  # k = 2, but only 2 more tokens may come: 1 draft
    proposer.forget(seq)
    n, table = _batch([1, 2, 3, 4])
    assert proposer.propose([[4]], n, table) == [[]]


def test_a_failing_drafter_proposes_nothing_from_then_on_and_the_engine_goes_on():
    class Broken(Echo):
        def next(self, ids, limit, remaining):
            raise RuntimeError("drafter gone")

    proposer = _proposer()
    proposer.expect([5], Broken(), max_tokens=10)
    n, table = _batch([5, 6])
    assert proposer.propose([[6]], n, table) == [[]]
    n, table = _batch([5, 6, 7])
    assert proposer.propose([[7]], n, table) == [[]]


def test_a_row_without_sampled_tokens_gets_no_draft():
    proposer = _proposer()
    proposer.expect([5], Echo(), max_tokens=10)
    n, table = _batch([5, 6])
    assert proposer.propose([[]], n, table) == [[]]  # a prefill chunk: nothing sampled yet
