"""Sampling: the distribution each rule defines, checked exactly and by drawing, for the
reference draw (NumpyBackend.sample, a sort per row) and the tuned one (CpuBackend.sample,
the nucleus by bisection) alike; the Sampler's control around the draw (processors come in
test_logits_processors.py): one uniform per sampled row, greedy rows, seeded generators."""

import numpy as np
import pytest

from refserve.backends import CpuBackend, NumpyBackend
from refserve.sampling import (
    Sampler,
    SamplingParams,
    draw_arguments,
    make_generator,
    nucleus_arguments,
)

BACKENDS = {"numpy": NumpyBackend(), "cpu": CpuBackend()}
each_backend = pytest.mark.parametrize("backend", list(BACKENDS))


def probabilities(backend: str, logits, params: SamplingParams) -> np.ndarray:
    """The distribution `backend`'s draw uses for one row of (processed) logits, as a dense
    float64 vector: the backend's weights over its kept set, normalised (greedy: all mass on
    the argmax)."""
    x = np.asarray(logits, dtype=np.float32)[None]
    if params.greedy:                     # the Sampler's argmax: the draw never sees it
        return np.eye(x.shape[1])[np.argmax(x[0])]
    w = BACKENDS[backend].sampling_weights(x, **nucleus_arguments([params]))[0]
    return w.astype(np.float64) / w.sum(dtype=np.float64)


def sample_from_logits(backend: str, logits, params: SamplingParams, generator) -> int:
    """One token from one row of logits through the Sampler on `backend`."""
    row = np.asarray(logits, dtype=np.float32)[None]
    return Sampler(BACKENDS[backend]).sample(row, [params], [generator])[0]


LOGITS = np.log(np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=np.float32))


def expected(temperature=1.0, top_k=0, top_p=1.0):
    """The target distribution, written out by hand from the definitions (independent of
    refserve/sampling/sampler.py): tempered softmax, keep top-k, keep the smallest prefix
    of the sorted tokens whose mass reaches top_p, renormalise."""
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


@each_backend
@pytest.mark.parametrize("kw", CASES, ids=[str(c) for c in CASES])
def test_probabilities_follow_the_definitions(backend, kw):
    got = probabilities(backend, LOGITS, SamplingParams(**kw))
    np.testing.assert_allclose(got, expected(**kw), rtol=1e-5, atol=1e-7)  # float32 math


@each_backend
@pytest.mark.parametrize("kw", CASES, ids=[str(c) for c in CASES])
def test_draws_match_the_distribution(backend, kw):
    params = SamplingParams(**kw)
    n = 20000
    rows = np.repeat(LOGITS[None], n, axis=0)
    gens = [make_generator(1234)] * n          # one stream: n consecutive uniforms
    counts = np.bincount(Sampler(BACKENDS[backend]).sample(rows, [params] * n, gens),
                         minlength=len(LOGITS))
    p = expected(**kw)
    assert np.all(counts[p == 0] == 0), "a token outside top-k / top-p was drawn"
    sigma = np.sqrt(n * p * (1 - p)) + 1e-9
    assert np.all(np.abs(counts - n * p) <= 5 * sigma), (counts / n, p)


@each_backend
def test_greedy_is_argmax_and_uses_no_randomness(backend):
    gen = make_generator(0)
    state = gen.bit_generator.state
    assert sample_from_logits(backend, LOGITS, SamplingParams(temperature=0.0), gen) == 0
    assert gen.bit_generator.state == state


def test_seeded_generators_and_children():
    p = SamplingParams(temperature=1.0, seed=5)
    a = [sample_from_logits("numpy", LOGITS, p, make_generator(5)) for _ in range(1)]
    b = [sample_from_logits("numpy", LOGITS, p, make_generator(5)) for _ in range(1)]
    assert a == b
    child = make_generator(5, child_index=3)
    same = make_generator(8)
    assert child.random() == same.random()


@each_backend
def test_sampler_mixes_greedy_and_sampled_rows(backend):
    logits = np.stack([LOGITS, LOGITS[::-1], LOGITS])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=1)]
    out = Sampler(BACKENDS[backend]).sample(logits, params,
                                            [make_generator(i) for i in range(3)])
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

SETTINGS = settings(deadline=None, max_examples=150,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def naive(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, margin=0.0):
    """The definitions written out in float64, one token at a time (independent of the
    sampler's thresholds and bisection): tempered softmax; min_p keeps p >= min_p * max p;
    top_k keeps logits >= the k-th largest; renormalise; top_p keeps a token when the mass of
    the kept tokens with a strictly larger logit is < top_p (ties decided on the logits, as
    refserve/sampling/sampler.py's docstring defines); renormalise.
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
        clear &= bool(np.all(np.abs(ratio - min_p) > margin * min_p))  # (no overflow)
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


@each_backend
@SETTINGS
@given(cases())
@with_key_cases
def test_probabilities_match_the_naive_definition(backend, case):
    logits, kw = case
    ref, clear = naive(logits, margin=1e-4, **kw)
    assume(clear)
    got = probabilities(backend, logits, SamplingParams(**kw))
    assert np.all(got[ref == 0] == 0), "a token outside the kept set has probability"
    assert np.all(got[ref > 1e-6] > 0), "a kept token was dropped"
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", KEY_CASES, ids=[str(kw) for _, kw in KEY_CASES])
def test_key_cases_are_clear_of_rounding_boundaries(case):
    """An @example the test above `assume`s away would test nothing: each key case is clear."""
    assert naive(case[0], margin=1e-4, **case[1])[1]


@each_backend
def test_nucleus_ties_are_decided_on_logits(backend):
    """Logits 5.008e-42 and 0.0 have the same float32 (and float64) probability 0.5, but the
    first logit is larger: with top_p = 0.5 the nucleus is the first token alone (the mass
    of larger logits before the second one is 0.5, not < 0.5). Sampler and reference agree."""
    logits = np.array([5.008e-42, 0.0], dtype=np.float32)
    got = probabilities(backend, logits, SamplingParams(top_p=0.5))
    np.testing.assert_array_equal(got, [1.0, 0.0])
    np.testing.assert_array_equal(naive(logits, top_p=0.5)[0], [1.0, 0.0])
    # Four probabilities of exactly 1/4: the third token's larger-logit mass is exactly 0.5.
    four = np.array([3e-41, 2e-41, 1e-41, 0.0], dtype=np.float32)
    np.testing.assert_array_equal(probabilities(backend, four, SamplingParams(top_p=0.5)),
                                  [0.5, 0.5, 0.0, 0.0])
    np.testing.assert_array_equal(naive(four, top_p=0.5)[0], [0.5, 0.5, 0.0, 0.0])
    tied = np.array([0.0, 0.0], dtype=np.float32)       # equal logits: kept together
    np.testing.assert_array_equal(probabilities(backend, tied, SamplingParams(top_p=0.5)),
                                  [0.5, 0.5])


# Two tied logits ahead of a third: p = .422 .422 .155. With top_p 0.4 the first token alone
# reaches 0.4, but its tie goes with it: the nucleus is both, each 1/2. (Ranked one by one,
# as a sort that breaks ties by index would, the second token has 0.422 >= 0.4 before it and
# would be dropped.)
@each_backend
def test_a_tie_at_the_nucleus_boundary_is_kept_whole(backend):
    got = probabilities(backend, [0.0, 0.0, -1.0], SamplingParams(top_p=0.4))
    np.testing.assert_allclose(got, [0.5, 0.5, 0.0], atol=1e-7)
    assert got[2] == 0
    rows = np.repeat(np.array([[0.0, 0.0, -1.0]], np.float32), 4, axis=0)
    draws = BACKENDS[backend].sample(rows, **draw_arguments(
        [SamplingParams(top_p=0.4)] * 4, [FixedUniform(u) for u in (0.0, 0.49, 0.51, 0.99)]))
    assert draws.tolist() == [0, 0, 1, 1]


# The top two logits are tied (0.3 each) and a third is close behind (0.29): with top_p 0.5
# the nucleus is the tied pair alone, because the mass ranked before the third token is both
# tied tokens, 0.6. Counting the tied pair once (0.3 < 0.5) keeps the third token too.
TIED_TOP = np.log(np.array([0.11, 0.3, 0.29, 0.3], dtype=np.float32))


@each_backend
def test_tied_top_logits_count_in_full_at_the_nucleus_boundary(backend):
    got = probabilities(backend, TIED_TOP, SamplingParams(top_p=0.5))
    np.testing.assert_allclose(got, [0.0, 0.5, 0.0, 0.5], atol=1e-7)
    np.testing.assert_allclose(naive(TIED_TOP, top_p=0.5)[0], got, atol=1e-7)
    # Every uniform draws one of the pair, in token-id order.
    draw = BACKENDS[backend].sample(np.repeat(TIED_TOP[None], 3, axis=0),
                                    **draw_arguments([SamplingParams(top_p=0.5)] * 3,
                                                     [FixedUniform(u) for u in
                                                      (0.0, 0.49, 0.51)]))
    assert draw.tolist() == [1, 1, 3]


# The nucleus measures mass at the request's temperature. Logits 2, 1, 0, -1 have
# probabilities .644 .237 .087 .032 at T = 1, .457 .277 .168 .102 at T = 2 and .867 .117
# .016 .002 at T = 0.5: measured at T = 1 while drawing at T, the nucleus is the wrong set
# both ways. The last two rows put the boundary among many near tokens (the tuned sampler's
# final band), once above T = 1 and once below.
TEMPERATURE_CASES = [
    ([-1.0, 2.0, 0.0, 1.0], 2.0, 0.5, [1, 3]), ([-1.0, 2.0, 0.0, 1.0], 0.5, 0.7, [1]),
    ([-1.0, 2.0, 0.0, 1.0], 1.0, 0.5, [1]), ([-1.0, 2.0, 0.0, 1.0], 1.0, 0.7, [1, 3]),
    ([-3.0, -3.5, -1.5, 3.0, -4.0], 3.0, 0.9, [0, 1, 2, 3]),
    ([-0.75, 0.0, -0.5, -1.75, 2.0, -1.75], 0.7, 0.99, [0, 1, 2, 4]),
]


@each_backend
@pytest.mark.parametrize("logits,temperature,top_p,kept", TEMPERATURE_CASES)
def test_the_nucleus_is_searched_at_the_temperature(backend, logits, temperature, top_p, kept):
    logits = np.array(logits, dtype=np.float32)
    ref, clear = naive(logits, temperature, top_p=top_p, margin=1e-3)
    assert clear and np.flatnonzero(ref).tolist() == kept
    got = probabilities(backend, logits, SamplingParams(temperature=temperature, top_p=top_p))
    assert np.flatnonzero(got).tolist() == kept
    np.testing.assert_allclose(got, ref, rtol=1e-5)


class FixedUniform:
    """A stand-in generator whose `random()` returns the given uniform."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@each_backend
@pytest.mark.parametrize("shape", ["peaked", "flat", "ties"])
def test_large_nuclei_flat_rows_and_tied_runs_are_exact(backend, shape):
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
        got = probabilities(backend, logits, SamplingParams(**kw))
        assert np.array_equal(got > 0, ref > 0), kw
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-7)


@each_backend
def test_top_k_keeps_ties_with_the_kth_logit(backend):
    logits = np.array([3.0, 2.0, 2.0, 2.0, 1.0], dtype=np.float32)
    got = probabilities(backend, logits, SamplingParams(top_k=2))
    assert np.count_nonzero(got) == 4 and got[4] == 0


@each_backend
def test_zero_weight_tokens_are_never_drawn(backend):
    """top_k=2 keeps tokens 1 and 3; with u = 0 the draw is the first *kept* token (1), not
    token 0 (a `<` instead of `<=` in the inverse CDF would return 0), and with u just
    below 1 the last kept one (3), not the last token."""
    logits = np.array([[0.0, 3.0, -1.0, 3.0, -2.0]] * 3, np.float32)
    params = [SamplingParams(temperature=1.0, top_k=2)] * 3
    args = draw_arguments(params, [FixedUniform(u) for u in (0.0, 0.75, np.nextafter(1, 0))])
    assert BACKENDS[backend].sample(logits, **args).tolist() == [1, 3, 3]


@each_backend
def test_rows_are_independent_of_the_batch(backend):
    """A row's draw is the same alone and in a mixed batch (other rows with other params,
    hence other candidate groups in the tuned sampler)."""
    rng = np.random.default_rng(3)
    vocab = 3000
    logits = (rng.standard_normal((6, vocab)) * rng.uniform(0.5, 6, (6, 1))).astype(np.float32)
    params = [SamplingParams(top_p=0.8), SamplingParams(top_k=20, temperature=0.7),
              SamplingParams(temperature=0.0), SamplingParams(min_p=0.1),
              SamplingParams(), SamplingParams(top_k=5, top_p=0.5, min_p=0.01)]
    sampler = Sampler(BACKENDS[backend])
    for seed in range(20):
        batch = sampler.sample(logits, params, [make_generator(seed, i) for i in range(6)])
        alone = [sampler.sample(logits[i:i + 1], [p], [make_generator(seed, i)])[0]
                 for i, p in enumerate(params)]
        assert batch == alone


def test_one_uniform_per_sampled_token():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 500)).astype(np.float32)
    params = [SamplingParams(top_p=0.9), SamplingParams(temperature=0.0),
              SamplingParams(top_k=3), SamplingParams()]
    gens = [make_generator(10 + i) for i in range(4)]
    Sampler(NumpyBackend()).sample(logits, params, gens)
    for i, g in enumerate(gens):
        twin = make_generator(10 + i)
        if not params[i].greedy:
            twin.random()
        assert g.random() == twin.random(), f"row {i} used a different number of draws"


@each_backend
def test_tiny_temperature_is_greedy(backend):
    gen = make_generator(0)
    state = gen.bit_generator.state
    params = SamplingParams(temperature=1e-6)
    assert sample_from_logits(backend, LOGITS[::-1], params, gen) == 5
    assert gen.bit_generator.state == state


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


def draw_counts(params, n=20000, seed=2024, backend="numpy"):
    rows = np.repeat(STAT_LOGITS[None], 500, axis=0)
    sampler = Sampler(BACKENDS[backend])
    gens = [make_generator(seed, i) for i in range(500)]
    tokens = []
    for _ in range(n // 500):
        tokens += sampler.sample(rows, [params] * 500, gens)
    return np.bincount(tokens, minlength=len(STAT_LOGITS))


STAT_CASES = [dict(), dict(temperature=0.6), dict(top_k=4), dict(top_p=0.7),
              dict(min_p=0.2), dict(temperature=1.5, top_k=6, top_p=0.8, min_p=0.05)]


@each_backend
@pytest.mark.parametrize("kw", STAT_CASES, ids=[str(c) for c in STAT_CASES])
def test_sampled_frequencies_pass_chi_square(backend, kw):
    counts = draw_counts(SamplingParams(**kw), backend=backend)
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
