"""Temperature, top-k and top-p applied to BOTH the target's p and the draft's q, batched.

The accept test u · q(x) < p(x) compares the distributions the tokens were actually drawn
from. A draft token sampled from softmax(draft_logits / T) must be tested with that q, not
with softmax(draft_logits): mixing a warped q with an unwarped one (or the reverse) is a
classic real-world bug that silently changes the output distribution. So one function warps
both, with the same per-request settings:

    T < 1e-5 (greedy):  one-hot at argmax(logits) (lowest index on ties)
    otherwise:          p = softmax(logits / T)
                        min_p: keep t with p[t] >= min_p · max(p)
                        top_k: keep t with logits[t] >= the k-th largest (0 or -1: off)
                        top_p: renormalise over what is kept; keep t iff the mass of the
                               kept tokens strictly more likely than t is < top_p
                        renormalise. Removed tokens get probability exactly 0.

Every rule keeps the ties of its last kept token. This is the rule of `refserve.sampling`
(tests/test_spec_warping.py checks the two agree), written here as a dense [N, V] batch in
the logits' dtype (float32 in the engine), because the accept test reads p and q at arbitrary
tokens. Only the `SamplingParams` fields temperature, top_k, top_p and min_p are read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# vLLM's (and refserve.sampling's) cut-off: below it a request is greedy.
GREEDY_BELOW = 1e-5


def warp_probs(
    logits: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray | float = 0.0,
) -> np.ndarray:
    """Warped next-token distributions of N rows.

    logits [N, V] float32 (or float64); temperature [N] >= 0; top_k [N] int, 0 or -1 = all;
    top_p [N] in (0, 1]; min_p [N] in [0, 1]. Returns probs [N, V] in the logits' float
    dtype, rows summing to 1.
    """
    logits = np.asarray(logits)
    dtype = logits.dtype if logits.dtype == np.float64 else np.float32
    logits = logits.astype(dtype, copy=False)
    n, vocab = logits.shape
    temperature = np.broadcast_to(np.asarray(temperature, dtype=np.float64), (n,))
    top_k = np.broadcast_to(np.asarray(top_k, dtype=np.int64), (n,))
    top_p = np.broadcast_to(np.asarray(top_p, dtype=np.float64), (n,))
    min_p = np.broadcast_to(np.asarray(min_p, dtype=np.float64), (n,))
    probs = np.zeros((n, vocab), dtype=dtype)

    greedy = temperature < GREEDY_BELOW
    g = np.flatnonzero(greedy)
    probs[g, np.argmax(logits[g], axis=-1)] = 1.0

    s = np.flatnonzero(~greedy)
    if len(s) == 0:
        return probs
    x = logits[s] / temperature[s, None].astype(dtype)
    k = top_k[s]
    cut = (k > 0) & (k < vocab)
    for kk in np.unique(k[cut]):  # usually one value: one partition over those rows
        rows = np.flatnonzero(cut & (k == kk))
        # The kk-th largest value of each row (a partition, not a full sort); below it: out.
        kth = np.partition(x[rows], vocab - kk, axis=-1)[:, vocab - kk]
        x[rows] = np.where(x[rows] >= kth[:, None], x[rows], -np.inf)
    x -= x.max(axis=-1, keepdims=True)
    e = np.exp(x)  # max(e) = exp(0) = 1, so "p >= min_p · max(p)" is "e >= min_p"
    cut = min_p[s] > 0
    if cut.any():
        e[cut] = np.where(e[cut] >= min_p[s][cut, None].astype(dtype), e[cut], 0.0)
    e /= e.sum(axis=-1, keepdims=True)

    for i in np.flatnonzero(top_p[s] < 1.0):
        row = np.where(_nucleus(e[i], top_p[s][i]), e[i], 0.0)
        e[i] = row / row.sum()
    probs[s] = e
    return probs


# top-p sorts only the most likely tokens first; the full vocabulary only when their mass
# falls short of top_p (a flat distribution).
_NUCLEUS_CANDIDATES = 1024


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Boolean mask of the top-p nucleus of one row [V]: keep a token iff the mass of the
    tokens strictly more likely than it is < top_p (so ties are kept or dropped together).

    Sorting 49k tokens per row is the slow part, so only the candidates, every token at
    least as likely as the 1024th most likely one, are sorted. They are a prefix of the full
    order (every other token is strictly less likely), so their running sums are the same;
    once that prefix reaches top_p no later token can be kept, and the answer is exact.
    """
    vocab = len(probs)
    candidates = np.arange(vocab)
    if vocab > _NUCLEUS_CANDIDATES:
        top = np.partition(probs, vocab - _NUCLEUS_CANDIDATES)[vocab - _NUCLEUS_CANDIDATES]
        candidates = np.flatnonzero(probs >= top)
    for tokens in (candidates, np.arange(vocab)):
        order = tokens[np.lexsort((tokens, -probs[tokens]))]  # by -p, then by index
        sorted_probs = probs[order]
        mass = np.cumsum(sorted_probs)
        if mass[-1] >= top_p or len(tokens) == vocab:
            break
    # Mass strictly more likely than each token: the running sum before its tie group.
    before = mass - sorted_probs
    group_start = np.flatnonzero(np.r_[True, sorted_probs[1:] != sorted_probs[:-1]])
    first = group_start[np.searchsorted(group_start, np.arange(len(order)), side="right") - 1]
    keep = np.zeros(vocab, dtype=bool)
    keep[order[before[first] < top_p]] = True
    return keep


def warp_target_and_draft(
    target_logits: np.ndarray,
    draft_logits: np.ndarray | None,
    params: Sequence,
) -> tuple[np.ndarray, np.ndarray | None]:
    """p and q for `rejection_sample`, both warped with row b's `params[b]`.

    target_logits [B, k+1, V], draft_logits [B, k, V] or None (n-gram: one-hot q, nothing to
    warp). `params[b]` needs .temperature, .top_k, .top_p and optionally .min_p (a
    `SamplingParams`).
    Returns p [B, k+1, V] and q [B, k, V] (or None).
    """
    batch = target_logits.shape[0]
    if len(params) != batch:
        raise ValueError(f"params: need one SamplingParams per row ({batch}), got {len(params)}")
    temperature = np.array([sp.temperature for sp in params], dtype=np.float64)
    top_k = np.array([sp.top_k for sp in params], dtype=np.int64)
    top_p = np.array([sp.top_p for sp in params], dtype=np.float64)
    min_p = np.array([getattr(sp, "min_p", 0.0) for sp in params], dtype=np.float64)

    def warp(logits: np.ndarray) -> np.ndarray:
        b, positions, vocab = logits.shape
        flat = warp_probs(
            logits.reshape(b * positions, vocab),
            np.repeat(temperature, positions),
            np.repeat(top_k, positions),
            np.repeat(top_p, positions),
            np.repeat(min_p, positions),
        )
        return flat.reshape(b, positions, vocab)

    p = warp(target_logits)
    q = None if draft_logits is None else warp(draft_logits)
    return p, q
