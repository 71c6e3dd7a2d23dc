"""The adaptive speculation rule (refserve/spec_decode/adaptive.py), pinned."""

import numpy as np
import pytest

from refserve.metrics import expected_tokens_per_pass
from refserve.spec_decode import adaptive
from refserve.spec_decode.adaptive import (
    FLAT,
    AdaptiveSpeculation,
    PassCost,
    best_num_drafts,
    measure_pass_cost,
)

# A pass cost shaped like the measured ones: flat-ish to 8 rows, then growing with rows.
CPU_LIKE = PassCost((1, 2, 5, 8, 16, 40), (1.0, 1.2, 1.6, 1.8, 2.6, 5.0))


@pytest.mark.parametrize("overhead", [0.0, 0.5, 1.5])
def test_best_num_drafts_is_the_argmax_of_tokens_per_cost(overhead):
    for alpha in [0.0, 0.05, 0.2, 0.5, 0.8, 0.95, 1.0]:
        for cost in [0.0, 0.1, 0.3, 1.0]:
            k = 6
            rates = [1.0] + [expected_tokens_per_pass(alpha, kk) / (1 + overhead + kk * cost)
                             for kk in range(1, k + 1)]
            best = best_num_drafts(alpha, k, cost, lambda n: 1 + overhead)
            assert rates[best] == pytest.approx(max(rates))
            assert all(rates[kk] < rates[best] - 1e-12 for kk in range(best))  # smallest


def test_k_shrinks_with_acceptance_and_with_draft_cost():
    for ratio in (lambda n: 1.0, lambda n: CPU_LIKE.ratio(1, n)):
        ks = [best_num_drafts(a / 20, 5, 0.1, ratio) for a in range(21)]
        assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 5
    assert best_num_drafts(0.7, 5, 0.5) < best_num_drafts(0.7, 5, 0.1)
    # break-even of one draft with a flat pass: 1 + α > 1 + c  <=>  α > c
    assert best_num_drafts(0.09, 5, 0.1) == 0 and best_num_drafts(0.12, 5, 0.1) >= 1
    # a costlier verify pass raises the acceptance speculation needs
    assert best_num_drafts(0.5, 5, 0.05) > 0 == best_num_drafts(0.5, 5, 0.05, lambda n: 2.5)


def test_pass_cost_interpolates_and_extrapolates():
    assert CPU_LIKE(1) == 1.0 and CPU_LIKE(5) == pytest.approx(1.6)
    assert CPU_LIKE(3) == pytest.approx(1.2 + (1.6 - 1.2) / 3)           # linear between
    assert CPU_LIKE(80) == pytest.approx(5.0 + (5.0 - 2.6) / 24 * 40)    # the last slope on
    assert CPU_LIKE.ratio(1, 4) == pytest.approx(1.6)
    assert CPU_LIKE.ratio(8, 4) == pytest.approx(5.0 / 1.8)   # 8 running, 5 rows each
    assert FLAT(1) == FLAT(1000) == 1.0 and FLAT.ratio(8, 4) == 1.0


def test_the_batch_changes_the_rule():
    """At batch 1 the measured 5-row pass is cheap; at 8 running the 40-row verify step is
    past the bandwidth floor, and the same acceptance no longer pays for 4 drafts."""
    rule = AdaptiveSpeculation(k=4, pass_cost=CPU_LIKE)
    rule.begin_step({0})
    assert rule.batch == 1 and rule.best(0.6) == 2
    rule.begin_step(set(range(8)))
    assert rule.batch == 8 and rule.best(0.6) == 1 and rule.best(0.6, batch=1) == 2
    assert rule.cost(0) == 1.0
    assert rule.cost(4) == pytest.approx(5.0 / 1.8 + 4 * rule.cost_per_draft)
    assert rule.cost(4, batch=1) == pytest.approx(1.6 + 4 * rule.cost_per_draft)


class FakeModel:
    """A target whose `dense_seconds` answers like spec_decode/cost_probe.dense_seconds
    ({rows: one float per repeat}; None on a device)."""

    def __init__(self, seconds_of_rows, device=False):
        self.calls, self.fn, self.device = [], seconds_of_rows, device

    def dense_seconds(self, rows, repeats=3):
        self.calls.append((tuple(rows), repeats))
        return None if self.device else {r: [self.fn(r)] * repeats for r in rows}


def test_calibration_measures_the_rows_up_to_the_budget_and_is_monotone():
    model = FakeModel(lambda r: 0.01 * (1 + 0.1 * r) if r != 3 else 0.001)  # a dip at 3
    rule = AdaptiveSpeculation(k=4)
    rule.calibrate(model.dense_seconds, max_rows=20)
    rows = tuple(r for r in adaptive.CALIBRATION_ROWS if r <= 20)
    assert rule.pass_cost.rows == rows
    assert model.calls == [(rows, adaptive.CALIBRATION_ROUNDS)]
    assert list(rule.pass_cost.seconds) == sorted(rule.pass_cost.seconds)   # no dip
    assert rule.pass_cost(5) == pytest.approx(0.015)
    # A device backend cannot be timed: flat. A disabled rule measures nothing.
    rule = AdaptiveSpeculation(k=4)
    rule.calibrate(FakeModel(lambda r: 1.0, device=True).dense_seconds, 64)
    assert rule.pass_cost == FLAT
    off = FakeModel(lambda r: 1.0)
    AdaptiveSpeculation(k=4, enabled=False).calibrate(off.dense_seconds, 64)
    assert off.calls == []


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_measure_pass_cost_on_a_tiny_real_model(tiny_llama, backend):
    from refserve.backends import get_backend
    from refserve.models.loader import load_model
    from refserve.spec_decode.cost_probe import dense_seconds

    model = load_model(tiny_llama, get_backend(backend))
    cost = measure_pass_cost(lambda rows, repeats: dense_seconds(model, rows, repeats),
                             max_rows=8)
    assert cost.rows == (1, 2, 3, 5, 8)
    assert all(s > 0 for s in cost.seconds) and np.all(np.diff(cost.seconds) >= 0)


def test_cost_probes_time_what_they_say(tiny_llama):
    """spec_decode/cost_probe.py on a tiny model: the dense products of a forward (4 per
    layer and the lm_head) at each row count, whole forwards, and a copy on another backend
    that computes the same logits."""
    from model_utils import max_rel_err, prefill_logits

    from refserve.backends import CpuBackend, NumpyBackend
    from refserve.models.loader import load_model
    from refserve.spec_decode import cost_probe

    model = load_model(tiny_llama, NumpyBackend())
    dense = cost_probe.dense_seconds(model, [1, 3], repeats=2)
    assert set(dense) == {1, 3} and all(len(t) == 2 and min(t) > 0 for t in dense.values())
    assert len(cost_probe.dense_weights(model)) == 4 * model.config.num_hidden_layers + 1
    assert len(cost_probe.dense_weights(model, 1)) == 5
    forward = cost_probe.forward_seconds(model, num_seqs=2, query_len=5, context_len=20,
                                         repeats=2)
    assert len(forward) == 2 and min(forward) > 0
    tuned = cost_probe.with_backend(model, CpuBackend())
    assert tuned.backend.name == "cpu" and model.backend.name == "numpy"
    assert tuned.lm_head is not model.lm_head          # prepared again, by the tuned backend
    tokens = list(range(3, 30))
    assert max_rel_err(prefill_logits(tuned, tokens)[0], prefill_logits(model, tokens)[0]) \
        < 1e-5


def steps_of(rule, seq_ids, n):
    """n engine steps: begin_step, then each sequence's num_drafts (a list per step)."""
    out = []
    for _ in range(n):
        rule.begin_step(set(seq_ids))
        out.append([rule.num_drafts(s) for s in seq_ids])
    return out


def test_a_fresh_sequence_speculates_and_a_rejected_one_stops_then_probes():
    rule = AdaptiveSpeculation(k=4)
    rule.begin_step({0})
    assert rule.num_drafts(0) >= 2  # the prior: speculate until evidence arrives
    for _ in range(20):
        rule.observe(0, 4, 0)  # every draft rejected at once
        if rule.best(rule.alpha(0)) == 0:
            break
    assert rule.best(rule.alpha(0)) == 0
    # Stopped: PROBE_TOKENS drafts on every PROBE_EVERY-th step of the engine's clock
    # (begin_step), plain steps in between: one step in PROBE_EVERY.
    drafts = [d for (d,) in steps_of(rule, [0], 3 * adaptive.PROBE_EVERY)]
    assert [rule.steps - len(drafts) + 1 + i for i, n in enumerate(drafts) if n] == \
        [s for s in range(rule.steps - len(drafts) + 1, rule.steps + 1)
         if s % adaptive.PROBE_EVERY == 0]
    assert sum(n > 0 for n in drafts) == 3
    assert all(n in (0, adaptive.PROBE_TOKENS) for n in drafts)


def test_stopped_sequences_probe_on_the_same_step():
    """A probe costs the batch (a draft model runs its passes over everyone), so stopped
    sequences probe together, on the engine's clock: 12 sequences that joined and stopped
    on 12 different steps give 3 probe steps in 90, not 3 per sequence."""
    rule = AdaptiveSpeculation(k=4)
    probe_steps = set()
    for t in range(3 * adaptive.PROBE_EVERY):
        live = set(range(min(t + 1, 12)))
        rule.begin_step(live)
        if t < 12:                      # sequence t joins now and is rejected at once
            for _ in range(30):
                rule.observe(t, 2, 0)
        drafts = [rule.num_drafts(s) for s in sorted(live)]
        assert set(drafts) <= {0, adaptive.PROBE_TOKENS}
        if any(drafts):
            assert drafts == [adaptive.PROBE_TOKENS] * len(live)   # all of them at once
            probe_steps.add(rule.steps)
    assert probe_steps == {adaptive.PROBE_EVERY, 2 * adaptive.PROBE_EVERY,
                           3 * adaptive.PROBE_EVERY}


def test_only_the_sequences_that_may_draft_choose_the_batchs_k():
    """Sequences that cannot draft this step (prefilling, asking for logprobs) have no
    evidence, only the prior's optimism: they must not keep two rejected drafters
    drafting."""
    rule = AdaptiveSpeculation(k=4, draft_cost_per_token=0.3)
    rule.begin_step({0, 1})
    for s in (0, 1):
        for _ in range(30):
            rule.observe(s, 2, 0)
    live = set(range(12))              # 2 .. 11: running, but not drafting this step
    rule.begin_step(live, drafting={0, 1})
    assert not rule.is_probe_step and rule.num_drafts(0) == rule.num_drafts(1) == 0
    rule.begin_step(live)              # had they a say, the prior would win
    assert rule.num_drafts(0) > 0


def test_a_request_run_alone_is_probed_on_the_same_steps_every_time():
    """The probes' clock restarts when the batch was empty: the same request, run alone
    twice on one engine, proposes the same drafts step by step (notebook 03 counts them)."""
    rule = AdaptiveSpeculation(k=4)

    def run_alone(seq_id, steps=75):
        drafts = []
        for _ in range(steps):
            rule.begin_step({seq_id})
            drafts.append(rule.num_drafts(seq_id))
            rule.observe(seq_id, drafts[-1], 0)
        return drafts

    first = run_alone(0)
    assert first == run_alone(1, steps=75) and sum(n > 0 for n in first[20:]) >= 2


def test_a_draft_models_batch_drafts_one_k_priced_for_all():
    """With a draft model every draft position is one draft pass over the batch: a fresh
    sequence (the prior's optimism) in a batch that stopped speculating does not make the
    whole batch wait for k draft passes; a batch that all accepts drafts together."""
    shared = AdaptiveSpeculation(k=4, draft_cost_per_token=0.3)
    alone = AdaptiveSpeculation(k=4)   # n-gram: each sequence for itself
    stopped = list(range(1, 16))
    for rule in (shared, alone):
        for s in stopped:
            for _ in range(30):
                rule.observe(s, 2, 0)
        rule.begin_step({0, *stopped})
    assert shared.best(shared.alpha(0)) >= 1          # alone, the prior would draft
    assert shared.num_drafts(0) == 0 and alone.num_drafts(0) >= 2
    assert [shared.num_drafts(s) for s in stopped] == [0] * len(stopped)
    for s in stopped:
        for _ in range(30):
            shared.observe(s, 4, 4)
    shared.begin_step({0, *stopped})
    assert {shared.num_drafts(s) for s in [0, *stopped]} == {4}
    # the mean of E, not the best or the worst sequence's: E(1, 4) = 5, E(0, 4) = 1
    assert best_num_drafts(1.0, 4, 0.3) == 4 and best_num_drafts(0.0, 4, 0.3) == 0
    assert best_num_drafts([0.0, 1.0], 4, 0.3) == 4          # mean 3 > cost 2.2
    assert best_num_drafts([0.0, 0.0, 0.0, 1.0], 4, 0.3) == 0  # mean 2 < cost 2.2
    assert best_num_drafts([0.9, 0.9], 4, 0.1) == best_num_drafts(0.9, 4, 0.1) > 0
    assert best_num_drafts([], 4, 0.1) == 0


def test_acceptance_brings_speculation_back_and_other_sequences_are_independent():
    rule = AdaptiveSpeculation(k=4)
    for _ in range(30):
        rule.observe(0, 2, 0)
    assert rule.best(rule.alpha(0)) == 0
    for _ in range(30):
        rule.observe(0, 4, 4)  # a quote starts: everything accepted
    assert rule.num_drafts(0) == 4
    assert rule.num_drafts(1) == rule.num_drafts(2) >= 2  # untouched sequences: the prior
    rule.begin_step({1})
    assert rule.alpha(0) == pytest.approx(adaptive.PRIOR_ALPHA)


def test_a_proposer_that_is_never_right_is_stopped_even_when_verifying_is_cheap():
    """The prior is discounted with the evidence: α̂ goes to 0, so even a flat pass cost
    (cost(1) = 1.05) stops speculating after a few rejected steps. A prior of fixed weight
    would hold α̂ at PRIOR_ALPHA / 11 = 0.07 and keep one draft a step forever."""
    rule = AdaptiveSpeculation(k=4)
    steps = []
    for _ in range(60):
        steps.append(rule.num_drafts(0))
        rule.observe(0, steps[-1], 0)               # every draft rejected
    assert rule.alpha(0) < rule.cost_per_draft     # below break-even at a flat pass
    assert sum(n > 0 for n in steps[20:]) <= 2      # after the first 20: only probes
    assert adaptive.PRIOR_ALPHA / (1 / (1 - adaptive.DECAY) + adaptive.PRIOR_WEIGHT) > \
        rule.cost_per_draft                          # the floor a fixed prior would leave


def test_accept_tests_counted_as_run_not_as_proposed():
    rule = AdaptiveSpeculation(k=4)
    rule.observe(0, 4, 1)  # 1 accepted, then 1 rejection; the last 2 were never tested
    state = rule._states[0]
    assert (state.accepted, state.tested) == (1, 2)
    rule.observe(0, 3, 3)  # all accepted: 3 tests
    assert state.accepted == pytest.approx(adaptive.DECAY * 1 + 3)
    assert state.tested == pytest.approx(adaptive.DECAY * 2 + 3)
    assert state.prior == pytest.approx(adaptive.PRIOR_WEIGHT * adaptive.DECAY ** 2)
    assert rule.alpha(0) == pytest.approx((state.accepted + adaptive.PRIOR_ALPHA * state.prior)
                                          / (state.tested + state.prior))


def test_disabled_rule_always_gives_k():
    rule = AdaptiveSpeculation(k=3, enabled=False)
    for _ in range(20):
        rule.observe(0, 3, 0)
    assert rule.num_drafts(0) == 3
