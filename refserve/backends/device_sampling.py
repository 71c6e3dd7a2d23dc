"""Sampling as whole-batch array ops, for a backend whose logits live on a device.

The rule is refserve/sampling.py's, row by row (greedy below T = 1e-5; min_p, top_k, top_p
each keep every token tied with the last kept one; the draw is an inverse CDF in token-id
order with the row's one uniform). Only the way it is computed differs: the host `Sampler`
finds each kept set's threshold without sorting (selection, bisection on masked sums) and
loops over rows; here every row is sorted in full and everything is one vectorised pass over
[B, V], which suits a GPU (and CuPy's sort) and needs no device→host copy except the B
token ids at the end.

Written against `xp` (numpy or cupy): the CPU tests run it with NumPy against the host
`Sampler`; the CuPy backend runs it on the device.

    desc   = x sorted descending per row                        (x = the row's logits)
    e      = exp((desc - max) / T)                              (unnormalised, e[0] = 1)
    keep   = desc >= kth largest (top_k)  &  e >= min_p         (a prefix of the sorted row)
    nucleus: before_i = mass of the kept tokens ranked before i (renormalised over keep);
             keep the kept i with before_i < top_p               (top_p = 1: the whole set)
    threshold = smallest kept value; the kept set is x >= threshold (ties kept)
    token  = #{t : c_t <= u * c_{V-1}},  c = float64 cumsum of exp((x - max) / T) over kept t

Equality with the host `Sampler`: the kept set and the probabilities are the same rule, so
the distribution is the same; a token drawn with the same uniform is the same except when u
falls within float rounding of a CDF boundary (the host sums in float32 blocks, this in one
float64 cumsum), about one draw in 10^7.

Not here (the engine keeps the host path for such rows): penalties, min_tokens, logits
processors and logprobs; `rows_supported` says which rows qualify.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from refserve.sampling_params import SamplingParams


def rows_supported(params: Sequence[SamplingParams]) -> bool:
    """Whether every row's params can be sampled by `sample_tokens` (no penalties,
    logit_bias, allowed_token_ids, bad_words, min_tokens, logits processors or logprobs:
    those run on the host)."""
    return all(not p.rewrites_logits and not p.min_tokens and p.logprobs is None
               and not getattr(p, "logits_processors", None) for p in params)


def sampling_arrays(params: Sequence[SamplingParams], vocab: int) -> dict[str, np.ndarray]:
    """Host arrays of the per-row knobs: temperature (0 for greedy), top_k (vocab when off),
    top_p, min_p; float32 / int64, one entry per row."""
    return {
        "temperature": np.array([0.0 if p.greedy else p.temperature
                                 for p in params], dtype=np.float32),
        "top_k": np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                          dtype=np.int64),
        "top_p": np.array([p.top_p for p in params], dtype=np.float32),
        "min_p": np.array([p.min_p for p in params], dtype=np.float32),
    }


def kept_threshold(xp: Any, x, temperature, top_k, top_p, min_p):
    """Per row, the smallest logit kept by min_p, top_k and top_p ([B], x's dtype), and the
    row max. Greedy rows (temperature 0) keep only their max."""
    batch, vocab = x.shape
    rows = xp.arange(batch)
    desc = -xp.sort(-x, axis=-1)                          # largest first
    row_max = desc[:, 0]
    greedy = temperature <= 0
    inv_t = xp.where(greedy, xp.float32(1.0), 1.0 / xp.where(greedy, 1, temperature))
    inv_t = inv_t.astype(xp.float32)
    e = xp.exp((desc - row_max[:, None]) * inv_t[:, None])    # e[:, 0] = 1
    kth = desc[rows, xp.clip(top_k, 1, vocab) - 1]
    keep = (desc >= kth[:, None]) & (e >= min_p[:, None])
    p = xp.where(keep, e, xp.float32(0)) / (e * keep).sum(axis=-1, keepdims=True)
    before = xp.cumsum(p, axis=-1) - p                    # kept mass ranked before each
    in_nucleus = keep & ((before < top_p[:, None]) | (top_p[:, None] >= 1))
    count = xp.where(greedy, 1, in_nucleus.sum(axis=-1))
    return desc[rows, count - 1], row_max, inv_t


def sample_tokens(xp: Any, logits, temperature, top_k, top_p, min_p, uniforms):
    """One token id per row of logits [B, V] (float32) -> int64 [B], all on xp's device.

    temperature, top_k, top_p, min_p: [B] arrays from `sampling_arrays` (moved to xp);
    uniforms: [B] float64 in [0, 1), read only for non-greedy rows (greedy rows consume none,
    like the host sampler: the caller passes anything there).
    """
    x = logits.astype(xp.float32, copy=False)
    batch, vocab = x.shape
    threshold, row_max, inv_t = kept_threshold(xp, x, temperature, top_k, top_p, min_p)
    kept = x >= threshold[:, None]
    w = xp.where(kept, xp.exp((x - row_max[:, None]) * inv_t[:, None]), xp.float32(0))
    cdf = xp.cumsum(w.astype(xp.float64), axis=-1)
    token = (cdf <= (uniforms * cdf[:, -1])[:, None]).sum(axis=-1)
    token = xp.minimum(token, vocab - 1)
    greedy = xp.argmax(x, axis=-1)                        # the first maximum, like np.argmax
    return xp.where(temperature <= 0, greedy, token).astype(xp.int64)
