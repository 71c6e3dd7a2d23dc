"""Sampling: the distribution each rule defines, checked exactly and by drawing."""

import numpy as np
import pytest

from refserve.sampling import (
    Sampler,
    SamplingParams,
    make_generator,
    probabilities,
    sample_from_logits,
)

LOGITS = np.log(np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=np.float32))


def expected(temperature=1.0, top_k=0, top_p=1.0):
    """The target distribution, written out by hand from the definitions (independent of
    refserve.sampling): tempered softmax, keep top-k, keep the smallest prefix of the sorted
    tokens whose mass reaches top_p, renormalise."""
    p = np.exp(LOGITS.astype(np.float64) / temperature)
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros(len(p), bool)
    if top_k > 0:
        keep[order[:top_k]] = True
    else:
        keep[:] = True
    q = np.where(keep, p, 0)
    q /= q.sum()
    if top_p < 1.0:
        mass, nucleus = 0.0, np.zeros(len(p), bool)
        for i in np.argsort(-q):
            if mass >= top_p:
                break
            nucleus[i] = True
            mass += q[i]
        q = np.where(nucleus, q, 0)
        q /= q.sum()
    return q


CASES = [dict(), dict(temperature=0.5), dict(temperature=2.0), dict(top_k=2),
         dict(top_p=0.7), dict(top_p=0.65), dict(top_k=3, top_p=0.9),
         dict(temperature=0.7, top_k=4, top_p=0.8)]


@pytest.mark.parametrize("kw", CASES, ids=[str(c) for c in CASES])
def test_probabilities_follow_the_definitions(kw):
    got = probabilities(LOGITS, SamplingParams(**kw))
    np.testing.assert_allclose(got, expected(**kw), rtol=1e-5, atol=1e-7)  # float32 math


@pytest.mark.parametrize("kw", CASES, ids=[str(c) for c in CASES])
def test_draws_match_the_distribution(kw):
    params = SamplingParams(**kw)
    gen = make_generator(1234)
    n = 20000
    counts = np.bincount([sample_from_logits(LOGITS, params, gen) for _ in range(n)],
                         minlength=len(LOGITS))
    p = expected(**kw)
    assert np.all(counts[p == 0] == 0), "a token outside top-k / top-p was drawn"
    sigma = np.sqrt(n * p * (1 - p)) + 1e-9
    assert np.all(np.abs(counts - n * p) <= 5 * sigma), (counts / n, p)


def test_greedy_is_argmax_and_uses_no_randomness():
    gen = make_generator(0)
    state = gen.bit_generator.state
    assert sample_from_logits(LOGITS, SamplingParams(temperature=0.0), gen) == 0
    assert gen.bit_generator.state == state


def test_seeded_generators_and_children():
    p = SamplingParams(temperature=1.0, seed=5)
    a = [sample_from_logits(LOGITS, p, make_generator(5)) for _ in range(1)]
    b = [sample_from_logits(LOGITS, p, make_generator(5)) for _ in range(1)]
    assert a == b
    child = make_generator(5, child_index=3)
    same = make_generator(8)
    assert child.random() == same.random()


def test_sampler_mixes_greedy_and_sampled_rows():
    logits = np.stack([LOGITS, LOGITS[::-1], LOGITS])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=1)]
    out = Sampler().sample(logits, params, [make_generator(i) for i in range(3)])
    assert out == [0, 5, 0]


def test_stop_field_normalised():
    assert SamplingParams(stop="###").stop == ["###"]
    with pytest.raises(ValueError, match=r"SamplingParams\.stop="):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match=r"SamplingParams\.seed="):
        SamplingParams(seed=-2)     # -1 means None (vLLM); other negatives are mistakes


# ---- the vectorised sampler against a naive float64 reference ----------------------------

from hypothesis import HealthCheck, assume, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from refserve.sampling import inverse_cdf  # noqa: E402

SETTINGS = settings(deadline=None, max_examples=150,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def naive(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, margin=0.0):
    """The definitions written out in float64, one token at a time (independent of the
    sampler's thresholds and bisection): tempered softmax; min_p keeps p >= min_p * max p;
    top_k keeps logits >= the k-th largest; renormalise; top_p keeps a token when the mass of
    the kept tokens with a strictly larger logit is < top_p (ties decided on the logits, as
    refserve.sampling's docstring defines); renormalise.
    Returns (probs, clear): `clear` is False when some token sits within `margin` of a
    min_p (relative) or top_p (absolute) boundary, where float32 and float64 rounding may
    disagree."""
    x = np.asarray(logits, dtype=np.float64)
    p = np.exp((x - x.max()) / temperature)
    p /= p.sum()
    keep = np.ones(len(x), bool)
    clear = True
    if min_p > 0:
        ratio = p / p.max()
        keep &= ratio >= min_p
        clear &= bool(np.all(np.abs(ratio / min_p - 1) > margin))
    if top_k > 0:
        keep &= x >= np.sort(x)[::-1][min(top_k, len(x)) - 1]
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1.0:
        more = np.array([q[keep & (x > x[i])].sum() for i in range(len(q))])
        clear &= bool(np.all(np.abs(more[keep] - top_p) > margin))
        q = np.where(keep & (more < top_p), q, 0.0)
        q /= q.sum()
    return q, clear


# Logits with ties and wide gaps: drawn from a small grid or from a continuous range.
logit_values = st.one_of(st.sampled_from([-8.0, -2.0, 0.0, 0.5, 1.0, 3.0]),
                         st.floats(-30, 30, width=32))


@st.composite
def cases(draw, max_vocab=600):
    vocab = draw(st.integers(2, max_vocab))
    logits = draw(hnp.arrays(np.float32, vocab, elements=logit_values))
    params = dict(temperature=draw(st.floats(0.05, 3.0)),
                  top_k=draw(st.one_of(st.just(0), st.integers(1, vocab + 2))),
                  top_p=draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0))),
                  min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 0.6))))
    return logits, params


def key_case(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return (np.array(logits, dtype=np.float32),
            dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))


FIVE = [2.0, 1.0, 0.0, -1.0, -3.0]
# Each mechanism's key cases, run on every run of the test below (Hypothesis's own draws may
# miss a mechanism for a whole run): min_p away from T = 1 on both sides (a min_p applied to
# the untempered p agrees at T = 1 only), top_k through a run of ties and with a temperature,
# top_p with a temperature, all of them together, and the nucleus tie rule on logits whose
# probabilities round to the same float32 value.
KEY_CASES = [key_case(FIVE, temperature=0.5, min_p=0.2), key_case(FIVE, temperature=2.0, min_p=0.2),
             key_case([3.0, 2.0, 2.0, 2.0, 1.0], top_k=2),
             key_case(FIVE, temperature=0.7, top_k=3),
             key_case(FIVE, temperature=0.7, top_p=0.8), key_case(FIVE, temperature=2.5, top_p=0.6),
             key_case([4.0, 3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0], temperature=1.5, top_k=6,
                      top_p=0.9, min_p=0.05),
             key_case([5.008e-42, 0.0], top_p=0.4), key_case([5.008e-42, 0.0], top_p=0.6)]


def with_key_cases(test):
    for case in reversed(KEY_CASES):
        test = example(case)(test)
    return test


@SETTINGS
@given(cases())
@with_key_cases
def test_probabilities_match_the_naive_definition(case):
    logits, kw = case
    ref, clear = naive(logits, margin=1e-4, **kw)
    assume(clear)
    got = probabilities(logits, SamplingParams(**kw))
    assert np.all(got[ref == 0] == 0), "a token outside the kept set has probability"
    assert np.all(got[ref > 1e-6] > 0), "a kept token was dropped"
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", KEY_CASES, ids=[str(kw) for _, kw in KEY_CASES])
def test_key_cases_are_clear_of_rounding_boundaries(case):
    """An @example the test above `assume`s away would test nothing: each key case is clear."""
    assert naive(case[0], margin=1e-4, **case[1])[1]


def test_nucleus_ties_are_decided_on_logits():
    """Logits 5.008e-42 and 0.0 have the same float32 (and float64) probability 0.5, but the
    first logit is larger: with top_p = 0.5 the nucleus is the first token alone (the mass
    of larger logits before the second one is 0.5, not < 0.5). Sampler and reference agree."""
    logits = np.array([5.008e-42, 0.0], dtype=np.float32)
    got = probabilities(logits, SamplingParams(top_p=0.5))
    np.testing.assert_array_equal(got, [1.0, 0.0])
    np.testing.assert_array_equal(naive(logits, top_p=0.5)[0], [1.0, 0.0])
    # Four probabilities of exactly 1/4: the third token's larger-logit mass is exactly 0.5.
    four = np.array([3e-41, 2e-41, 1e-41, 0.0], dtype=np.float32)
    np.testing.assert_array_equal(probabilities(four, SamplingParams(top_p=0.5)),
                                  [0.5, 0.5, 0.0, 0.0])
    np.testing.assert_array_equal(naive(four, top_p=0.5)[0], [0.5, 0.5, 0.0, 0.0])
    tied = np.array([0.0, 0.0], dtype=np.float32)       # equal logits: kept together
    np.testing.assert_array_equal(probabilities(tied, SamplingParams(top_p=0.5)), [0.5, 0.5])


@pytest.mark.parametrize("shape", ["peaked", "flat", "ties"])
def test_large_nuclei_flat_rows_and_tied_runs_are_exact(shape):
    """Nuclei of hundreds of tokens, a flat row (a nucleus of most of the vocabulary), and a
    top_k cut inside a run of tied logits: the kept set must still be exact."""
    rng = np.random.default_rng(7)
    vocab = 5000
    if shape == "peaked":        # ~300-1000 tokens in the 0.9 nucleus
        logits = -np.log(np.arange(1, vocab + 1)) * 1.1 + rng.normal(0, 0.01, vocab)
    elif shape == "flat":
        logits = rng.normal(0, 1, vocab)
    else:
        logits = np.full(vocab, -1.0)
        logits[:5] = [4, 3, 2, 1, 0]
    logits = logits.astype(np.float32)
    for kw in (dict(top_p=0.9), dict(top_p=0.97, min_p=0.0005), dict(top_k=7),
               dict(top_k=400, top_p=0.95)):
        ref, clear = naive(logits, **kw, margin=3e-6)
        assert clear, "choose a case away from the float32 rounding boundary"
        got = probabilities(logits, SamplingParams(**kw))
        assert np.array_equal(got > 0, ref > 0), kw
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-7)


def test_top_k_keeps_ties_with_the_kth_logit():
    logits = np.array([3.0, 2.0, 2.0, 2.0, 1.0], dtype=np.float32)
    got = probabilities(logits, SamplingParams(top_k=2))
    assert np.count_nonzero(got) == 4 and got[4] == 0


def test_rows_are_independent_of_the_batch():
    """A row's distribution and draw are bitwise the same alone and in a mixed batch (other
    rows with other params, hence other candidate groups)."""
    rng = np.random.default_rng(3)
    vocab = 3000
    logits = (rng.standard_normal((6, vocab)) * rng.uniform(0.5, 6, (6, 1))).astype(np.float32)
    params = [SamplingParams(top_p=0.8), SamplingParams(top_k=20, temperature=0.7),
              SamplingParams(temperature=0.0), SamplingParams(min_p=0.1),
              SamplingParams(), SamplingParams(top_k=5, top_p=0.5, min_p=0.01)]
    sampler = Sampler()
    for seed in range(20):
        batch = sampler.sample(logits, params, [make_generator(seed, i) for i in range(6)])
        alone = [sampler.sample(logits[i:i + 1], [p], [make_generator(seed, i)])[0]
                 for i, p in enumerate(params)]
        assert batch == alone
    together = sampler.distributions(logits, params)
    for i, p in enumerate(params):
        ((ids, w),) = sampler.distributions(logits[i:i + 1], [p])
        assert np.array_equal(w, together[i][1])
        assert (ids is None and together[i][0] is None) or np.array_equal(ids, together[i][0])


def test_one_uniform_per_sampled_token():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 500)).astype(np.float32)
    params = [SamplingParams(top_p=0.9), SamplingParams(temperature=0.0),
              SamplingParams(top_k=3), SamplingParams()]
    gens = [make_generator(10 + i) for i in range(4)]
    Sampler().sample(logits, params, gens)
    for i, g in enumerate(gens):
        twin = make_generator(10 + i)
        if not params[i].greedy:
            twin.random()
        assert g.random() == twin.random(), f"row {i} used a different number of draws"


def test_tiny_temperature_is_greedy():
    gen = make_generator(0)
    state = gen.bit_generator.state
    assert sample_from_logits(LOGITS[::-1], SamplingParams(temperature=1e-6), gen) == 5
    assert gen.bit_generator.state == state


def test_inverse_cdf_matches_a_running_sum():
    rng = np.random.default_rng(1)
    for n in (1, 7, 1024, 1025, 5000):
        w = rng.random(n).astype(np.float32) * (rng.random(n) < 0.7)
        w[rng.integers(n)] = 1.0
        cum = np.cumsum(w.astype(np.float64))
        for u in rng.random(200):
            target = u * cum[-1]
            if np.min(np.abs(cum - target)) < 1e-4 * cum[-1]:
                continue   # a boundary where block-wise float64 sums may round the other way
            i = inverse_cdf(w, u)
            assert i == int(np.searchsorted(cum, target, side="right")) and w[i] > 0


def test_inverse_cdf_never_draws_a_zero_weight():
    w = np.array([0, 0, 2, 0, 1, 0, 0], dtype=np.float32)
    assert inverse_cdf(w, 0.0) == 2
    assert inverse_cdf(w, np.nextafter(1.0, 0.0)) == 4


# ---- draws: chi-square goodness of fit, with negative controls ---------------------------

STAT_LOGITS = np.log(np.array([0.30, 0.20, 0.15, 0.10, 0.08, 0.06, 0.05, 0.03, 0.02, 0.01],
                              dtype=np.float32))


def chi_square_rejects(counts, probs) -> bool:
    """Pearson's chi-square test at level 1e-4 (Wilson-Hilferty critical value). Tokens with
    probability 0 must never be drawn."""
    if np.any(counts[probs == 0]):
        return True
    n = counts.sum()
    support = probs > 0
    stat = np.sum((counts[support] - n * probs[support]) ** 2 / (n * probs[support]))
    df = support.sum() - 1
    if df == 0:
        return False
    z = 3.719  # upper 1e-4 quantile of N(0, 1)
    critical = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return stat > critical


def draw_counts(params, n=20000, seed=2024):
    rows = np.repeat(STAT_LOGITS[None], 500, axis=0)
    sampler = Sampler()
    gens = [make_generator(seed, i) for i in range(500)]
    tokens = []
    for _ in range(n // 500):
        tokens += sampler.sample(rows, [params] * 500, gens)
    return np.bincount(tokens, minlength=len(STAT_LOGITS))


STAT_CASES = [dict(), dict(temperature=0.6), dict(top_k=4), dict(top_p=0.7),
              dict(min_p=0.2), dict(temperature=1.5, top_k=6, top_p=0.8, min_p=0.05)]


@pytest.mark.parametrize("kw", STAT_CASES, ids=[str(c) for c in STAT_CASES])
def test_sampled_frequencies_pass_chi_square(kw):
    counts = draw_counts(SamplingParams(**kw))
    assert not chi_square_rejects(counts, naive(STAT_LOGITS, **kw)[0]), counts


@pytest.mark.parametrize("drawn,claimed", [
    (dict(temperature=1.0), dict(temperature=0.9)),    # temperature ignored / misapplied
    (dict(top_p=1.0), dict(top_p=0.9)),                 # nucleus not applied
    (dict(top_p=0.75), dict(top_p=0.65)),               # nucleus one token off
    (dict(top_k=5), dict(top_k=5, min_p=0.3)),          # min_p not applied
])
def test_chi_square_detects_a_wrong_distribution(drawn, claimed):
    """Negative control: the test above has the power to see these student mistakes."""
    counts = draw_counts(SamplingParams(**drawn))
    assert chi_square_rejects(counts, naive(STAT_LOGITS, **claimed)[0])
