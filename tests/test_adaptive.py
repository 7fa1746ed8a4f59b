"""adaptive/policy.py: the hysteresis fallback, and greedy identity with adaptive drafting on."""

from __future__ import annotations

import math
import statistics

import pytest

import omnidraft as od
from omnidraft.adaptive.policy import Acceptance, CostPolicy, Hysteresis

from .conftest import target_greedy
from .fakes import OracleDrafter
from .test_pairing import PROMPTS


def test_grows_slowly_and_shrinks_at_once():
    p = Hysteresis(k_min=2, k_max=8)
    assert p.next_k(4, proposed=4, accepted=4) == 5
    assert p.next_k(8, proposed=8, accepted=8) == 8
    assert p.next_k(7, proposed=7, accepted=2) == 3
    assert p.next_k(7, proposed=7, accepted=0) == 2
    assert p.next_k(5, proposed=0, accepted=0) == 5
    with pytest.raises(ValueError, match="k_min <= k_max"):
        Hysteresis(k_min=5, k_max=3)


def test_greedy_identity_with_adaptive_drafting(tiny_drafter, tiny_target):
    pair = tiny_drafter.pair(tiny_target, k=3, adaptive=Hysteresis(k_min=1, k_max=10))
    for prompt in PROMPTS[:4]:
        assert pair.generate(prompt, max_new_tokens=24).token_ids == target_greedy(tiny_target, prompt, 24)


def test_draft_length_grows_under_full_acceptance(tiny_target):
    ref = target_greedy(tiny_target, PROMPTS[0], 60)
    config = od.DecodeConfig(k=2, strategy="ngram", adaptive=Hysteresis(k_min=2, k_max=9))
    out = od.Pairing(OracleDrafter(tiny_target, ref), tiny_target, config).generate(
        PROMPTS[0], max_new_tokens=60
    )
    assert out.token_ids == ref
    assert [r.drafted for r in out.rounds[:5]] == [2, 3, 4, 5, 6]


# -- acceptance head (adaptive/acceptance_head.py, adaptive/head_trainer.py) ---------------------------

import torch  # noqa: E402

from omnidraft.adaptive.acceptance_head import (  # noqa: E402
    EXTRA_FEATURES,
    AcceptanceHead,
    HeadConfig,
    Stopper,
    confidence_features,
)
from omnidraft.adaptive.costs import CostModel, _line  # noqa: E402
from omnidraft.adaptive.head_trainer import HeadTrainer, round_labels  # noqa: E402
from omnidraft.store.profiles import ProfileStore  # noqa: E402


class FixedHead(AcceptanceHead):
    """Returns preset acceptance probabilities, one per call, whatever the features."""

    def __init__(self, probs):
        super().__init__(hidden_size=3, width=4, depth=1)
        self.queue = list(probs)

    def forward(self, features):
        p = torch.tensor([self.queue.pop(0) for _ in range(len(features))])
        return torch.log(p) - torch.log1p(-p)


def _draft(stopper, n):
    """Feed n tokens; return how many were drafted before the rule stopped."""
    stopper.reset()
    for j in range(n):
        if stopper.stop_after(j, 0, torch.zeros(5), torch.zeros(3)):
            return j + 1
    return n


def test_head_outputs_probabilities_with_distinct_layers():
    head = AcceptanceHead(hidden_size=16, width=8, depth=3)
    p = head.prob(torch.randn(50, 16 + EXTRA_FEATURES) * 10)
    assert p.shape == (50,) and bool(((p >= 0) & (p <= 1)).all())
    weights = [layer.weight for layer in head.layers]
    assert len(weights) == 3 and len({w.data_ptr() for w in weights}) == 3


def test_a_seeded_head_is_reproducible_and_leaves_the_global_rng_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    a, b = AcceptanceHead(16, 8, 2, seed=7), AcceptanceHead(16, 8, 2, seed=7)
    assert torch.equal(torch.rand(4), expected)  # the caller's random stream is where it was
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(AcceptanceHead(16, 8, 2, seed=8).layers[0].weight, a.layers[0].weight)


@pytest.mark.parametrize(
    "probs, gamma, k_min, k_max, stops_at",
    [
        ([0.9, 0.9, 0.9, 0.5, 0.9], 0.5, 1, 8, 4),  # 1 - .9^3 = .271, 1 - .9^3*.5 = .636 > .5
        ([0.9, 0.9, 0.9, 0.5, 0.9, 0.9], 0.7, 1, 8, 6),  # 1 - .9^4*.5 = .672 < .7; then .705 > .7
        ([0.1, 0.9, 0.9], 0.5, 2, 8, 2),  # would stop at 1 but k_min = 2
        ([0.99] * 10, 0.5, 1, 6, 6),  # k_max bounds a confident draft
    ],
)
def test_stopping_rule_is_eq_6_7(probs, gamma, k_min, k_max, stops_at):
    config = HeadConfig(gamma=gamma, k_min=k_min, k_max=k_max)
    stopper = Stopper(FixedHead(probs), config, direct=torch.ones(5, dtype=torch.bool))
    assert _draft(stopper, len(probs)) == stops_at


def test_cost_aware_threshold_is_the_marginal_rate_rule():
    cost = CostModel(decay=0.0)
    cost.observe(drafted=1, t_draft=0.05, verified=1, t_verify=0.30)
    cost.observe(drafted=1, t_draft=0.05, verified=5, t_verify=0.50)
    assert cost.verify_cost(3) == pytest.approx(0.40) and cost.verify_cost(7) == pytest.approx(0.60)
    stopper = Stopper(FixedHead([0.8]), HeadConfig(gamma="cost"), torch.ones(5, dtype=torch.bool), cost)
    stopper.stop_after(0, 0, torch.zeros(5), torch.zeros(3))
    # after one token: E[tau] = 1 + 0.8; cost 0.05 + V(2) = 0.35; one more costs 0.05 + 0.05
    rate = 1.8 / (0.05 + 0.35)
    assert stopper.threshold(1, 0.8) == pytest.approx(1 - rate * 0.10 / 0.8)


def test_cost_model_separates_the_rounds_fixed_cost_from_the_marginal_ones():
    """Drafting n tokens costs a catch-up forward (40 ms) plus 25 ms a token: the marginal cost of a
    drafted token is 25 ms, not the 45 ms a 2-token round averages. A verification curve with a
    lumpy step (V(3) = V(2)) still gets its fitted slope as the cost of one more token."""
    cost = CostModel(decay=0.0)
    for n, v in [(2, 0.41), (4, 0.46), (6, 0.52)]:
        cost.observe(drafted=n, t_draft=0.040 + 0.025 * n, verified=n + 1, t_verify=v, t_other=0.002)
    cost.observe(drafted=2, t_draft=0.090, verified=2, t_verify=0.41, t_other=0.002)
    assert cost.draft == pytest.approx(0.025) and cost.overhead == pytest.approx(0.042)
    assert cost.verify_cost(2) == cost.verify_cost(3) == pytest.approx(0.41)
    assert 0.02 < cost.verify_slope < 0.03
    stopper = Stopper(FixedHead([0.7, 0.7]), HeadConfig(gamma="cost"), torch.ones(5, dtype=torch.bool), cost)
    for n in range(2):
        stopper.stop_after(n, 0, torch.zeros(5), torch.zeros(3))
    rate = (1 + 0.7 + 0.49) / (0.042 + 2 * 0.025 + cost.verify_cost(3))
    assert stopper.threshold(2, 0.7) == pytest.approx(1 - rate * (0.025 + cost.verify_slope) / 0.7)


def test_verify_costs_never_fall_with_more_tokens():
    """Noisy rounds measured V(6) and V(8) below V(4): verifying more tokens cannot cost less, so a
    falling run is pooled into its weighted mean and long drafts do not look cheaper than short."""
    cost = CostModel(decay=0.0, fade=1.0)
    for m, v in [(1, 0.089), (2, 0.134), (4, 0.176), (4, 0.176), (6, 0.171), (8, 0.169)]:
        cost.observe(drafted=max(1, m - 1), t_draft=0.01 * m, verified=m, t_verify=v)
    assert cost.verify_cost(1) == pytest.approx(0.089) and cost.verify_cost(2) == pytest.approx(0.134)
    pooled = (2 * 0.176 + 0.171 + 0.169) / 4
    assert cost.verify_cost(4) == cost.verify_cost(6) == cost.verify_cost(8) == pytest.approx(pooled)
    assert cost.verify_cost(3) == pytest.approx((0.134 + pooled) / 2)
    costs = [cost.verify_cost(m) for m in range(1, 12)]
    assert costs == sorted(costs)


def test_cost_lines_weigh_lengths_by_how_often_and_how_lately_they_were_seen():
    """The policy drafts 4-6 tokens every round (verify = 0.15 + 0.006 m); two early rounds, while
    the machine was busy, verified 2 and 12 tokens slowly. Unweighted, those two stale points set
    the slope (23 ms) for good; weighted by use, after 100 rounds the fit follows the rounds that
    happen (6 ms)."""
    cost = CostModel(decay=0.0)
    cost.observe(drafted=1, t_draft=0.06, verified=2, t_verify=0.12)
    cost.observe(drafted=11, t_draft=0.40, verified=12, t_verify=0.35)
    for i in range(100):
        n = 4 + i % 3
        cost.observe(drafted=n, t_draft=0.030 + 0.025 * n, verified=n + 1, t_verify=0.15 + 0.006 * (n + 1))
    assert cost.verify_slope == pytest.approx(0.006, abs=0.001)
    assert cost.draft == pytest.approx(0.025, abs=0.002)
    even = {x: 1.0 for x in cost.verify}
    assert _line(cost.verify, even)[1] > 0.02  # what the unweighted fit would charge


def test_round_overhead_includes_what_happens_between_rounds(tiny_drafter, tiny_target):
    """A caller that takes 30 ms over each streamed piece makes every round 30 ms dearer; the cost
    model must see it, or it would rate short drafts (more rounds) too cheap."""
    import time

    pair = tiny_drafter.pair(tiny_target, k=2)
    for _piece in pair.stream(PROMPTS[0], max_new_tokens=24):
        time.sleep(0.03)
    assert len(pair.last.rounds) >= 4
    assert pair.speculator.cost.overhead >= 0.025


def test_cost_model_rejects_bad_settings():
    with pytest.raises(ValueError, match="fade"):
        CostModel(fade=0.0)
    with pytest.raises(ValueError, match="decay"):
        CostModel(decay=1.0)


def test_cost_model_with_one_length_seen_charges_the_mean_per_token():
    cost = CostModel()
    cost.observe(drafted=4, t_draft=0.12, verified=5, t_verify=0.3)
    assert cost.draft == pytest.approx(0.03) and cost.overhead == 0.0 and not cost.ready


def test_round_labels_and_trainer_learns_a_separable_rule():
    assert round_labels(5, 2).tolist() == [1, 1, 0] and round_labels(3, 3).tolist() == [1, 1, 1]
    torch.manual_seed(0)
    head = AcceptanceHead(hidden_size=8, width=16, depth=2)
    trainer = HeadTrainer(head, HeadConfig(train="interleaved", steps=200, lr=1e-2))
    low_entropy = 8 + 1  # the entropy feature's column
    for _ in range(
        60
    ):  # accepted while the entropy feature is < 0: kept up to the first token where it is not
        x = torch.randn(6, 8 + EXTRA_FEATURES)
        rejected = (x[:, low_entropy] >= 0).nonzero()
        trainer.add(x, int(rejected[0]) if len(rejected) else 6)
    trainer.update()
    x = torch.randn(400, 8 + EXTRA_FEATURES)
    assert trainer.evaluate(x, (x[:, low_entropy] < 0).float())["accuracy"] > 0.9


@pytest.mark.parametrize("schedule", ["interleaved", "joint"])
def test_trained_head_is_calibrated_despite_the_class_weights(schedule):
    """The cost-aware rule multiplies probabilities, so they must be calibrated: on rows where 80% of
    tokens are accepted whatever their features, the head predicts ~0.8, not the ~0.5 the
    class-weighted loss alone would push it to."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    head = AcceptanceHead(hidden_size=8, width=16, depth=2)
    trainer = HeadTrainer(head, HeadConfig(train=schedule, steps=40, lr=1e-2))
    for _ in range(40):
        x = torch.randn(256, 8 + EXTRA_FEATURES, generator=gen)
        trainer.add_rows(x, (torch.rand(256, generator=gen) < 0.8).float())
        trainer.update()
    p = head.prob(torch.randn(2000, 8 + EXTRA_FEATURES, generator=gen))
    assert head.prior_shift.item() == pytest.approx(math.log(0.2 / 0.8), abs=0.05)  # log(w+/w-)
    assert float(p.mean()) == pytest.approx(0.8, abs=0.05)


def test_a_head_saved_before_the_calibration_shift_still_loads():
    head = AcceptanceHead(hidden_size=8, width=4, depth=1)
    old = {k: v for k, v in head.state_dict().items() if k != "prior_shift"}
    fresh = AcceptanceHead(hidden_size=8, width=4, depth=1)
    fresh.load_state_dict(old)
    assert fresh.prior_shift.item() == 0.0


def test_an_untrained_head_predicts_the_drafters_own_probability():
    """Before any training the head is the drafter's confidence: its calibration path starts as
    logit(q) and its MLP's output layer at zero."""
    head = AcceptanceHead(hidden_size=8, width=4, depth=2, seed=0)
    x = torch.randn(50, 8 + EXTRA_FEATURES)
    x[:, 8 + 2] = q = torch.linspace(0.01, 0.99, 50)
    assert torch.allclose(head.prob(x), q, atol=1e-5)


def test_a_new_class_weighting_shift_leaves_the_calibrated_probabilities_alone():
    head = AcceptanceHead(hidden_size=8, width=4, depth=2, seed=0)
    torch.nn.init.normal_(head.out.weight, generator=torch.Generator().manual_seed(1))
    x = torch.randn(30, 8 + EXTRA_FEATURES, generator=torch.Generator().manual_seed(2))
    x[:, 8 + 2] = x[:, 8 + 2].sigmoid()
    before = head.prob(x)
    head.shift_prior(-1.2)
    assert head.prior_shift.item() == pytest.approx(-1.2)
    assert torch.allclose(head.prob(x), before, atol=1e-6)


def test_a_head_saved_before_the_calibration_path_loads_as_its_mlp_alone():
    head = AcceptanceHead(hidden_size=8, width=4, depth=1, seed=0)
    torch.nn.init.normal_(head.out.weight, generator=torch.Generator().manual_seed(1))
    old = {k: v for k, v in head.state_dict().items() if not k.startswith("calibration")}
    fresh = AcceptanceHead(hidden_size=8, width=4, depth=1)
    fresh.load_state_dict(old)
    x = torch.randn(10, 8 + EXTRA_FEATURES, generator=torch.Generator().manual_seed(2))
    x[:, 8 + 2] = x[:, 8 + 2].sigmoid()
    with torch.no_grad():
        mlp_alone = head(x) - head.calibration(confidence_features(x[:, 8:])).squeeze(-1)
        assert torch.allclose(fresh(x), mlp_alone, atol=1e-6)


@pytest.mark.parametrize("schedule", ["interleaved", "joint"])
def test_greedy_identity_with_a_learning_head(tiny_drafter, tiny_target, tmp_path, schedule):
    head = HeadConfig(train=schedule, interval=1, warmup=20, k_max=8, steps=10)
    pair = tiny_drafter.pair(tiny_target, k=3, head=head, user="u", store=ProfileStore(tmp_path))
    for prompt in PROMPTS[:5]:
        assert pair.generate(prompt, max_new_tokens=24).token_ids == target_greedy(tiny_target, prompt, 24)
    assert pair.head_ready and pair.head_trainer.steps > 0
    assert any("head_loss" in m for m in pair.metrics)


def test_head_saves_loads_and_switches_with_the_target(tiny_drafter, tiny_target, target_tokenizer, tmp_path):
    from omnidraft import LocalTarget

    from .conftest import tiny_llama

    store = ProfileStore(tmp_path)
    config = HeadConfig(interval=1, warmup=10)
    a = tiny_drafter.pair(tiny_target, k=3, head=config, user="u", store=store)
    for prompt in PROMPTS[:3]:
        a.generate(prompt, max_new_tokens=16)
    a.save()
    other = LocalTarget(
        tiny_llama(len(target_tokenizer), seed=5, logit_scale=30.0), target_tokenizer, "tiny-other"
    )
    b = tiny_drafter.pair(other, k=3, head=config, user="u", store=store)
    assert b.head is not a.head and not b.head_ready  # a new target starts on the fallback
    again = tiny_drafter.pair(tiny_target, k=3, head=config, user="u", store=store)
    assert again.head_ready and again.head_trainer.trained == a.head_trainer.trained
    for key, value in a.head.state_dict().items():
        assert torch.equal(value, again.head.state_dict()[key]), key
    with pytest.raises(ValueError, match="does not fit"):
        tiny_drafter.pair(tiny_target, k=3, head=HeadConfig(width=7), user="u", store=store)


def test_bench_draft_trains_both_heads_once_and_compares_policies(tiny_drafter, tiny_target, tmp_path):
    from benchmarks.draft_lengths import run_draft_policies, write_draft_report

    kwargs = dict(
        dataset="gsm8k",
        train="gsm8k:train",
        n=2,
        n_train=3,
        max_new_tokens=12,
        train_tokens=12,
        fixed=[2, 4],
        confident=[4],
        k_max=6,
        cache=tmp_path,
    )
    assert run_draft_policies(tiny_drafter, tiny_target, train_only=True, **kwargs) is None
    heads = sorted(p.name for p in tmp_path.glob("head-*"))
    assert (
        len(heads) == 3
        and heads[0].endswith("interleaved.safetensors")
        and heads[1].endswith("joint.safetensors")
    )
    result = run_draft_policies(tiny_drafter, tiny_target, **kwargs)  # the cached heads are used
    score = result["head_scores"]["joint"]  # scored online, each request before training on it
    assert score["rows"] > 0 and 0 <= score["mean_prob"] <= 1 and score["bce"] > 0
    assert result["head_scores"]["interleaved"]["rows"] == 0  # 3 requests: it first trains after the 4th
    names = [r["variant"] for r in result["rows"]]
    assert names == [
        "fixed k=2",
        "fixed k=4",
        "confidence stop, k≤4",
        "fallback (hysteresis)",
        "head (joint)",
        "head (interleaved)",
    ]
    assert all(r["identical"] == 2 and len(r["prompt_s"]) == 2 for r in result["rows"])
    versus = result[
        "against_best_fixed"
    ]  # every policy that picks its own length, against the fastest fixed k
    assert versus["best_fixed"] in ("fixed k=2", "fixed k=4") and sorted(versus["adaptive"]) == sorted(
        names[2:]
    )
    table = write_draft_report([{"pair": "tiny", **result}], tmp_path, "draft")
    assert "head (joint)" in table and "BCE of the mean rate" in table and "paired per prompt" in table


def test_paired_ratio_is_the_geometric_mean_time_ratio_with_a_t_interval():
    from omnidraft.bench.runner import paired_ratio

    c = paired_ratio([1.0, 2.0, 1.0], [1.2, 2.2, 1.3])  # per prompt 1.2, 1.1, 1.3 times slower
    assert c["ratio"] == pytest.approx((1.2 * 1.1 * 1.3) ** (1 / 3)) and c["wins"] == 3 and c["prompts"] == 3
    logs = [math.log(x) for x in (1.2, 1.1, 1.3)]
    mean, sd = sum(logs) / 3, statistics.stdev(logs)
    assert c["low"] == pytest.approx(math.exp(mean - 4.30 * sd / math.sqrt(3)))  # t(0.975, df=2) = 4.30
    assert c["high"] == pytest.approx(math.exp(mean + 4.30 * sd / math.sqrt(3)))
    assert paired_ratio([1.0] * 40, [1.1] * 40)["low"] == pytest.approx(1.1)  # no spread: a point
    with pytest.raises(ValueError, match="same non-empty prompts"):
        paired_ratio([1.0], [1.0, 2.0])


def _costs(draft_ms: float, verify_ms: dict[int, float], other_ms: float = 0.5) -> CostModel:
    """A CostModel that has seen rounds of these costs (drafted 2..6 tokens, verified 1..13)."""
    cost = CostModel()
    for _ in range(4):
        for d in (2, 4, 6):
            cost.observe(d, d * draft_ms / 1000, 1, verify_ms[1] / 1000, other_ms / 1000)
        for m, v in verify_ms.items():
            cost.observe(3, 3 * draft_ms / 1000, m, v / 1000, other_ms / 1000)
    return cost


def _policy(cost: CostModel, accepted: int, proposed: int, drafted: int, **kw) -> CostPolicy:
    policy = CostPolicy(cost, **kw)
    for _ in range(10):
        policy.observe(drafted, proposed, accepted)
    return policy


VERIFY = {
    m: 20.0 + 4.0 * (m - 1) for m in range(1, 14)
}  # a target step of 20 ms, 4 ms per extra verified token


def test_cost_policy_drafts_long_when_drafts_are_cheap_and_accepted():
    policy = _policy(_costs(1.0, VERIFY), accepted=6, proposed=6, drafted=6)
    assert policy.next_k() >= 8 and policy.speculating
    assert policy.expected_tokens(0) == 1.0 and policy.rates()[policy.next_k()] > policy.rates()[0]


def test_cost_policy_stops_speculating_when_the_drafter_cannot_pay_and_probes_again():
    policy = _policy(_costs(30.0, VERIFY), accepted=1, proposed=4, drafted=4, probe_every=3)
    assert policy.next_k() == 0 and not policy.speculating
    for _ in range(3):
        policy.observe(0, 0, 0)  # rounds decoded by the target alone
    probe = policy.next_k()
    assert probe >= 1  # after probe_every idle rounds it drafts once to measure again
    policy.observe(probe, probe, 0)
    assert policy.next_k() == 0
    for _ in range(5):
        policy.observe(0, 0, 0)
    assert (
        policy.next_k() == 0 and policy.wait == 6
    )  # the probe did not pay: the next one waits twice as long
    policy.observe(0, 0, 0)
    assert policy.next_k() >= 1


def test_cost_policy_starts_at_its_start_and_measures_the_target_alone_once():
    assert CostPolicy(CostModel(), start=5).next_k() == 5
    cost = CostModel()
    for m in (3, 5, 4):
        cost.observe(2, 0.002, m, 0.02 + 0.004 * m)
    policy = CostPolicy(cost)
    policy.observe(2, 2, 2)
    assert policy.next_k() == 0  # V(1) was never measured: one round of the target alone
    cost.observe(0, 0.0, 1, 0.02)
    assert policy.next_k() >= 1


def test_acceptance_expects_what_drafts_that_are_right_or_wrong_from_the_start_commit():
    seen = Acceptance(0.9999)
    for accepted in (0, 4) * 5:  # half the drafts wrong from their first token, the rest right throughout
        seen.observe(4, accepted)
    assert seen.first == pytest.approx(0.5, abs=1e-3) and seen.then == 0.99
    # such rounds commit 1 or 5 tokens (3 on average) at k = 4, 1 or 2 at k = 1; one per-token rate
    # (20 accepted in 25 trials) would expect 3.36 and 1.8
    assert seen.expected(4) == pytest.approx(3.0, abs=0.05)
    assert seen.expected(1) == pytest.approx(1.5, abs=1e-3)
    slow = Acceptance(0.99)
    slow.observe(2, 0)  # a slow average is not held near its first round
    for _ in range(20):
        slow.observe(2, 2)
    assert slow.first > 0.9


def test_a_hard_stretch_does_not_keep_the_next_request_from_drafting():
    policy = CostPolicy(_costs(2.0, VERIFY))
    for _ in range(60):
        policy.observe(4, 4, 3)  # the long run: most of each draft accepted
    for _ in range(15):
        policy.observe(1, 1, 0)  # the end of one request: every draft rejected
    policy.observe(0, 0, 0)
    assert policy.next_k() == 0 and not policy.speculating
    policy.begin_request()
    assert policy.next_k() >= 2 and policy.speculating  # the next starts from the long run


def test_cost_policy_checks_its_arguments():
    with pytest.raises(ValueError, match="start <= k_max"):
        CostPolicy(CostModel(), start=9, k_max=4)
    with pytest.raises(ValueError, match="probe_every >= 1"):
        CostPolicy(CostModel(), probe_every=0)


@pytest.mark.parametrize("schedule", [[0], [0, 3, 0, 0, 5, 1], [4, 0]])
def test_rounds_that_do_not_speculate_keep_greedy_identity(tiny_drafter, tiny_target, schedule):
    from itertools import cycle

    from .conftest import target_greedy

    pair = tiny_drafter.pair(tiny_target)  # k=None: cost-driven
    assert pair.policy is not None
    lengths = cycle(schedule)
    pair.policy.next_k = lambda: next(lengths)
    prompt = "Question: Tom has 3 apples and buys 5 more. How many"
    out = pair.generate(prompt, max_new_tokens=24)
    assert out.token_ids == target_greedy(tiny_target, prompt, 24)
    assert any(r.drafted == 0 for r in out.rounds[1:])
    assert out.stats.speculating < 1.0 or schedule == [4, 0]
