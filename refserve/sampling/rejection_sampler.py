"""The accept / residual-resample step of speculative decoding, vectorized over a batch.

Terms (accepted, recovered, bonus token; p, q, k, α) are defined once in
`refserve/spec_decode/__init__.py`. For row b with n = num_draft[b] <= k draft tokens:

    for i = 0 .. n-1:                                    (draft token x_i, uniform u_i)
        accept x_i  iff  u_i · q_i(x_i) < p_i(x_i)        i.e. with probability min(1, p/q)
        at the first rejection: emit a recovered token ~ norm(max(0, p_i - q_i)), stop
    all n accepted: emit a bonus token ~ p_n

Why the output follows p (Leviathan et al., Theorem 1): for one position, token y is emitted
either as an accepted draft, with probability q(y) · min(1, p(y)/q(y)) = min(p(y), q(y)), or as
a recovered token after a rejection (probability 1 - Σ_x min(p(x), q(x)) = Σ_x max(0, p(x) -
q(x))) with probability max(0, p(y) - q(y)) / Σ_x max(0, p(x) - q(x)). Together:
min(p, q) + max(0, p - q) = p. `acceptance_probability` and `residual_distribution` are these
two pieces, exposed so the tests compute the emission distribution from them exactly.

Greedy (temperature 0) needs no special case: `warping.warp` turns p and q into one-hot
vectors at their argmax, so the test accepts x_i iff it is the target's argmax, and the
residual max(0, p - q) of a rejected position is the target's argmax: exact match.

The n-gram proposer's q is one-hot at its draft token (`draft_probs=None`): the test becomes
u_i < p_i(x_i) and the residual is p_i with x_i removed, renormalised.

Randomness is an input, so two backends given the same arrays emit the same tokens:

    accept_uniforms[b, i]  the u_i of draft i of row b, in [0, 1). Tied to the position, not
                           to a stream: entries at or after the first rejection, and entries of
                           padding, are ignored (they shift nothing).
    draw_uniforms[b]       one u in [0, 1) per row for its single recovered-or-bonus draw,
                           by inverse CDF over the unnormalised weights w (residual or p_n):
                               token = min { j : c_j > u · c_{V-1} },  c_j = Σ_{t<=j} w_t
                           accumulated in float64 in index order. A token of weight 0 is never
                           drawn (its c_j equals c_{j-1}, and u · c_{V-1} < c_{V-1}).

The accept test is strict (`<`) on purpose: with u in [0, 1) it still has probability
min(1, p/q), and a token with p(x) = 0 is never accepted, not even when u = 0; a token with
q(x) = 0 < p(x) is always accepted; nothing is divided, so nothing divides by zero.
"""

from __future__ import annotations

import numpy as np

PADDING_TOKEN_ID = -1


def acceptance_probability(p_x: np.ndarray, q_x: np.ndarray) -> np.ndarray:
    """P(u · q(x) < p(x)) for u ~ U[0, 1): min(1, p(x)/q(x)); 1 when q(x) = 0 < p(x); 0 when
    p(x) = 0. Elementwise, float64. This is the probability the accept test implements."""
    p_x = np.asarray(p_x, dtype=np.float64)
    q_x = np.asarray(q_x, dtype=np.float64)
    ratio = np.divide(p_x, q_x, out=np.ones_like(p_x), where=q_x > 0)
    return np.where(p_x > 0, np.minimum(1.0, ratio), 0.0)


def residual_weights(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """max(0, p - q) along the last axis, float64, unnormalised: the recovered token's
    weights. Where the residual is all zero (p = q up to rounding, so a rejection had
    probability ~0) it falls back to p, so a draw is always defined."""
    w = np.maximum(0.0, np.asarray(p, np.float64) - np.asarray(q, np.float64))
    empty = ~(w.sum(axis=-1) > 0)
    if np.any(empty):
        w[empty] = np.asarray(p, np.float64)[empty]
    return w


def residual_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)): the residual distribution a recovered token is drawn from."""
    w = residual_weights(p, q)
    return w / w.sum(axis=-1, keepdims=True)


def inverse_cdf_draw(weights: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """One token per row of `weights` [N, V] (unnormalised, >= 0, positive sum) with uniforms
    [N] in [0, 1): the smallest j with c_j > u · c_{V-1}, c = float64 cumsum in index order.
    Returns int64 [N]."""
    cdf = np.cumsum(np.asarray(weights, np.float64), axis=-1)
    threshold = np.asarray(uniforms, np.float64) * cdf[:, -1]
    # Count of c_j <= threshold = index of the first c_j > threshold (cdf is non-decreasing).
    token = (cdf <= threshold[:, None]).sum(axis=-1)
    # Unreachable for u < 1 and a positive sum; the clamp only guards against bad input.
    return np.minimum(token, weights.shape[-1] - 1).astype(np.int64)


def num_draft_tokens(draft_token_ids: np.ndarray) -> np.ndarray:
    """Drafts per row: the entries before the first -1 (padding is a suffix; see `_check`)."""
    return (np.asarray(draft_token_ids) >= 0).sum(axis=1)


def rejection_sample(
    draft_token_ids: np.ndarray,
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    accept_uniforms: np.ndarray,
    draw_uniforms: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Accept / residual-resample for a batch of B rows with up to k draft tokens each.

    Arrays (V = vocabulary size):
        draft_token_ids  [B, k]       int     x_i; a row with n < k drafts is padded with -1
                                              after them (padding only as a suffix)
        draft_probs      [B, k, V]    float   q_i, already warped (`warping`); None = one-hot
                                              q at each draft token (n-gram proposer)
        target_probs     [B, k+1, V]  float   p_i, already warped; row b reads positions
                                              0..n_b (p_{n_b} is the bonus distribution)
        accept_uniforms  [B, k]       float64 u_i in [0, 1), one per draft position
        draw_uniforms    [B]          float64 u in [0, 1), the recovered-or-bonus draw
    Returns:
        output_token_ids [B, k+1]     int64   accepted tokens, then one recovered or bonus
                                              token, then -1 padding
        num_accepted     [B]          int64   accepted drafts per row (row emits this + 1)

    Probabilities are float32 in the engine (float64 also works); every comparison and the
    CDF run in float64, so the float32 inputs convert exactly and a kernel doing the same
    float64 operations in the same order emits bit-identical tokens.
    """
    _check(draft_token_ids, draft_probs, target_probs, accept_uniforms, draw_uniforms)
    draft_token_ids = np.asarray(draft_token_ids, dtype=np.int64)
    batch, k = draft_token_ids.shape
    rows = np.arange(batch)
    num_draft = num_draft_tokens(draft_token_ids)
    is_draft = np.arange(k)[None, :] < num_draft[:, None]  # [B, k]
    x = np.where(is_draft, draft_token_ids, 0)  # padding reads token 0, then is masked out

    # BEGIN EXERCISE accept_residual: accept iff u*q(x) < p(x); rejected: max(0, p - q)
    # ... leave num_accepted [B], j (where the last token is drawn), weights [B, V]
    # The accept test at every draft position at once; only the leading run counts.
    p_x = np.take_along_axis(target_probs[:, :k], x[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_x = np.ones((batch, k))
    else:
        q_x = np.take_along_axis(draft_probs, x[..., None], axis=-1)[..., 0]
    u = np.asarray(accept_uniforms, dtype=np.float64)
    passes = (u * q_x.astype(np.float64) < p_x.astype(np.float64)) & is_draft
    num_accepted = np.cumprod(passes, axis=1).sum(axis=1).astype(np.int64)

    # One more token per row, at position j = num_accepted: bonus if every draft passed,
    # recovered otherwise.
    j = num_accepted
    weights = target_probs[rows, j].astype(np.float64)  # p_j: the bonus weights
    rejected = np.flatnonzero(num_accepted < num_draft)
    if len(rejected) > 0:
        jr = j[rejected]
        p_j = weights[rejected]
        if draft_probs is None:
            q_j = np.zeros_like(p_j)
            q_j[np.arange(len(rejected)), draft_token_ids[rejected, jr]] = 1.0
        else:
            q_j = draft_probs[rejected, jr]
        weights[rejected] = residual_weights(p_j, q_j)
    # END EXERCISE
    last = inverse_cdf_draw(weights, draw_uniforms)

    output = np.full((batch, k + 1), PADDING_TOKEN_ID, dtype=np.int64)
    keep = np.arange(k)[None, :] < num_accepted[:, None]
    output[:, :k][keep] = draft_token_ids[keep]
    output[rows, j] = last
    return output, num_accepted


def _check(draft_token_ids, draft_probs, target_probs, accept_uniforms, draw_uniforms) -> None:
    """Shapes, id range, padding and uniform range; errors name the argument."""
    if np.ndim(draft_token_ids) != 2:
        raise ValueError(f"draft_token_ids must be [B, k], got shape {np.shape(draft_token_ids)}")
    batch, k = np.shape(draft_token_ids)
    if np.ndim(target_probs) != 3 or np.shape(target_probs)[:2] != (batch, k + 1):
        raise ValueError(
            f"target_probs must be [B, k+1, V] = [{batch}, {k + 1}, V], "
            f"got {np.shape(target_probs)}"
        )
    vocab = np.shape(target_probs)[2]
    if draft_probs is not None and np.shape(draft_probs) != (batch, k, vocab):
        raise ValueError(
            f"draft_probs must be [B, k, V] = {(batch, k, vocab)} or None (one-hot q), "
            f"got {np.shape(draft_probs)}"
        )
    ids = np.asarray(draft_token_ids)
    if ids.size and (ids.min() < PADDING_TOKEN_ID or ids.max() >= vocab):
        raise ValueError(f"draft_token_ids must be in [0, {vocab}) or -1 (padding)")
    if k > 1 and np.any((ids[:, 1:] >= 0) & (ids[:, :-1] < 0)):
        raise ValueError("draft_token_ids: -1 padding must come after a row's drafts")
    if np.shape(accept_uniforms) != (batch, k):
        raise ValueError(f"accept_uniforms must be [B, k] = {(batch, k)}")
    if np.shape(draw_uniforms) != (batch,):
        raise ValueError(f"draw_uniforms must be [B] = ({batch},)")
    for name, arr in (("accept_uniforms", accept_uniforms), ("draw_uniforms", draw_uniforms)):
        arr = np.asarray(arr)
        if arr.size and not (arr.min() >= 0.0 and arr.max() < 1.0):
            raise ValueError(f"{name} must lie in [0, 1)")


if __name__ == "__main__":
    np.set_printoptions(precision=3, suppress=True)
    p = np.array([0.10, 0.40, 0.30, 0.20, 0.00])  # target
    q = np.array([0.30, 0.10, 0.30, 0.00, 0.30])  # draft (token 4 is outside p's support)
    print("token            ", np.arange(len(p)))
    print("p (target)       ", p)
    print("q (draft)        ", q)
    print("min(p, q)        ", np.minimum(p, q), " accepted mass  α =", np.minimum(p, q).sum())
    print("accept prob      ", acceptance_probability(p, q), " = min(1, p/q)")
    print("residual         ", residual_distribution(p, q), " = norm(max(0, p - q))")
    emitted = np.minimum(p, q) + (1 - np.minimum(p, q).sum()) * residual_distribution(p, q)
    print("emitted          ", emitted, " = min(p, q) + (1 - α) · residual = p")

    rng = np.random.default_rng(0)
    k, trials = 3, 100_000
    drafts = rng.choice(len(p), size=(trials, k), p=q)
    out, num_accepted = rejection_sample(
        drafts,
        np.broadcast_to(q, (trials, k, len(p))),
        np.broadcast_to(p, (trials, k + 1, len(p))),
        rng.random((trials, k)),
        rng.random(trials),
    )
    print(f"\nk = {k}, {trials} verify steps with this p and q at every position:")
    print("first token freq ", np.bincount(out[:, 0], minlength=len(p)) / trials, " ~ p")
    alpha = np.minimum(p, q).sum()
    print(f"tokens per pass   {(num_accepted + 1).mean():.3f}  expected "
          f"(1 - α^(k+1)) / (1 - α) = {(1 - alpha ** (k + 1)) / (1 - alpha):.3f}")
