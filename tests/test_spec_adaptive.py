"""The adaptive speculation rule (refserve/spec_decode/adaptive.py), pinned."""

import pytest

from refserve.spec_decode import adaptive
from refserve.spec_decode.adaptive import AdaptiveSpeculation, best_num_drafts
from refserve.spec_decode.metrics import expected_tokens_per_pass


@pytest.mark.parametrize("overhead", [0.0, 0.5, adaptive.VERIFY_OVERHEAD])
def test_best_num_drafts_is_the_argmax_of_tokens_per_cost(overhead):
    for alpha in [0.0, 0.05, 0.2, 0.5, 0.8, 0.95, 1.0]:
        for cost in [0.0, 0.1, 0.3, 1.0]:
            k = 6
            rates = [1.0] + [expected_tokens_per_pass(alpha, kk) / (1 + overhead + kk * cost)
                             for kk in range(1, k + 1)]
            best = best_num_drafts(alpha, k, cost, overhead)
            assert rates[best] == pytest.approx(max(rates))
            assert all(rates[kk] < rates[best] - 1e-12 for kk in range(best))  # smallest


def test_k_shrinks_with_acceptance_and_with_draft_cost():
    for overhead in (0.0, adaptive.VERIFY_OVERHEAD):
        ks = [best_num_drafts(a / 20, 5, 0.1, overhead) for a in range(21)]
        assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 5
    assert best_num_drafts(0.7, 5, 0.5, 0.0) < best_num_drafts(0.7, 5, 0.1, 0.0)
    # break-even of one draft without overhead: 1 + α > 1 + c  <=>  α > c
    assert best_num_drafts(0.09, 5, 0.1, 0.0) == 0 and best_num_drafts(0.12, 5, 0.1, 0.0) >= 1
    # a verify overhead raises the acceptance speculation needs
    assert best_num_drafts(0.5, 5, 0.05, 0.0) > 0 == best_num_drafts(0.5, 5, 0.05, 1.5)


def test_a_fresh_sequence_speculates_and_a_rejected_one_stops_then_probes():
    rule = AdaptiveSpeculation(k=4)
    assert rule.num_drafts(0) >= 2  # the prior: speculate until evidence arrives
    steps = 0
    while rule.num_drafts(0) > 0:
        rule.observe(0, 4, 0)  # every draft rejected at once
        steps += 1
        assert steps < 20
    assert best_num_drafts(rule.alpha(0), 4, rule.cost_per_draft, rule.overhead) == 0
    # idle for PROBE_EVERY steps (the loop's last call was the first), then one probe
    assert [rule.num_drafts(0) for _ in range(adaptive.PROBE_EVERY - 1)] == \
        [0] * (adaptive.PROBE_EVERY - 1)
    assert rule.num_drafts(0) == adaptive.PROBE_TOKENS
    probes = [rule.num_drafts(0) for _ in range(3 * (adaptive.PROBE_EVERY + 1))]
    assert probes.count(adaptive.PROBE_TOKENS) == 3
    assert all(n in (0, adaptive.PROBE_TOKENS) for n in probes)


def test_acceptance_brings_speculation_back_and_other_sequences_are_independent():
    rule = AdaptiveSpeculation(k=4)
    for _ in range(30):
        rule.observe(0, 2, 0)
    assert best_num_drafts(rule.alpha(0), 4, rule.cost_per_draft) == 0
    for _ in range(30):
        rule.observe(0, 4, 4)  # a quote starts: everything accepted
    assert rule.num_drafts(0) == 4
    assert rule.num_drafts(1) == rule.num_drafts(2) >= 2  # untouched sequences: the prior
    rule.forget_all_but({1})
    assert rule.alpha(0) == pytest.approx(adaptive.PRIOR_ALPHA)


def test_accept_tests_counted_as_run_not_as_proposed():
    rule = AdaptiveSpeculation(k=4)
    rule.observe(0, 4, 1)  # 1 accepted, then 1 rejection; the last 2 were never tested
    state = rule._states[0]
    assert (state.accepted, state.tested) == (1, 2)
    rule.observe(0, 3, 3)  # all accepted: 3 tests
    assert state.accepted == pytest.approx(adaptive.DECAY * 1 + 3)
    assert state.tested == pytest.approx(adaptive.DECAY * 2 + 3)


def test_disabled_rule_always_gives_k():
    rule = AdaptiveSpeculation(k=3, enabled=False)
    for _ in range(20):
        rule.observe(0, 3, 0)
    assert rule.num_drafts(0) == 3
