"""Logprobs: log-softmax of the raw logits, top-N in vLLM's shape, the chosen token's rank."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refserve.backends import NumpyBackend
from refserve.logprobs import (
    Logprob,
    compute_logprobs,
    log_softmax,
    prompt_logprobs,
    sampled_logprobs,
)
from refserve.sampling import Sampler, SamplingParams, make_generator


def sampler() -> Sampler:
    """The Sampler on the reference backend."""
    return Sampler(NumpyBackend())


def ref_log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@st.composite
def rows_and_choice(draw):
    n, v = draw(st.integers(1, 4)), draw(st.integers(1, 300))
    logits = draw(hnp.arrays(np.float32, (n, v), elements=st.one_of(
        st.sampled_from([-5.0, 0.0, 1.0]), st.floats(-40, 40, width=32))))
    chosen = draw(st.lists(st.integers(0, v - 1), min_size=n, max_size=n))
    k = draw(st.integers(0, v + 1))
    return logits, chosen, k


@settings(deadline=None, max_examples=150)
@given(rows_and_choice())
def test_logprobs_are_log_softmax_with_ranks(case):
    logits, chosen, k = case
    vocab = logits.shape[1]
    ref = ref_log_softmax(logits)
    np.testing.assert_allclose(log_softmax(logits), ref, atol=1e-5)
    for i, got in enumerate(compute_logprobs(logits, chosen, k)):
        ids = list(got)
        assert ids[0] == chosen[i], "the chosen token comes first"
        # Top N: the N most likely tokens by (logit, then smaller id), in that order.
        expect = np.lexsort((np.arange(vocab), -logits[i].astype(np.float64)))[:k].tolist()
        assert ids[1:] == [t for t in expect if t != chosen[i]]
        for t, lp in got.items():
            assert abs(lp.logprob - ref[i, t]) <= 1e-5
            assert lp.rank == int((logits[i] >= logits[i, t]).sum()), "rank: tokens >= it"


def test_chosen_token_outside_top_n_is_reported_with_its_rank():
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]], dtype=np.float32))
    (got,) = compute_logprobs(logits, [4], 2)
    assert list(got) == [4, 0, 1]
    assert got[4].rank == 5 and got[0].rank == 1 and got[1].rank == 2
    np.testing.assert_allclose(got[4].logprob, np.log(0.05), atol=1e-6)
    (only,) = compute_logprobs(logits, [1], 0)
    assert list(only) == [1] and only[1].rank == 2


def test_tied_tokens_share_the_larger_rank():
    (got,) = compute_logprobs(np.array([[1.0, 2.0, 2.0, 0.0]], dtype=np.float32), [1], 1)
    assert got[1].rank == 2


def test_decoded_token_filled_by_decode():
    (got,) = compute_logprobs(np.zeros((1, 3), np.float32), [2], 1, decode=lambda t: f"<{t}>")
    assert got[2].decoded_token == "<2>" and got[0] == Logprob(got[0].logprob, 3, "<0>")


def test_prompt_logprobs_score_each_token_from_the_row_before():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 10)).astype(np.float32)
    prompt = [3, 7, 1, 9]
    got = prompt_logprobs(logits, prompt, 1)
    assert got[0] is None and len(got) == 4
    ref = ref_log_softmax(logits)
    for j in range(1, 4):
        assert abs(got[j][prompt[j]].logprob - ref[j - 1, prompt[j]]) <= 1e-5


def test_sampler_reports_raw_logprobs_of_the_sampled_token():
    """Logprobs describe the model (raw logits), not the warped distribution: they ignore
    temperature, top-k and penalties, and they are reported only where asked."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    params = [SamplingParams(temperature=0.3, top_k=3, logprobs=2, repetition_penalty=1.5),
              SamplingParams(temperature=0.0), SamplingParams(logprobs=0)]
    tokens = sampler().sample(logits, params, [make_generator(i) for i in range(3)],
                              prompt_token_ids=[[1, 2], [], []], output_token_ids=[[3], [], []])
    found = sampled_logprobs(logits, tokens, params)
    ref = ref_log_softmax(logits)
    assert found[1] is None
    for i in (0, 2):
        d = found[i]
        tok = tokens[i]
        assert next(iter(d)) == tok
        assert abs(d[tok].logprob - ref[i, tok]) <= 1e-5
        assert d[tok].rank == int((logits[i] >= logits[i, tok]).sum())
    assert len(found[2]) == 1
