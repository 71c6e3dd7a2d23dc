"""Warping p and q: the distribution a verify row tests is the one a plain row samples from,
on every CPU backend, ties and near-ties included; and the expected tokens per target pass."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from refserve.backends import CpuBackend, NumpyBackend
from refserve.metrics import expected_tokens_per_pass
from refserve.sampling import Sampler, SamplingParams
from refserve.sampling.verify import verify
from refserve.sampling.warping import warp

BACKENDS = {"numpy": NumpyBackend(), "cpu": CpuBackend()}
each_backend = pytest.mark.parametrize("backend", list(BACKENDS))


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
        # Keep t iff the kept tokens with a larger logit than t hold less than top_p.
        p = np.array([pt if pt > 0 and p[x > xt].sum() < top_p else 0.0
                      for pt, xt in zip(p, x)])
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


@each_backend
@settings(max_examples=100, deadline=None)
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
def test_warp_equals_the_rule_row_by_row(backend, rows):
    """Ties in the logits (the repeated 0.0) exercise top-k's 'ties are kept' and top-p's
    tie groups; float32 output within float32 rounding of the float64 rule."""
    logits = np.array([r[0] for r in rows], dtype=np.float32)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for _, t, k, p, m in rows]
    probs = warp(logits, params, BACKENDS[backend])
    assert probs.dtype == np.float32
    for i, (row_logits, t, k, p, m) in enumerate(rows):
        expected = reference_row(np.float32(row_logits), t, k, p, m)
        np.testing.assert_allclose(probs[i], expected, atol=2e-6)
        assert ((probs[i] == 0) == (expected == 0)).all(), "support differs"


# ---- one request, sampled plainly and through a verify row ------------------------------


class Uniforms:
    """A stand-in generator that hands out the given uniforms in order."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self, n: int | None = None):
        if n is None:
            return self.values.pop(0)
        drawn, self.values = self.values[:n], self.values[n:]
        return np.array(drawn)


GRID = (np.arange(64) + 0.5) / 64    # quantiles: a draw over them is the distribution


def plain_distribution(backend, logits, params) -> np.ndarray:
    """How often the Sampler draws each token of `logits` [V] over the uniform GRID."""
    rows = np.repeat(np.asarray(logits, np.float32)[None], len(GRID), axis=0)
    tokens = Sampler(backend).sample(rows, [params] * len(GRID), [Uniforms(u) for u in GRID])
    return np.bincount(tokens, minlength=len(logits)) / len(GRID)


def verify_distribution(backend, logits, params, draft: int) -> np.ndarray:
    """How often a verify row of one n-gram draft emits each token first, over the GRID of
    accept uniforms x the GRID of draw uniforms: the emission distribution of the accept /
    residual step, which is the row's p (rejection_sampler.py's proof)."""
    row = np.repeat(np.asarray(logits, np.float32)[None], 2, axis=0)   # the draft + bonus
    pairs = [(a, d) for a in GRID for d in GRID]
    emitted, _ = verify([row] * len(pairs), [[draft]] * len(pairs), [None] * len(pairs),
                        [params] * len(pairs), [Uniforms(a, d) for a, d in pairs], backend)
    return np.bincount([t[0] for t in emitted], minlength=len(logits)) / len(pairs)


# (logits, params, the kept set's probabilities). Exact ties: two equal logits are kept or
# dropped together. The near-tie is sampler.py's example: logits 5e-42 and 0 have the same
# float32 probability, yet the nucleus ranks them by logit and keeps the first alone; a p
# judged on rounded probabilities keeps both, [0.5, 0.5, 0].
TIES = [
    ([0.0, 0.0, -1.0], SamplingParams(top_p=0.4), [0.5, 0.5, 0.0]),
    ([-1.0, 0.0, 0.0], SamplingParams(top_p=0.4), [0.0, 0.5, 0.5]),
    ([5e-42, 0.0, -50.0], SamplingParams(top_p=0.5), [1.0, 0.0, 0.0]),
    ([0.0, 5e-42, -50.0], SamplingParams(top_p=0.5), [0.0, 1.0, 0.0]),
    ([1.0, 1.0, 1.0, 0.0], SamplingParams(top_k=1), [1 / 3, 1 / 3, 1 / 3, 0.0]),
    ([5e-42, 0.0, 0.0, -2.0], SamplingParams(top_p=0.3, temperature=0.7), [1, 0, 0, 0]),
]


@each_backend
@pytest.mark.parametrize("logits,params,kept", TIES)
def test_a_verify_row_keeps_the_plain_rows_nucleus(backend, logits, params, kept):
    """The same request, sampled plainly and through a verify row (a draft inside the kept
    set and one outside it), keeps the same tokens with the same probabilities."""
    be = BACKENDS[backend]
    plain = plain_distribution(be, logits, params)
    np.testing.assert_allclose(plain, kept, atol=1 / len(GRID))
    assert ((plain > 0) == (np.array(kept) > 0)).all()
    np.testing.assert_allclose(warp(np.array([logits]), [params], be)[0], kept, atol=1e-6)
    inside, outside = int(np.argmax(kept)), int(np.argmin(kept))
    for draft in (inside, outside):
        through_verify = verify_distribution(be, logits, params, draft)
        np.testing.assert_allclose(through_verify, plain, atol=2 / len(GRID))
        assert ((through_verify > 0) == (plain > 0)).all(), f"draft {draft}: kept sets differ"


def test_the_negative_control_tells_the_two_near_tie_rules_apart():
    """The check above can fail: a p judged on rounded probabilities (both tokens kept)
    differs from the plain row's nucleus on the near-tie."""
    logits = np.array([5e-42, 0.0, -50.0], np.float32)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    by_probability = [pt if p[p > pt].sum() < 0.5 else 0.0 for pt in p]
    plain = plain_distribution(NumpyBackend(), logits, SamplingParams(top_p=0.5))
    assert by_probability[1] > 0 and plain[1] == 0


def test_warp_needs_one_params_per_row():
    with pytest.raises(ValueError, match="one SamplingParams per row"):
        warp(np.zeros((2, 3), np.float32), [SamplingParams()], NumpyBackend())


def test_expected_tokens_per_pass():
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_pass(1.5, 2)
