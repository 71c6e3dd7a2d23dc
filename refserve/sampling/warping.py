"""p and q: the distributions the accept test compares, warped exactly as the sampler warps.

The accept test u · q(x) < p(x) compares the distributions the tokens were actually drawn
from. A draft token sampled at temperature T with top-k / top-p must be tested with that q,
not with softmax(draft_logits): mixing a warped q with an unwarped one (or the reverse) is a
classic real-world bug that silently changes the output distribution. And the target's p
must be the distribution a plain step would have sampled from, or speculation changes what
the request gets. So both are the Sampler's own (sampler.py):

    greedy row (temperature < GREEDY_BELOW):  one-hot at argmax(logits), the first maximum
    otherwise:  backend.sampling_weights(logits, ...) / their sum: the backend's one
                implementation of the nucleus, the one `backend.sample` draws from

so a verify row keeps exactly the tokens a plain row keeps, ties and near-ties included, on
every backend (tests/test_spec_warping.py samples one request both ways). Only the
`SamplingParams` fields temperature, top_k, top_p and min_p are read.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np

from refserve.sampling.sampler import nucleus_arguments
from refserve.sampling_params import SamplingParams


def warp(logits: np.ndarray, params: SequenceOf[SamplingParams], backend) -> np.ndarray:
    """The distributions of N logits rows [N, V] (host, float32), row i warped with
    `params[i]` as the module docstring says. Returns probs [N, V] float32 on the host,
    rows summing to 1, tokens outside the kept set exactly 0."""
    logits = np.asarray(logits, dtype=np.float32)
    if len(params) != len(logits):
        raise ValueError(f"warp: one SamplingParams per row ({len(logits)}), got "
                         f"{len(params)}")
    probs = np.zeros(logits.shape, dtype=np.float32)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    probs[greedy, np.argmax(logits[greedy], axis=-1)] = 1.0
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        weights = backend.to_numpy(backend.sampling_weights(
            logits[rows], **nucleus_arguments([params[i] for i in rows]))).astype(np.float64)
        probs[rows] = weights / weights.sum(axis=-1, keepdims=True)
    return probs
