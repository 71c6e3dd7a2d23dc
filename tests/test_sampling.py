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
