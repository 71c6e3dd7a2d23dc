"""Temperature, top-k and top-p applied to BOTH the target's p and the draft's q, batched.

The accept test u · q(x) < p(x) compares the distributions the tokens were actually drawn
from. A draft token sampled from softmax(draft_logits / T) must be tested with that q, not
with softmax(draft_logits): mixing a warped q with an unwarped one (or the reverse) is a
classic real-world bug that silently changes the output distribution. So one function warps
both, with the same per-request settings:

    T == 0 (greedy):  one-hot at argmax(logits) (lowest index on ties)
    otherwise:        softmax(logits / T), keep the top_k largest logits (ties at the k-th
                      value are kept; top_k = -1 keeps all), renormalise, keep the smallest
                      set of most likely tokens whose mass reaches top_p (a token is kept iff
                      the mass strictly before it, in descending order, is < top_p),
                      renormalise. Removed tokens get probability exactly 0.

This is the same rule as `refserve.sampling` applies to one row, written for a whole
[N, V] batch in the logits' dtype (float32 in the engine). Only the `SamplingParams` fields
temperature, top_k and top_p are read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def warp_probs(
    logits: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
) -> np.ndarray:
    """Warped next-token distributions of N rows.

    logits [N, V] float32 (or float64); temperature [N] >= 0; top_k [N] int, -1 = all;
    top_p [N] in (0, 1]. Returns probs [N, V] in the logits' float dtype, rows summing to 1.
    """
    logits = np.asarray(logits)
    dtype = logits.dtype if logits.dtype == np.float64 else np.float32
    logits = logits.astype(dtype, copy=False)
    n, vocab = logits.shape
    temperature = np.broadcast_to(np.asarray(temperature, dtype=np.float64), (n,))
    top_k = np.broadcast_to(np.asarray(top_k, dtype=np.int64), (n,))
    top_p = np.broadcast_to(np.asarray(top_p, dtype=np.float64), (n,))
    probs = np.zeros((n, vocab), dtype=dtype)

    greedy = temperature == 0
    g = np.flatnonzero(greedy)
    probs[g, np.argmax(logits[g], axis=-1)] = 1.0

    s = np.flatnonzero(~greedy)
    if len(s) == 0:
        return probs
    x = logits[s] / temperature[s, None].astype(dtype)
    k = top_k[s]
    cut = np.flatnonzero((k > 0) & (k < vocab))
    if len(cut) > 0:
        # The k-th largest value of each row; everything below it is removed.
        kth = -np.sort(-x[cut], axis=-1)[np.arange(len(cut)), k[cut] - 1]
        x[cut] = np.where(x[cut] >= kth[:, None], x[cut], -np.inf)
    x -= x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    e /= e.sum(axis=-1, keepdims=True)

    nucleus = np.flatnonzero(top_p[s] < 1.0)
    if len(nucleus) > 0:
        rows = e[nucleus]
        order = np.argsort(-rows, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(rows, order, axis=-1)
        mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < top_p[s][nucleus, None]
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        rows = np.where(keep, rows, 0.0)
        e[nucleus] = rows / rows.sum(axis=-1, keepdims=True)
    probs[s] = e
    return probs


def warp_target_and_draft(
    target_logits: np.ndarray,
    draft_logits: np.ndarray | None,
    params: Sequence,
) -> tuple[np.ndarray, np.ndarray | None]:
    """p and q for `rejection_sample`, both warped with row b's `params[b]`.

    target_logits [B, k+1, V], draft_logits [B, k, V] or None (n-gram: one-hot q, nothing to
    warp). `params[b]` needs .temperature, .top_k, .top_p (a `SamplingParams`).
    Returns p [B, k+1, V] and q [B, k, V] (or None).
    """
    batch = target_logits.shape[0]
    if len(params) != batch:
        raise ValueError(f"params: need one SamplingParams per row ({batch}), got {len(params)}")
    temperature = np.array([sp.temperature for sp in params], dtype=np.float64)
    top_k = np.array([sp.top_k for sp in params], dtype=np.int64)
    top_p = np.array([sp.top_p for sp in params], dtype=np.float64)

    def warp(logits: np.ndarray) -> np.ndarray:
        b, positions, vocab = logits.shape
        flat = warp_probs(
            logits.reshape(b * positions, vocab),
            np.repeat(temperature, positions),
            np.repeat(top_k, positions),
            np.repeat(top_p, positions),
        )
        return flat.reshape(b, positions, vocab)

    p = warp(target_logits)
    q = None if draft_logits is None else warp(draft_logits)
    return p, q
