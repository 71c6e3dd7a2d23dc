"""The accept / residual-resample kernel (kernels/rejection_sample.cu), executed on the CPU.

Fed the same arrays and uniforms as the NumPy reference
(refserve/sampling/rejection_sampler.py:rejection_sample), it must emit *identical* tokens
and accepted counts: not "close", equal, because both evaluate the same float64 operations in
the same order (the kernel's header explains how its two-pass scan reproduces NumPy's
left-to-right cumsum bit for bit).

Inputs cover what the engine produces: warped (sparse) and dense distributions, greedy rows
(one-hot p and q), n-gram drafts (draft_probs None: one-hot q), ragged rows padded with -1,
k = 0 (bonus only), drafts outside q's support, p == q (the residual is empty and falls back
to p), u = 0 (zero-weight tokens must be skipped), vocabularies below and above the block's
256 threads (empty and multi-token chunks).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from cuda_sim.sim_module import SimModule
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refserve.backends import cuda_launch as cl
from refserve.sampling.rejection_sampler import rejection_sample

pytestmark = pytest.mark.skipif(shutil.which("g++") is None,
                                reason="g++ (C++20) is needed to run the CUDA kernels on the CPU")


@pytest.fixture(scope="module")
def sim():
    return SimModule(cl.name_expressions())


def run_kernel(sim, draft_token_ids, draft_probs, target_probs, accept_uniforms, draw_uniforms):
    batch, k = draft_token_ids.shape
    output = np.full((batch, k + 1), -7, dtype=np.int64)  # -7: "never written"
    num_accepted = np.full(batch, -7, dtype=np.int64)
    sim.run_all([cl.rejection_sample_launch(output, num_accepted, draft_token_ids, draft_probs,
                                            target_probs, accept_uniforms, draw_uniforms)])
    return output, num_accepted


def distribution(rng, vocab, kind, dtype):
    """One probability row: dense, sparse (a warped top-k/top-p row), or one-hot (greedy)."""
    if kind == "one_hot":
        p = np.zeros(vocab)
        p[rng.integers(vocab)] = 1.0
    else:
        p = rng.gamma(0.3, size=vocab)
        p[rng.integers(vocab)] += 0.01  # never all zero
        if kind == "sparse":
            p[rng.random(vocab) < 0.8] = 0.0
            p[rng.integers(vocab)] += 1.0
        p /= p.sum()
    return p.astype(dtype)


@st.composite
def spec_batches(draw, max_vocab=300):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    batch = draw(st.integers(1, 4))
    k = draw(st.integers(0, 4))
    vocab = draw(st.sampled_from([1, 2, 7, 255, 256, 257, max_vocab]))
    dtype = draw(st.sampled_from([np.float32, np.float32, np.float64]))
    one_hot_q = draw(st.booleans())  # n-gram drafts: draft_probs None
    kinds = st.sampled_from(["dense", "sparse", "one_hot"])
    target = np.stack([np.stack([distribution(rng, vocab, draw(kinds), dtype)
                                 for _ in range(k + 1)]) for _ in range(batch)])
    draft_probs = None
    if not one_hot_q:
        draft_probs = np.zeros((batch, k, vocab), dtype)
        for b in range(batch):
            for i in range(k):
                draft_probs[b, i] = distribution(rng, vocab, draw(kinds), dtype)
    if draft_probs is not None and k and draw(st.booleans()):
        draft_probs[0, 0] = target[0, 0]  # p == q: a rejection there has an empty residual
    drafts = np.full((batch, k), -1, dtype=np.int64)
    for b in range(batch):
        n = draw(st.integers(0, k))  # ragged rows, -1 padded
        for i in range(n):
            if draft_probs is not None and rng.random() < 0.8:
                q = draft_probs[b, i].astype(np.float64)
                drafts[b, i] = rng.choice(vocab, p=q / q.sum())
            else:  # any token, also outside q's or p's support
                drafts[b, i] = rng.integers(vocab)
    u_kind = draw(st.sampled_from(["random", "zero", "near_one"]))
    accept_u = rng.random((batch, k))
    draw_u = {"random": rng.random(batch), "zero": np.zeros(batch),
              "near_one": np.full(batch, np.nextafter(1.0, 0.0))}[u_kind]
    return drafts, draft_probs, target, accept_u, draw_u


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(case=spec_batches())
def test_kernel_emits_exactly_the_numpy_tokens(sim, case):
    expected_tokens, expected_accepted = rejection_sample(*case)
    tokens, accepted = run_kernel(sim, *case)
    np.testing.assert_array_equal(accepted, expected_accepted)
    np.testing.assert_array_equal(tokens, expected_tokens)


def test_large_vocabulary_row_is_identical(sim):
    """V = 49152 (SmolLM2): 192 tokens per thread's chunk, long float64 chains."""
    rng = np.random.default_rng(7)
    vocab, k = 49152, 3
    target = rng.dirichlet(np.full(vocab, 0.05), size=(2, k + 1)).astype(np.float32)
    draft = rng.dirichlet(np.full(vocab, 0.05), size=(2, k)).astype(np.float32)
    drafts = np.array([[5, 17, -1], [int(np.argmax(draft[1, 0])), 3, 9]], dtype=np.int64)
    for u in (rng.random(2), np.array([0.0, 0.999999])):
        case = (drafts, draft, target, rng.random((2, k)), u)
        expected = rejection_sample(*case)
        got = run_kernel(sim, *case)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])


def test_greedy_rows_accept_exactly_the_target_argmax(sim):
    """Greedy (one-hot p and q): drafts equal to the target's argmax are accepted, the first
    other one is replaced by the target's argmax, whatever the uniforms."""
    vocab, k = 10, 3
    target = np.zeros((1, k + 1, vocab), np.float32)
    target[0, np.arange(k + 1), [4, 2, 7, 1]] = 1.0
    draft = np.zeros((1, k, vocab), np.float32)
    draft[0, np.arange(k), [4, 2, 3]] = 1.0
    drafts = np.array([[4, 2, 3]], dtype=np.int64)
    tokens, accepted = run_kernel(sim, drafts, draft, target, np.full((1, k), 0.999),
                                  np.array([0.5]))
    assert accepted.tolist() == [2] and tokens.tolist() == [[4, 2, 7, -1]]


def test_a_strict_accept_test_is_checked(sim):
    """Negative control for `u * q < p` against `<=`: with u = 0 a draft with p(x) = 0 must be
    rejected (0 < 0 is false), and the residual draw with u = 0 must skip zero-weight tokens
    (the first c_t > 0, not token 0)."""
    target = np.array([[[0.0, 0.0, 0.5, 0.5], [0.25] * 4]], np.float32)
    draft = np.array([[[0.0, 1.0, 0.0, 0.0]]], np.float32)
    case = (np.array([[1]]), draft, target, np.zeros((1, 1)), np.zeros(1))
    tokens, accepted = run_kernel(sim, *case)
    assert accepted.tolist() == [0] and tokens.tolist() == [[2, -1]]
    np.testing.assert_array_equal(tokens, rejection_sample(*case)[0])


def test_launch_checks_shapes_and_dtypes():
    drafts = np.zeros((2, 3), np.int64)
    target = np.zeros((2, 4, 5), np.float32)
    out, acc = np.zeros((2, 4), np.int64), np.zeros(2, np.int64)
    u, w = np.zeros((2, 3)), np.zeros(2)
    launch = cl.rejection_sample_launch(out, acc, drafts, None, target, u, w)
    assert launch.grid == (2, 1, 1) and launch.kernel == "rejection_sample_kernel<float>"
    assert launch.args[-1] == np.int32(0) and launch.args[3] is target
    with pytest.raises(ValueError, match="target_probs must be"):
        cl.rejection_sample_launch(out, acc, drafts, None, target[:, :3], u, w)
    with pytest.raises(ValueError, match="draft_probs must be"):
        cl.rejection_sample_launch(out, acc, drafts, np.zeros((2, 3, 5), np.float64), target,
                                   u, w)
    with pytest.raises(ValueError, match="accept_uniforms must be"):
        cl.rejection_sample_launch(out, acc, drafts, None, target, u.astype(np.float32), w)
    with pytest.raises(ValueError, match="float16"):
        cl.rejection_sample_launch(out, acc, drafts, None, target.astype(np.float16), u, w)
    empty = np.zeros((0, 3), np.int64)
    assert cl.rejection_sample_launch(np.zeros((0, 4), np.int64), np.zeros(0, np.int64), empty,
                                      None, np.zeros((0, 4, 5), np.float32), np.zeros((0, 3)),
                                      np.zeros(0)) is None


def chunked_scan_draw(w: np.ndarray, u: float, num_chunks: int = 256) -> int:
    """A plausible parallel scan: each chunk summed from 0, chunk totals scanned, then added
    back. Same math, different rounding: NOT what the reference does."""
    chunks = np.array_split(w, num_chunks)
    totals = np.array([c.sum() for c in chunks])
    starts = np.concatenate([[0.0], np.cumsum(totals)[:-1]])
    cdf = np.concatenate([s + np.cumsum(c) for s, c in zip(starts, chunks)])
    return int((cdf <= u * cdf[-1]).sum())


def test_the_scan_rounds_exactly_like_numpy_not_like_a_parallel_scan(sim):
    """Negative control for bit-exactness: one token of p = 0.5 then 2999 tokens of 2^-56.
    NumPy's left-to-right cumsum loses every 2^-56 (below half an ulp of 0.5), so with u just
    below 1 the draw is token 0; a chunked parallel scan keeps them and draws a tail token."""
    vocab = 3000
    p = np.full(vocab, 2.0**-56, dtype=np.float32)
    p[0] = 0.5
    target = p[None, None, :]
    u = np.array([np.nextafter(1.0, 0.0)])
    case = (np.zeros((1, 0), np.int64), None, target, np.zeros((1, 0)), u)
    expected, _ = rejection_sample(*case)
    assert expected.tolist() == [[0]]
    assert chunked_scan_draw(p.astype(np.float64), u[0]) > 0  # the mistake differs here
    tokens, accepted = run_kernel(sim, *case)
    assert tokens.tolist() == [[0]] and accepted.tolist() == [0]
