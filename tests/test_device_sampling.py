"""device_sampling (the CuPy backend's on-device sampler) run with NumPy, against the host
`Sampler` of refserve/sampling.py: the same kept set and distribution for every row, and the
same token for the same uniform."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refserve.backends import device_sampling as ds
from refserve.sampling import Sampler, SamplingParams, probabilities


class FixedUniform:
    """A stand-in generator: `random()` returns the given uniform (the one the host sampler
    would draw), so both samplers consume the same number."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


def device_sample(logits, params, uniforms):
    arrays = ds.sampling_arrays(params, logits.shape[1])
    return ds.sample_tokens(np, logits, arrays["temperature"], arrays["top_k"],
                            arrays["top_p"], arrays["min_p"], np.asarray(uniforms))


def kept_probabilities(logits, params):
    """The device rule's distribution for one row, from its threshold (dense float64);
    greedy rows are the argmax (sample_tokens takes it directly)."""
    if params.greedy:
        return np.eye(len(logits))[np.argmax(logits)]
    arrays = ds.sampling_arrays([params], logits.shape[-1])
    threshold, row_max, inv_t = ds.kept_threshold(np, logits[None].astype(np.float32),
                                                  arrays["temperature"], arrays["top_k"],
                                                  arrays["top_p"], arrays["min_p"])
    w = np.where(logits >= threshold[0],
                 np.exp((logits.astype(np.float32) - row_max[0]) * inv_t[0]), 0.0)
    return w / w.sum()


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 3, 20]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.05]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)


@settings(deadline=None, max_examples=40)
@given(data=st.data(), vocab=st.sampled_from([1, 5, 50, 300]), batch=st.integers(1, 5))
def test_same_distribution_and_tokens_as_the_host_sampler(data, vocab, batch):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    scale = data.draw(st.sampled_from([0.5, 3.0]))
    logits = rng.standard_normal((batch, vocab)).astype(np.float32) * scale
    if data.draw(st.booleans()):  # ties: quantised logits
        logits = np.round(logits)
    params = [data.draw(params_strategy) for _ in range(batch)]
    uniforms = rng.random(batch)
    for row, p in zip(logits, params):
        np.testing.assert_allclose(kept_probabilities(row, p), probabilities(row, p),
                                   rtol=1e-5, atol=1e-7)
    host = Sampler().sample(logits, params, [FixedUniform(u) for u in uniforms])
    assert device_sample(logits, params, uniforms).tolist() == host


FIVE = [2.0, 1.0, 0.0, -1.0, -3.0]
# Each mechanism's key cases, every run (the Hypothesis test above draws its params at
# random): min_p with T on both sides of 1, top_k through tied logits, top_p with a
# temperature, and all of them at once; each at three uniforms.
KEY_CASES = [(FIVE, dict(temperature=0.5, min_p=0.2)), (FIVE, dict(temperature=1.7, min_p=0.2)),
             ([3.0, 1.0, 1.0, 1.0, 0.0], dict(temperature=1.0, top_k=2)),
             (FIVE, dict(temperature=0.5, top_p=0.9)), (FIVE, dict(temperature=1.7, top_p=0.5)),
             ([3.0, 2.5, 2.0, 1.0, 0.0], dict(temperature=1.5, top_k=4, top_p=0.9, min_p=0.05))]


@pytest.mark.parametrize("logits,kw", KEY_CASES, ids=[str(kw) for _, kw in KEY_CASES])
def test_key_cases_match_the_host_sampler(logits, kw):
    row, params = np.array(logits, np.float32), SamplingParams(**kw)
    np.testing.assert_allclose(kept_probabilities(row, params), probabilities(row, params),
                               rtol=1e-5, atol=1e-7)
    for u in (0.05, 0.5, 0.95):
        host = Sampler().sample(row[None], [params], [FixedUniform(u)])
        assert device_sample(row[None], [params], [u]).tolist() == host


def test_greedy_rows_take_the_first_maximum_and_ignore_their_uniform():
    logits = np.array([[0.0, 2.0, 2.0, 1.0]], np.float32)
    for u in (0.0, 0.99):
        assert device_sample(logits, [SamplingParams(temperature=0.0)], [u]).tolist() == [1]


def test_zero_weight_tokens_are_never_drawn():
    """top_k=2 keeps tokens 1 and 3; with u = 0 the draw is the first *kept* token (1), not
    token 0 (a `<` instead of `<=` in the count would return 0)."""
    logits = np.array([[0.0, 3.0, -1.0, 3.0]], np.float32)
    params = [SamplingParams(temperature=1.0, top_k=2)]
    assert device_sample(logits, params, [0.0]).tolist() == [1]
    assert device_sample(logits, params, [0.75]).tolist() == [3]


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=0.5), dict(min_tokens=2),
                                    dict(logprobs=1), dict(logit_bias={1: 1.0}),
                                    dict(allowed_token_ids=[1]), dict(bad_words=["x"])])
def test_rows_needing_the_host_path_are_reported(kwargs):
    assert ds.rows_supported([SamplingParams(temperature=1.0)])
    assert not ds.rows_supported([SamplingParams(temperature=1.0), SamplingParams(**kwargs)])
