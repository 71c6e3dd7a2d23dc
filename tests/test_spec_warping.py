"""Warping p and q (temperature, top-k, top-p) and the acceptance metrics."""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from refserve.spec_decode import warping
from refserve.spec_decode.metrics import SpecDecodeStats, expected_tokens_per_pass
from refserve.spec_decode.warping import warp_probs, warp_target_and_draft


def reference_row(logits, temperature, top_k, top_p, min_p=0.0):
    """The rule for one row, written out by hand in float64 from the definitions."""
    logits = np.asarray(logits, np.float64)
    if temperature < 1e-5:
        out = np.zeros_like(logits)
        out[np.argmax(logits)] = 1.0
        return out
    x = logits / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if top_k > 0:
        keep &= x >= sorted(x, reverse=True)[top_k - 1]
    p = np.where(keep, p, 0.0) / p[keep].sum()
    if top_p < 1.0:
        # Keep t iff the tokens strictly more likely than t hold less than top_p.
        p = np.array([pt if pt > 0 and p[p > pt].sum() < top_p else 0.0 for pt in p])
        p /= p.sum()
    return p


FIVE = [2.0, 1.0, 0.0, -1.0, -3.0]
# Each mechanism's key cases, run every time (Hypothesis's draws may miss one for a whole
# run): min_p with T on both sides of 1 (a min_p taken on the untempered p agrees at T = 1
# only), top_k through a run of tied logits and with a temperature, top_p with a
# temperature, greedy beside a sampled row, and everything at once. Row: (logits, T, top_k,
# top_p, min_p).
KEY_ROWS = [
    [(FIVE, 0.5, 0, 1.0, 0.2)], [(FIVE, 2.0, 0, 1.0, 0.2)], [(FIVE, 0.3, 0, 1.0, 0.9)],
    [([3.0, 1.0, 1.0, 1.0, 0.0], 1.0, 2, 1.0, 0.0)], [(FIVE, 0.7, 3, 1.0, 0.0)],
    [(FIVE, 0.7, 0, 0.8, 0.0)], [(FIVE, 2.5, 0, 0.6, 0.0)],
    [(FIVE, 0.0, 0, 1.0, 0.0), (FIVE, 1.0, 0, 1.0, 0.0)],
    [([3.0, 2.5, 2.0, 1.0, 0.0], 1.5, 4, 0.9, 0.05)],
]


def with_key_rows(test):
    for rows in reversed(KEY_ROWS):
        test = example(rows=rows)(test)
    return test


@settings(max_examples=200, deadline=None)
@with_key_rows
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.sampled_from([-2.0, -1.0, 0.0, 0.0, 0.5, 1.0, 3.0]), min_size=5,
                     max_size=5),
            st.sampled_from([0.0, 0.3, 1.0, 2.5]),
            st.sampled_from([-1, 0, 1, 2, 4, 5]),
            st.sampled_from([1.0, 0.9, 0.5, 0.1]),
            st.sampled_from([0.0, 0.0, 0.2, 0.9]),
        ),
        min_size=1, max_size=6,
    )
)
def test_batched_warp_equals_the_rule_row_by_row(rows):
    """Ties in the logits (the repeated 0.0) exercise top-k's 'ties are kept' and top-p's
    stable order; float32 output within float32 rounding of the float64 rule."""
    logits = np.array([r[0] for r in rows], dtype=np.float32)
    temperature = np.array([r[1] for r in rows])
    top_k = np.array([r[2] for r in rows])
    top_p = np.array([r[3] for r in rows])
    min_p = np.array([r[4] for r in rows])
    # Top-p sorts only the most likely candidates first: 2 of 5 exercises both that path
    # and the fall-back to the whole row.
    for candidates in (2, warping._NUCLEUS_CANDIDATES):
        saved, warping._NUCLEUS_CANDIDATES = warping._NUCLEUS_CANDIDATES, candidates
        try:
            probs = warp_probs(logits, temperature, top_k, top_p, min_p)
        finally:
            warping._NUCLEUS_CANDIDATES = saved
        assert probs.dtype == np.float32
        for i, (row_logits, t, k, p, m) in enumerate(rows):
            expected = reference_row(np.float32(row_logits), t, k, p, m)
            np.testing.assert_allclose(probs[i], expected, atol=2e-6)
            assert ((probs[i] == 0) == (expected == 0)).all(), "support differs"


@pytest.mark.parametrize(
    "settings",
    [dict(temperature=0.7), dict(temperature=1.3, top_k=3), dict(temperature=0.9, top_p=0.6),
     dict(temperature=1.0, min_p=0.3, top_p=0.8), dict(temperature=0.0), dict(temperature=1e-6)],
)
def test_warp_is_the_distribution_the_sampler_draws_from(settings):
    """Speculation must keep the distribution of ordinary sampling, so its p is exactly the
    one the Sampler draws from (greedy: its argmax; else the reference draw's weights,
    NumpyBackend.sample): same rule, ties included (the logits repeat values)."""
    from refserve.backends.numpy_backend import sampling_weights
    from refserve.sampling import SamplingParams, draw_arguments, make_generator

    rng = np.random.default_rng(4)
    logits = rng.integers(-8, 8, size=(6, 40)).astype(np.float32) / 2
    params = SamplingParams(**settings)
    ours = warp_target_and_draft(logits[None], None, [params])[0][0]
    if params.greedy:
        weights = np.eye(logits.shape[1])[np.argmax(logits, axis=-1)]
    else:
        args = draw_arguments([params] * len(logits), [make_generator(0)] * len(logits))
        del args["uniforms"]
        weights = sampling_weights(np, logits, **args).astype(np.float64)
    for probs, w in zip(ours, weights / weights.sum(axis=-1, keepdims=True)):
        np.testing.assert_allclose(probs, w, atol=2e-6)
        assert ((probs == 0) == (w == 0)).all()


def test_p_and_q_are_warped_with_the_same_request_settings():
    rng = np.random.default_rng(0)
    target_logits = rng.normal(size=(2, 3, 7)).astype(np.float32)
    draft_logits = rng.normal(size=(2, 2, 7)).astype(np.float32)
    # Only these three fields of SamplingParams are read (sampling.py is independent).
    params = [SimpleNamespace(temperature=0.5, top_k=3, top_p=1.0),
              SimpleNamespace(temperature=0.0, top_k=-1, top_p=1.0)]
    p, q = warp_target_and_draft(target_logits, draft_logits, params)
    assert p.shape == (2, 3, 7) and q.shape == (2, 2, 7)
    for logits, probs in ((target_logits, p), (draft_logits, q)):
        for pos in range(logits.shape[1]):
            np.testing.assert_allclose(probs[0, pos], reference_row(logits[0, pos], 0.5, 3, 1.0),
                                       atol=2e-6)
            np.testing.assert_array_equal(probs[1, pos], reference_row(logits[1, pos], 0, -1, 1))
    p_only, q_none = warp_target_and_draft(target_logits, None, params)
    assert q_none is None
    np.testing.assert_array_equal(p_only, p)
    with pytest.raises(ValueError, match="one SamplingParams per row"):
        warp_target_and_draft(target_logits, draft_logits, params[:1])


def test_expected_tokens_per_pass():
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_pass(1.5, 2)


def test_stats_counts():
    stats = SpecDecodeStats()
    assert stats.acceptance_rate is None and stats.mean_accepted_length is None
    # Three verify steps (k = 4, 4, 2) and one plain decode (no drafts, not counted).
    stats.add(np.array([4, 4, 2, 0]), np.array([4, 1, 0, 0]))
    assert (stats.verify_steps, stats.proposed, stats.accepted, stats.rejections) == (3, 10, 5, 2)
    assert stats.acceptance_rate == 0.5
    assert stats.mean_accepted_length == pytest.approx(8 / 3)  # (5 accepted + 3) / 3 passes
    assert stats.alpha_estimate == pytest.approx(5 / 7)  # 5 passed tests, 2 failed
    with pytest.raises(ValueError, match="num_accepted"):
        stats.add(np.array([1]), np.array([2]))
