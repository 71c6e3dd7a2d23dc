"""The engine's verify step: from the target's k+1 logits rows of each verify row to the
tokens it emits, through the warp and the backend's `rejection_sample` op.

For verify row b (a sequence with n_b drafts x_1..x_n, scheduled with its last real token):

    p  = warp(target logits rows 0..n_b)     [n_b + 1, V]  (the Sampler's nucleus, warping.py)
    q  = the proposer's warped draft probs   [n_b, V]      (None: one-hot, the n-gram case)
    output, num_accepted = backend.rejection_sample(x, q, p, accept_uniforms, draw_uniforms)

Rows are padded to the batch's largest n with -1 drafts and zero probabilities, which the op
never reads (`rejection_sampler.py`).

THE DRAW ORDER (one stream per sequence: its own seeded generator, the same object the plain
sampler draws from, so a seeded request stays reproducible whatever else is batched):
a sampled row takes exactly n_b + 1 uniforms, `generator.random(n_b + 1)`:

    u[0 .. n_b - 1]   accept_uniforms: u[i] tests draft x_{i+1}
    u[n_b]            draw_uniform: the recovered-or-bonus token

A greedy row (`SamplingParams.greedy`) draws nothing: p is one-hot, so the test is exact match
(x_i accepted iff it is the target's argmax) and the recovered or bonus token is the argmax,
whatever the uniforms; it gets zeros.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np

from refserve.sampling.rejection_sampler import PADDING_TOKEN_ID
from refserve.sampling.warping import warp


def verify(target_logits: SequenceOf[np.ndarray], drafts: SequenceOf[SequenceOf[int]],
           draft_probs: SequenceOf[np.ndarray | None], params: SequenceOf,
           generators: SequenceOf[np.random.Generator], backend
           ) -> tuple[list[list[int]], list[int]]:
    """Accept / residual-resample for B verify rows.

    target_logits[b] [n_b + 1, V] float32; drafts[b] the n_b >= 1 draft ids; draft_probs[b]
    [n_b, V] warped q or None (one-hot); params[b] a SamplingParams; generators[b] the
    sequence's generator (advanced by n_b + 1 draws unless greedy).
    Returns per row the tokens to append (accepted drafts + one recovered or bonus token)
    and the number of accepted drafts.
    """
    batch = len(drafts)
    k = max(len(d) for d in drafts)
    vocab = target_logits[0].shape[-1]
    ids = np.full((batch, k), PADDING_TOKEN_ID, dtype=np.int64)
    for b, (rows, d) in enumerate(zip(target_logits, drafts)):
        if len(rows) != len(d) + 1:
            raise ValueError(f"verify row {b}: {len(rows)} logits rows for {len(d)} drafts; "
                             "a verify row has k + 1")
        ids[b, :len(d)] = d
    # Warp p with each row's own params, only the real rows; padding stays zero (unread).
    sizes = [len(rows) for rows in target_logits]
    flat = warp(np.concatenate(target_logits),
                [sp for sp, n in zip(params, sizes) for _ in range(n)], backend)
    p = np.zeros((batch, k + 1, vocab), dtype=flat.dtype)
    for b, (lo, n) in enumerate(zip(np.cumsum([0, *sizes[:-1]]), sizes)):
        p[b, :n] = flat[lo:lo + n]
    q = None
    if any(x is not None for x in draft_probs):
        q = np.zeros((batch, k, vocab), dtype=np.float32)
        for b, (qb, d) in enumerate(zip(draft_probs, drafts)):
            if qb is None:
                q[b, np.arange(len(d)), d] = 1.0  # one-hot q at each draft
            else:
                q[b, :len(d)] = qb[:len(d)]
    accept_u = np.zeros((batch, k), dtype=np.float64)
    draw_u = np.zeros(batch, dtype=np.float64)
    for b, (sp, gen, d) in enumerate(zip(params, generators, drafts)):
        if not sp.greedy:
            u = gen.random(len(d) + 1)
            accept_u[b, :len(d)] = u[:-1]
            draw_u[b] = u[-1]
    out, num_accepted = backend.rejection_sample(backend.to_device(ids),
                                                 None if q is None else backend.to_device(q),
                                                 backend.to_device(p),
                                                 backend.to_device(accept_u),
                                                 backend.to_device(draw_u))
    out, num_accepted = backend.to_numpy(out), backend.to_numpy(num_accepted)
    tokens = [out[b, :int(num_accepted[b]) + 1].tolist() for b in range(batch)]
    return tokens, [int(a) for a in num_accepted]
