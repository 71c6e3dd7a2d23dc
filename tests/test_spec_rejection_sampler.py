"""The rejection sampler, exactly: the emission distribution of one accept / residual step is
p (from the implementation's pieces, in float64), the op implements those pieces, and the
greedy, ragged, padded and one-hot-q cases emit exactly the tokens the rule says."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from refserve.backends.base import Backend
from refserve.backends.numpy_backend import NumpyBackend
from refserve.sampling.rejection_sampler import (
    acceptance_probability,
    inverse_cdf_draw,
    rejection_sample,
    residual_distribution,
)
from refserve.sampling.warping import warp
from refserve.sampling_params import SamplingParams

# ---------------------------------------------------------------- strategies

# Weights with exact zeros, tiny masses and near-ties (0.5 vs 0.5 + 1e-12).
WEIGHT = st.one_of(
    st.just(0.0),
    st.just(0.5),
    st.just(0.5 + 1e-12),
    st.just(1e-12),
    st.floats(1e-6, 1.0),
)


@st.composite
def p_and_q(draw):
    """A target p and a draft q over the same small vocabulary, both normalised in float64.
    q is one of: unrelated, one-hot, with support outside p's, equal to p, a near-tie of p."""
    vocab = draw(st.integers(2, 8))
    p = np.array(draw(st.lists(WEIGHT, min_size=vocab, max_size=vocab)))
    if p.sum() == 0:
        p[draw(st.integers(0, vocab - 1))] = 1.0
    p /= p.sum()
    kind = draw(st.sampled_from(["random", "one-hot", "outside p", "equal", "near-tie"]))
    if kind == "one-hot":
        q = np.zeros(vocab)
        q[draw(st.integers(0, vocab - 1))] = 1.0
    elif kind == "equal":
        q = p.copy()
    elif kind == "near-tie":
        q = p + np.array(draw(st.lists(st.just(1e-12) | st.just(0.0), min_size=vocab,
                                       max_size=vocab)))
    else:
        q = np.array(draw(st.lists(WEIGHT, min_size=vocab, max_size=vocab)))
        if kind == "outside p":
            outside = np.flatnonzero(p == 0)
            if len(outside) == 0:  # make room: drop one token from p's support
                p[draw(st.integers(0, vocab - 1))] = 0.0
                if p.sum() == 0:
                    p[0] = 1.0
                p /= p.sum()
                outside = np.flatnonzero(p == 0)
            q[outside] += 0.3
    if q.sum() == 0:
        q[draw(st.integers(0, vocab - 1))] = 1.0
    return p, q / q.sum()


# Each kind of (p, q) the rule must get right, run on every run (Hypothesis's draws may miss
# one for a whole run): a draft that over- and under-proposes with one token outside p's
# support (notebook 03's), a one-hot draft on a token p gives 0.3, q equal to p (nothing is
# ever rejected), and q entirely outside p's support (every draft is rejected).
KEY_PQ = [
    (np.array([0.10, 0.35, 0.20, 0.25, 0.10, 0.00]),
     np.array([0.30, 0.10, 0.20, 0.05, 0.10, 0.25])),
    (np.array([0.7, 0.3]), np.array([0.0, 1.0])),
    (np.array([0.5, 0.5]), np.array([0.5, 0.5])),
    (np.array([1.0, 0.0, 0.0]), np.array([0.0, 0.5, 0.5])),
]


def with_key_pq(test):
    for pq in reversed(KEY_PQ):
        test = example(pq)(test)
    return test


# -------------------------------------------------------------- exact tests


@settings(max_examples=400, deadline=None)
@given(p_and_q())
@with_key_pq
def test_one_step_emits_exactly_p(pq):
    """P(emit y) = q(y) a(y) + (Σ_x q(x) (1 - a(x))) r(y) = p(y), with a and r the
    implementation's acceptance probability and residual distribution (Theorem 1)."""
    p, q = pq
    a = acceptance_probability(p, q)
    r = residual_distribution(p, q)
    rejection_mass = np.sum(q * (1.0 - a))
    emitted = q * a + rejection_mass * r
    np.testing.assert_allclose(emitted, p, rtol=0, atol=1e-12, err_msg=(
        f"q * a + P(reject) * residual must be p (p={p}, q={q})"))


@settings(max_examples=200, deadline=None)
@given(p_and_q(), st.data())
def test_accept_test_has_the_acceptance_probability(pq, data):
    """The op accepts draft x exactly for u in [0, a(x)): checked just inside and just
    outside the boundary, so the exact test above is a statement about the op."""
    p, q = pq
    x = data.draw(st.integers(0, len(p) - 1))
    a = float(acceptance_probability(p[x], q[x]))
    inside = [0.0, a * (1 - 1e-9)] if a > 0 else []
    outside = [u for u in (a * (1 + 1e-9) + 1e-300, 1 - 1e-16) if a < 1 and u < 1]
    for u, accepted in [(u, True) for u in inside] + [(u, False) for u in outside]:
        _, num_accepted = rejection_sample(
            np.array([[x]]), q[None, None], np.stack([p, p])[None], np.array([[u]]),
            np.array([0.5]),
        )
        assert num_accepted[0] == int(accepted), (
            f"u={u!r}, p(x)={float(p[x])!r}, q(x)={float(q[x])!r}: "
            f"accepted={bool(num_accepted[0])}, "
            f"want {accepted} (accept iff u * q(x) < p(x))")


@settings(max_examples=100, deadline=None)
@given(p_and_q())
@with_key_pq
def test_recovered_token_follows_the_residual(pq):
    """After a rejection, the draw over a grid of M uniforms hits each token with frequency
    residual(t) to within 1/M per token: the op draws from `residual_distribution`."""
    p, q = pq
    rejectable = np.flatnonzero(p < q)
    if len(rejectable) == 0:
        return  # p == q: nothing can be rejected
    x = int(rejectable[0])
    m = 2048
    draws = (np.arange(m) + 0.5) / m
    out, num_accepted = rejection_sample(
        np.full((m, 1), x),
        np.broadcast_to(q, (m, 1, len(p))),
        np.broadcast_to(p, (m, 2, len(p))),
        np.full((m, 1), 1 - 1e-16),  # u · q(x) ≈ q(x) > p(x): rejected
        draws,
    )
    assert (num_accepted == 0).all(), "u * q(x) > p(x): the draft must be rejected"
    freq = np.bincount(out[:, 0], minlength=len(p)) / m
    np.testing.assert_allclose(freq, residual_distribution(p, q), atol=1.0 / m + 1e-12,
                               err_msg=f"recovered-token frequencies (p={p}, q={q}, draft "
                                       f"{x} rejected) must be norm(max(0, p - q))")
    assert (out[:, 1] == -1).all(), "after the recovered token: -1 padding"


def test_inverse_cdf_draw_interval_rule():
    """token = min{j : c_j > u · c_{V-1}}: zero-weight tokens are never drawn, boundaries
    belong to the next token with weight."""
    w = np.array([[0.0, 2.0, 0.0, 1.0, 1.0]])
    cases = {0.0: 1, 0.4999: 1, 0.5: 3, 0.7499: 3, 0.75: 4, 0.999999: 4}
    for u, token in cases.items():
        assert inverse_cdf_draw(w, np.array([u]))[0] == token, f"u={u} over weights {w[0]}"


def test_acceptance_probability_edge_cases():
    p_x = np.array([0.0, 0.0, 0.3, 0.3, 0.6])
    q_x = np.array([0.0, 0.5, 0.0, 0.6, 0.3])
    np.testing.assert_array_equal(acceptance_probability(p_x, q_x), [0, 0, 1, 0.5, 1])


# -------------------------------------------------------- the op, case by case


def _onehot(ids, vocab):
    return np.eye(vocab)[ids]


def test_greedy_is_exact_match_against_the_target_argmax():
    """Temperature 0: p and q are one-hot at their argmax; the op accepts the drafts that
    equal the target's argmax, replaces the first mismatch with it, and adds the target's
    argmax as the bonus when all match, whatever the uniforms."""
    rng = np.random.default_rng(1)
    vocab, k = 7, 3
    target_logits = rng.normal(size=(4, k + 1, vocab))
    argmax = target_logits.argmax(-1)  # [4, k+1]
    drafts = argmax[:, :k].copy()
    drafts[0, 0] = (argmax[0, 0] + 1) % vocab  # mismatch at 0
    drafts[1, 2] = (argmax[1, 2] + 1) % vocab  # mismatch at 2
    drafts[3, 1:] = -1  # one draft, matching
    greedy = [SamplingParams(temperature=0.0)] * (4 * (k + 1))
    p = warp(target_logits.reshape(-1, vocab), greedy, NumpyBackend()).reshape(4, k + 1, vocab)
    q = _onehot(np.maximum(drafts, 0), vocab)  # a greedy draft's warped q
    expected = np.array([
        [argmax[0, 0], -1, -1, -1],
        [argmax[1, 0], argmax[1, 1], argmax[1, 2], -1],
        [*argmax[2, :k], argmax[2, k]],
        [argmax[3, 0], argmax[3, 1], -1, -1],
    ])
    for seed in range(5):
        u = np.random.default_rng(seed)
        for draft_probs in (q, None):
            out, num_accepted = rejection_sample(drafts, draft_probs, p, u.random((4, k)),
                                                 u.random(4))
            q_is = "one-hot q" if draft_probs is None else "q as arrays"
            np.testing.assert_array_equal(num_accepted, [0, 2, 3, 1], err_msg=(
                f"greedy, {q_is}: num_accepted per row (drafts {drafts.tolist()}, target "
                f"argmax {argmax.tolist()})"))
            np.testing.assert_array_equal(out, expected, err_msg=(
                f"greedy, {q_is}: output tokens per row (accepted drafts, then the target's "
                "argmax)"))


def test_ragged_rows_and_padding():
    """Row b reads p at positions 0..n_b only; the bonus comes from p_{n_b}; padding comes
    back as -1; a row with no drafts is a plain draw from p_0."""
    vocab, k = 6, 3
    # p_i is one-hot at token i + 1 at every position of every row; q = p, so every
    # draft equal to i + 1 is accepted with probability 1.
    p = np.broadcast_to(_onehot(np.arange(1, k + 2), vocab), (4, k + 1, vocab)).copy()
    drafts = np.array([[1, 2, 3], [1, 2, -1], [1, -1, -1], [-1, -1, -1]])
    out, num_accepted = rejection_sample(drafts, None, p, np.full((4, k), 0.99),
                                         np.full(4, 0.3))
    np.testing.assert_array_equal(num_accepted, [3, 2, 1, 0], err_msg="num_accepted per "
                                  "row of 3, 2, 1 and 0 drafts, all accepted")
    np.testing.assert_array_equal(out, [[1, 2, 3, 4], [1, 2, 3, -1], [1, 2, -1, -1],
                                        [1, -1, -1, -1]],
                                  err_msg="tokens per row: its drafts, its bonus, -1 padding")


def test_only_the_first_rejection_counts():
    """Drafts after a rejection are discarded even if they would pass; the recovered token
    comes from the rejected position's residual."""
    p = np.tile(np.array([0.0, 0.5, 0.5, 0.0]), (1, 4, 1))
    drafts = np.array([[1, 3, 1]])  # token 3 has p = 0: rejected at position 1
    out, num_accepted = rejection_sample(drafts, None, p, np.zeros((1, 3)), np.array([0.0]))
    assert num_accepted[0] == 1, f"num_accepted {num_accepted[0]}: draft 3 (p = 0) stops it"
    np.testing.assert_array_equal(out, [[1, 1, -1, -1]], err_msg=(
        "tokens: draft 1, then the recovered token from position 1's residual"))


def test_one_hot_q_equals_explicit_one_hot_draft_probs():
    """draft_probs=None is exactly q = one-hot(x): same tokens for the same uniforms; its
    residual is p with the draft token removed."""
    rng = np.random.default_rng(2)
    batch, k, vocab = 500, 4, 5
    p = rng.dirichlet(np.ones(vocab) * 0.5, size=(batch, k + 1))
    drafts = rng.integers(0, vocab, size=(batch, k))
    drafts[::3, 2:] = -1
    u, w = rng.random((batch, k)), rng.random(batch)
    explicit = _onehot(np.maximum(drafts, 0), vocab)
    out_none, acc_none = rejection_sample(drafts, None, p, u, w)
    out_hot, acc_hot = rejection_sample(drafts, explicit, p, u, w)
    np.testing.assert_array_equal(acc_none, acc_hot, err_msg=(
        "num_accepted: draft_probs=None must be one-hot q at each draft"))
    np.testing.assert_array_equal(out_none, out_hot, err_msg=(
        "tokens: draft_probs=None must be one-hot q at each draft"))
    r = residual_distribution(p[0, 0], _onehot(3, vocab))
    expected = p[0, 0].copy()
    expected[3] = 0
    np.testing.assert_allclose(r, expected / expected.sum(), atol=1e-15,
                               err_msg="one-hot q's residual: p without the draft token")


def test_float32_inputs_and_backend_op_agree_with_the_reference():
    rng = np.random.default_rng(3)
    batch, k, vocab = 64, 3, 11
    p = rng.dirichlet(np.ones(vocab), size=(batch, k + 1)).astype(np.float32)
    q = rng.dirichlet(np.ones(vocab), size=(batch, k)).astype(np.float32)
    drafts = rng.integers(0, vocab, size=(batch, k))
    drafts[:10, 1:] = -1
    u, w = rng.random((batch, k)), rng.random(batch)
    ref_out, ref_acc = rejection_sample(drafts, q, p, u, w)
    assert ref_out.dtype == np.int64 and ref_acc.dtype == np.int64
    assert ref_out.shape == (batch, k + 1)
    backend = NumpyBackend()
    for op in (backend.rejection_sample, lambda *a: Backend.rejection_sample(backend, *a)):
        out, acc = op(drafts, q, p, u, w)
        np.testing.assert_array_equal(out, ref_out, err_msg="the backend op's tokens")
        np.testing.assert_array_equal(acc, ref_acc, err_msg="the backend op's num_accepted")
    # Each row emits exactly num_accepted + 1 tokens, then padding.
    emitted = (ref_out >= 0).sum(axis=1)
    np.testing.assert_array_equal(emitted, ref_acc + 1,
                                  err_msg="tokens emitted per row: num_accepted + 1")


def test_no_draft_rows_only():
    """k = 0: every row is an ordinary draw from p_0."""
    p = np.array([[[0.0, 1.0, 0.0]]])
    out, acc = rejection_sample(np.zeros((1, 0), np.int64), None, p, np.zeros((1, 0)),
                                np.array([0.9]))
    np.testing.assert_array_equal(out, [[1]], err_msg="k = 0: a draw from p_0")
    np.testing.assert_array_equal(acc, [0], err_msg="k = 0: nothing to accept")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(drafts=np.array([[-1, 2]])), "padding must come after"),
        (dict(drafts=np.array([[0, 9]])), r"draft_token_ids must be in \[0, 3\)"),
        (dict(p=np.ones((1, 2, 3)) / 3), "target_probs must be"),
        (dict(q=np.ones((1, 2, 4))), "draft_probs must be"),
        (dict(u=np.array([[0.5, 1.0]])), r"accept_uniforms must lie in \[0, 1\)"),
        (dict(w=np.array([-0.1])), r"draw_uniforms must lie in \[0, 1\)"),
        (dict(w=np.array([0.1, 0.2])), "draw_uniforms must be"),
    ],
)
def test_bad_input_names_the_argument(change, message):
    args = dict(drafts=np.array([[0, 1]]), q=None, p=np.ones((1, 3, 3)) / 3,
                u=np.array([[0.5, 0.5]]), w=np.array([0.5]))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        rejection_sample(args["drafts"], args["q"], args["p"], args["u"], args["w"])
