"""The tuned CPU backend (`backend="cpu"`) equals the NumPy reference, op by op.

What equal means per op (elementwise |cpu - numpy| <= atol + rtol * |numpy| where not exact):
  write_kv, copy_blocks, swap_out/in, rejection_sample   the reference's own code: exact
  linear           within float32 rounding of a reordered dot product (the bound is in
                   test_cpu_kernels.py, with the compiled kernel itself)
Every op is checked on both kinds of tuned kernels: compiled (numba) and NumPy (where numba
cannot load).
  paged_attention  atol 1e-6, rtol 1e-5 (scores and sums in another order)
  sample           identical tokens for the same uniforms: the same min_p / top_k sets, the
                   same weights and the same float64 draw; the top_p mass is summed in
                   another order, so rows within float32 rounding of the top_p boundary are
                   left out of the random cases (the fixed ones are exact)
The whole model: greedy tokens identical to the reference and to transformers on the
real model (tests/test_default_model.py runs the parity prompts on both backends).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_paged_attention import attention_case, build_batch, contiguous_copy, paged_attention
from test_paged_attention import reference as dense_reference
from test_sampling import TEMPERATURE_CASES, TIED_TOP, FixedUniform, naive

from refserve.backends import CpuBackend, NumpyBackend
from refserve.backends.cpu_attention import gather_context
from refserve.sampling import SamplingParams, draw_arguments, nucleus_arguments

REFERENCE, TUNED = NumpyBackend(), CpuBackend()
# Both kinds of tuned kernels: compiled (numba; what runs wherever it loads) and the NumPy
# forms (where it cannot).
KERNELS = {"compiled": CpuBackend(kernels="compiled"), "numpy": CpuBackend(kernels="numpy")}
SETTINGS = settings(deadline=None, max_examples=40,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# ------------------------------------------------------------------ the inherited ops


@pytest.mark.parametrize("op", ["write_kv", "copy_blocks", "swap_out", "swap_in",
                                "rejection_sample", "allocate_kv_cache", "resolve_dtype",
                                "to_device", "to_numpy"])
def test_the_ops_it_does_not_tune_are_the_references_own(op):
    assert getattr(CpuBackend, op) is getattr(NumpyBackend, op)


def test_the_ops_it_tunes_are_its_own():
    for op in ("prepare_weight", "weight_matrix", "linear", "paged_attention", "sample"):
        assert getattr(CpuBackend, op) is not getattr(NumpyBackend, op), op


# ---------------------------------------------------------------------------- linear


@pytest.mark.parametrize("rows", [1, 2, 5, 17, 64, 65, 300])
@pytest.mark.parametrize("kernels", KERNELS)
def test_linear_equals_the_reference_product(rows, kernels):
    """The compiled kernel (1, 2 and 4-row blocks, a partial panel: 700 = 10 panels of 64
    and 60 rows) and the NumPy product, from a decode row to a prefill chunk."""
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((700, 96), dtype=np.float32)
    x = rng.standard_normal((rows, 96), dtype=np.float32)
    backend = KERNELS[kernels]
    prepared = backend.prepare_weight(w)
    got = backend.linear(x, prepared)
    expected = REFERENCE.linear(x, REFERENCE.prepare_weight(w))
    assert got.shape == expected.shape == (rows, 700) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # The prepared weight gives W back from what it stores (a tied embedding's rows), no
    # second copy: a view (NumPy forms) or rows read from the packed panels (compiled).
    back = backend.weight_matrix(prepared)
    np.testing.assert_array_equal(np.asarray(back), w)
    np.testing.assert_array_equal(back[np.array([0, 699, 5])], w[[0, 699, 5]])
    stored = prepared.panels if backend.compiled else prepared.data
    assert np.shares_memory(back.panels if backend.compiled else back, stored)


# ------------------------------------------------------------------- paged_attention


def both(*batch, scale, tuned=TUNED):
    q, k_cache, v_cache, tables, ctx, qsl = batch
    ref = paged_attention(REFERENCE, q, k_cache, v_cache, tables, ctx, qsl, scale)
    got = paged_attention(tuned, q, k_cache, v_cache, tables, ctx, qsl, scale)
    assert got.dtype == ref.dtype == np.float32 and got.shape == ref.shape
    return got, ref


@pytest.mark.parametrize("kernels", KERNELS)
@settings(max_examples=60, deadline=None)
@given(case=attention_case())
def test_paged_attention_equals_the_reference(kernels, case):
    rng = np.random.default_rng(case["seed"])
    batch = build_batch(rng, case["block_size"], case["num_kv_heads"], case["group"],
                        case["head_dim"], case["chunks"])
    scale = 1.0 / np.sqrt(case["head_dim"])
    got, ref = both(*batch[:6], scale=scale, tuned=KERNELS[kernels])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    # And the naive contiguous cache (the decode batch's view path) gives the same.
    ctx, logical = batch[4], batch[6]
    kc, vc, tables = contiguous_copy(logical, int(ctx.max()) + 5, rng)
    got, ref = both(batch[0], kc, vc, tables, ctx, batch[5], scale=scale,
                    tuned=KERNELS[kernels])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("block_size", [16, 2048])
def test_paged_attention_at_smollm_shapes(block_size, kernels):
    """SmolLM2 shapes (H=9, Hkv=3, D=64): a decode batch with contexts past the view
    threshold (48 keys), a full prefill of 600 and a mid-prompt chunk of 300 (several query
    tiles of 256), on a paged cache and on the contiguous one."""
    rng = np.random.default_rng(block_size)
    chunks = [(int(c), 1) for c in rng.integers(60, 260, size=10)]
    chunks += [(600, 600), (700, 300), (90, 1)]
    q, k_cache, v_cache, tables, ctx, qsl, logical = build_batch(rng, 16, 3, 3, 64, chunks)
    if block_size == 2048:
        k_cache, v_cache, tables = contiguous_copy(logical, block_size, rng)
    got, ref = both(q, k_cache, v_cache, tables, ctx, qsl, scale=np.float32(1 / 8),
                    tuned=KERNELS[kernels])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, dense_reference(q, logical, qsl, 1 / 8), rtol=1e-5,
                               atol=1e-6)


def test_a_contiguous_context_is_read_as_a_view():
    """When a context fits in its first block the keys are a slice, not a gathered copy."""
    k_cache = np.zeros((3, 64, 2, 8), dtype=np.float32)
    keys = gather_context(k_cache, np.array([2, 0]), 40)
    assert keys.shape == (40, 2, 8)
    assert np.shares_memory(keys, k_cache)


def test_results_do_not_alias_the_reused_gather_buffers():
    """The decode batch gathers into scratch buffers reused across calls (and across shapes);
    an earlier call's output must survive a later call."""
    backend = CpuBackend(kernels="numpy")
    rng = np.random.default_rng(3)
    first = build_batch(rng, 8, 2, 3, 16, [(30, 1), (17, 1), (5, 1)])
    out1 = paged_attention(backend, *first[:6], 0.25)
    kept = out1.copy()
    second = build_batch(rng, 8, 2, 3, 16, [(60, 1), (3, 1)])  # bigger, then smaller
    out2 = paged_attention(backend, *second[:6], 0.25)
    third = build_batch(rng, 8, 2, 3, 16, [(9, 1)])
    out3 = paged_attention(backend, *third[:6], 0.25)
    np.testing.assert_array_equal(out1, kept)
    for (q, *_, qsl, logical), out in [(first, out1), (second, out2), (third, out3)]:
        np.testing.assert_allclose(out, dense_reference(q, logical, qsl, 0.25), rtol=1e-5,
                                   atol=1e-6)


# ---------------------------------------------------------------------------- sample


def draw(backend, logits, params, uniforms):
    args = draw_arguments(params, [FixedUniform(u) for u in uniforms])
    return backend.sample(np.asarray(logits, np.float32), **args).tolist()


def near_a_top_p_boundary(row, params) -> bool:
    """Whether some token's larger-logit mass lies within float32 rounding of top_p (where
    the two sums, in different orders, may decide differently)."""
    if params.greedy or params.top_p >= 1.0:
        return False
    return not naive(row, params.temperature, params.top_k, params.top_p, params.min_p,
                     margin=1e-5)[1]


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.3, 0.8, 1.0, 1.7, 4.0]),
    top_k=st.sampled_from([0, 1, 3, 20, 400]),
    top_p=st.sampled_from([1.0, 0.95, 0.9, 0.5, 0.05]),
    min_p=st.sampled_from([0.0, 0.02, 0.3]),
)


@SETTINGS
@given(data=st.data(), vocab=st.sampled_from([1, 2, 5, 50, 300, 3000]),
       batch=st.integers(1, 9))
def test_sample_draws_the_reference_tokens(data, vocab, batch):
    """Random rows (quantised ones have ties), random settings and uniforms: the same kept
    set, bitwise the same weights, the same tokens."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = (rng.standard_normal((batch, vocab)) * data.draw(st.sampled_from([0.5, 3, 9])))
    logits = logits.astype(np.float32)
    if data.draw(st.booleans()):
        logits = np.round(logits)
    params = [data.draw(params_strategy) for _ in range(batch)]
    keep = [not near_a_top_p_boundary(row, p) for row, p in zip(logits, params)]
    assume(any(keep))
    logits, params = logits[keep], [p for p, k in zip(params, keep) if k]
    uniforms = rng.random(len(params))
    assert draw(TUNED, logits, params, uniforms) == draw(REFERENCE, logits, params, uniforms)
    args = nucleus_arguments(params)
    np.testing.assert_array_equal(TUNED.sampling_weights(logits, **args),
                                  REFERENCE.sampling_weights(logits, **args))


@pytest.mark.parametrize("logits,temperature,top_p", [
    *[(row, t, p) for row, t, p, _ in TEMPERATURE_CASES], (TIED_TOP, 1.0, 0.5),
    ([3e-41, 2e-41, 1e-41, 0.0], 1.0, 0.5), ([5.008e-42, 0.0], 1.0, 0.5),
    ([0.0, 0.0, 0.0, -1.0], 1.0, 0.5), ([2.0, 1.0, 1.0, 1.0, 0.0], 0.7, 0.6)])
def test_sample_draws_the_reference_tokens_at_the_tie_and_temperature_cases(
        logits, temperature, top_p):
    """The fixed cases of test_sampling.py (ties at the top, exact quarter masses, logits
    whose probabilities round alike, the nucleus at a temperature): every uniform of a fine
    grid draws the same token."""
    uniforms = np.linspace(0, 1, 201, endpoint=False)
    params = [SamplingParams(temperature=temperature, top_p=top_p)] * len(uniforms)
    rows = np.repeat(np.array(logits, np.float32)[None], len(uniforms), axis=0)
    assert draw(TUNED, rows, params, uniforms) == draw(REFERENCE, rows, params, uniforms)


def test_a_row_is_drawn_the_same_alone_and_in_any_batch():
    """Each row's kept set and draw depend on that row alone, on both backends."""
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((7, 4000)) * rng.uniform(0.5, 6, (7, 1))).astype(np.float32)
    params = [SamplingParams(top_p=0.8), SamplingParams(top_k=20, temperature=0.7),
              SamplingParams(min_p=0.1), SamplingParams(), SamplingParams(top_p=0.95),
              SamplingParams(top_k=5, top_p=0.5, min_p=0.01), SamplingParams(temperature=3)]
    uniforms = rng.random(7)
    for backend in (REFERENCE, TUNED):
        together = draw(backend, logits, params, uniforms)
        alone = [draw(backend, logits[i:i + 1], [p], [u])[0]
                 for i, (p, u) in enumerate(zip(params, uniforms))]
        assert together == alone
