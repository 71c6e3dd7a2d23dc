"""The CUDA kernels (refserve/backends/kernels/*.cu), executed on the CPU, against NumPy.

The unchanged .cu sources are compiled with g++ and tests/cuda_sim/cuda_sim.h (one std::thread
per CUDA thread) and launched with exactly the `Launch` records the CuPy backend uses
(refserve/backends/cuda_launch.py), so grids, argument order and argument types are tested
too. References:
  * write_kv / copy_blocks: NumpyBackend's ops, bit for bit (they only move bytes);
  * attention: `reference_attention`, the Backend.paged_attention formula written as a plain
    float64 loop over query tokens, on the same rounded inputs.

Tolerances, elementwise |kernel - reference| <= atol + rtol * |reference|:
  float32   atol 1e-5, rtol 1e-5   (summation order only)
  float16   atol 2e-5, rtol 2^-11 + 1e-5   (one round-to-nearest of the float32 result)
  bfloat16  atol 2e-5, rtol 2^-8 + 1e-5
The kernels accumulate in float32, so the only error beyond float32 arithmetic is rounding the
output to the element type once; accumulating in float16 would fail these bounds.

Every cache is poisoned where no visible key lives: unused blocks, slots past a context's end,
and a guard block on either side of the pool (read by a PAD_BLOCK = -1 table entry) hold NaN.
A kernel that reads any of them returns NaN, and the test fails.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from cuda_sim.sim_module import SimModule
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refserve.backends import cuda_launch as cl
from refserve.backends.numpy_backend import NumpyBackend

pytestmark = pytest.mark.skipif(shutil.which("g++") is None,
                                reason="g++ (C++20) is needed to run the CUDA kernels on the CPU")

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOLERANCE = {  # (atol, rtol), see the module docstring
    "float32": (1e-5, 1e-5),
    "float16": (2e-5, 2.0**-11 + 1e-5),
    "bfloat16": (2e-5, 2.0**-8 + 1e-5),
}
PAD_BLOCK = -1


@pytest.fixture(scope="module")
def sim():
    return SimModule(cl.name_expressions())


# ------------------------------------------------------------------- element types


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 `x` stored as `dtype`: float32 / float16 arrays, bfloat16 as uint16 bits (RNE)."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x.copy()
    if dtype == "float16":
        return x.astype(np.float16)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def as_float(a: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values of an array made by `round_to`."""
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def empty(shape, dtype: str) -> np.ndarray:
    """An array of `dtype` filled with NaN: whatever a kernel fails to write stays NaN."""
    return round_to(np.full(shape, np.nan, dtype=np.float32), dtype)


def assert_close(out: np.ndarray, ref: np.ndarray, dtype: str, what: str) -> None:
    atol, rtol = TOLERANCE[dtype]
    got = as_float(out, dtype).astype(np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN in the output (a poisoned slot was read, " \
                                    "or a row was never written)"
    err = np.abs(got - ref)
    bound = atol + rtol * np.abs(ref)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (
        f"{what} ({dtype}): |kernel - reference| = {err[worst]:.3g} > {bound[worst]:.3g} "
        f"at {worst}")


def test_bfloat16_rounding_helper_is_round_to_nearest_even():
    x = np.array([1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-7 + 2.0**-9, -2.5],
                 dtype=np.float32)
    np.testing.assert_array_equal(as_float(round_to(x, "bfloat16"), "bfloat16"),
                                  [1.0, 1.0, 1.0 + 2.0**-6, 1.0 + 2.0**-7, -2.5])


# -------------------------------------------------------------------- paged batches


def reference_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                        scale, num_heads, num_kv_heads):
    """Backend.paged_attention, float64: query j of a q_len chunk sits at position
    L - q_len + j, sees keys 0 ..= position through the block table; head h reads kv head
    h // (num_heads // num_kv_heads)."""
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = np.zeros(q.shape, dtype=np.float64)
    for s, context_len in enumerate(context_lens):
        start, end = query_start_loc[s], query_start_loc[s + 1]
        for t in range(start, end):
            position = context_len - (end - start) + (t - start)
            keys = np.arange(position + 1)
            blocks, offsets = block_tables[s, keys // block_size], keys % block_size
            for h in range(num_heads):
                k = k_cache[blocks, offsets, h // group].astype(np.float64)
                v = v_cache[blocks, offsets, h // group].astype(np.float64)
                scores = k @ q[t, h].astype(np.float64) * scale
                p = np.exp(scores - scores.max())
                out[t, h] = p / p.sum() @ v
    return out


class Batch:
    """A ragged batch over a shuffled, NaN-poisoned paged cache (see the module docstring)."""

    def __init__(self, dtype, head_dim, num_kv_heads, group, block_size, context_lens, q_lens,
                 fused_qkv, seed):
        rng = np.random.default_rng(seed)
        self.dtype, self.head_dim = dtype, head_dim
        self.num_kv_heads, self.num_heads = num_kv_heads, num_kv_heads * group
        self.context_lens = np.array(context_lens, dtype=np.int32)
        self.query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        num_seqs, num_tokens = len(context_lens), int(self.query_start_loc[-1])
        blocks_needed = [-(-n // block_size) for n in context_lens]
        num_blocks = sum(blocks_needed) + 2  # two spare (poisoned) blocks
        max_blocks = max(blocks_needed) + 1  # at least one PAD_BLOCK column
        physical = rng.permutation(num_blocks)
        self.block_tables = np.full((num_seqs, max_blocks), PAD_BLOCK, dtype=np.int32)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_ref = np.full(shape, np.nan, dtype=np.float32)  # NaN wherever no visible key lives
        v_ref = np.full(shape, np.nan, dtype=np.float32)
        used = 0
        for s, n in enumerate(context_lens):
            ids = physical[used: used + blocks_needed[s]]
            used += blocks_needed[s]
            self.block_tables[s, : len(ids)] = ids
            keys = np.arange(n)
            k_ref[ids[keys // block_size], keys % block_size] = rng.standard_normal(
                (n, num_kv_heads, head_dim))
            v_ref[ids[keys // block_size], keys % block_size] = rng.standard_normal(
                (n, num_kv_heads, head_dim))
        # The pool sits between two NaN guard blocks: block -1 (PAD_BLOCK) reads the first.
        k_full = empty((num_blocks + 2,) + shape[1:], dtype)
        v_full = empty((num_blocks + 2,) + shape[1:], dtype)
        self.k_cache, self.v_cache = k_full[1:-1], v_full[1:-1]
        self.k_cache[...] = round_to(k_ref, dtype)
        self.v_cache[...] = round_to(v_ref, dtype)
        q = round_to(rng.standard_normal((num_tokens, self.num_heads, head_dim)), dtype)
        if fused_qkv:  # q as a strided view of a fused [T, (H + 2 Hkv) * D] projection
            width = (self.num_heads + 2 * num_kv_heads) * head_dim
            qkv = empty((num_tokens, width), dtype)
            qkv[:, : self.num_heads * head_dim] = q.reshape(num_tokens, -1)
            q = qkv[:, : self.num_heads * head_dim].reshape(q.shape)
            assert not q.flags.c_contiguous or num_tokens <= 1
        self.q = q
        self.scale = float(rng.uniform(0.05, 0.3))

    @property
    def num_seqs(self):
        return len(self.context_lens)

    def reference(self):
        return reference_attention(
            as_float(self.q, self.dtype), as_float(self.k_cache, self.dtype),
            as_float(self.v_cache, self.dtype), self.block_tables, self.context_lens,
            self.query_start_loc, self.scale, self.num_heads, self.num_kv_heads)

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
                self.query_start_loc)

    def out(self):
        return empty(self.q.shape, self.dtype)


@st.composite
def batches(draw, max_seqs=4, max_context=160, max_q_len=1, decodes_first=False):
    """Random shapes: dtype, head_dim, GQA group (9 > MAX_GROUP: two head chunks), block size
    8/16/32, ragged contexts from 1 key, q_len chunks (1 = decode)."""
    num_seqs = draw(st.integers(1, max_seqs))
    context_lens = draw(st.lists(st.integers(1, max_context), min_size=num_seqs,
                                 max_size=num_seqs))
    q_lens = [draw(st.integers(1, min(n, max_q_len))) for n in context_lens]
    if decodes_first:
        order = sorted(range(num_seqs), key=lambda i: q_lens[i] != 1)
        context_lens, q_lens = [context_lens[i] for i in order], [q_lens[i] for i in order]
    return Batch(
        dtype=draw(st.sampled_from(["float32", "float16", "bfloat16"])),
        head_dim=draw(st.sampled_from([64, 64, 128])),
        num_kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 3, 4, 9])),
        block_size=draw(st.sampled_from([8, 16, 32])),
        context_lens=context_lens,
        q_lens=q_lens,
        fused_qkv=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


# ------------------------------------------------------------------------ attention


@settings(SETTINGS, max_examples=12)
@given(batch=batches())
def test_decode_v1_equals_reference(sim, batch):
    out = batch.out()
    sim.run(cl.decode_v1_launch(out, *batch.args(), batch.scale, batch.num_seqs, batch.dtype))
    assert_close(out, batch.reference(), batch.dtype, "paged_attention_v1")


def run_v2(sim, batch, out, partition_size, num_seqs=None):
    """v2 + reduce over sequences 0 .. num_seqs-1 (all by default), NaN-filled workspace."""
    num_seqs = batch.num_seqs if num_seqs is None else num_seqs
    max_context_len = int(batch.context_lens[:num_seqs].max())
    part = cl.Partitioning(True, partition_size, -(-max_context_len // partition_size))
    shapes = cl.v2_workspace_shapes(num_seqs, batch.num_heads, batch.head_dim,
                                    part.max_partitions)
    work = {name: np.full(shape, np.nan, dtype=np.float32) for name, shape in shapes.items()}
    sim.run_all(cl.decode_v2_launches(out, *batch.args(), batch.scale, num_seqs, part,
                                      work["tmp_out"], work["max_logits"], work["exp_sums"],
                                      batch.dtype))


@settings(SETTINGS, max_examples=12)
@given(batch=batches(), partition_size=st.sampled_from([16, 32, 48]))
def test_decode_v2_and_reduce_equal_reference(sim, batch, partition_size):
    """Contexts up to 160 keys over 16..48-key partitions: up to 10 partitions, some
    sequences with one, partitions past a short sequence's end skipped."""
    out = batch.out()
    run_v2(sim, batch, out, partition_size)
    assert_close(out, batch.reference(), batch.dtype, "paged_attention_v2 + reduce")


@settings(SETTINGS, max_examples=10)
@given(batch=batches(max_seqs=3, max_context=96, max_q_len=5))
def test_varlen_equals_reference(sim, batch):
    """Prefill chunks and verify steps: q_len up to 5, causal inside the chunk."""
    out = batch.out()
    sim.run(cl.varlen_launch(out, *batch.args(), batch.scale, batch.num_seqs, 0, batch.dtype))
    assert_close(out, batch.reference(), batch.dtype, "varlen_paged_attention")


@settings(SETTINGS, max_examples=6)
@given(batch=batches(max_seqs=4, max_context=96, max_q_len=4, decodes_first=True),
       use_v2=st.booleans())
def test_decode_rows_then_varlen_rows_cover_a_mixed_step(sim, batch, use_v2):
    """The backend's split of one step: decode kernel on rows 0..num_decodes-1, varlen kernel
    from token_offset = num_decodes. Together they write every row once."""
    q_lens = np.diff(batch.query_start_loc)
    num_decodes = int((q_lens == 1).sum())
    out = batch.out()
    if num_decodes:
        if use_v2:
            run_v2(sim, batch, out, 32, num_seqs=num_decodes)
        else:
            sim.run(cl.decode_v1_launch(out, *batch.args(), batch.scale, num_decodes,
                                        batch.dtype))
    if num_decodes < batch.num_seqs:
        sim.run(cl.varlen_launch(out, *batch.args(), batch.scale, batch.num_seqs, num_decodes,
                                 batch.dtype))
    assert_close(out, batch.reference(), batch.dtype, "decode + varlen")


def test_poison_catches_a_read_past_the_context(sim):
    """Negative control: telling the kernel a context is one key longer makes it read a
    poisoned slot (or a PAD_BLOCK), and the output of exactly that sequence turns NaN."""
    batch = Batch("float32", 64, 1, 2, 8, context_lens=[8, 5, 13], q_lens=[1, 1, 1],
                  fused_qkv=False, seed=3)
    batch.context_lens[1] += 1  # slot 5 of its block was never written
    batch.context_lens[0] += 1  # key 8 is in the PAD_BLOCK column: the guard block
    out = batch.out()
    sim.run(cl.decode_v1_launch(out, *batch.args(), batch.scale, 3, "float32"))
    assert np.isnan(out[0]).all() and np.isnan(out[1]).all()
    assert not np.isnan(out[2]).any()


def test_v2_partials_alone_are_not_the_answer(sim):
    """Negative control for the reduce: a partition's normalised output, taken as the answer
    without rescaling by its exp-sum and max logit, is off."""
    batch = Batch("float32", 64, 1, 1, 16, context_lens=[100], q_lens=[1], fused_qkv=False,
                  seed=4)
    part = cl.Partitioning(True, 32, 4)
    shapes = cl.v2_workspace_shapes(1, 1, 64, 4)
    work = {name: np.zeros(shape, dtype=np.float32) for name, shape in shapes.items()}
    partials, _ = cl.decode_v2_launches(batch.out(), *batch.args(), batch.scale, 1, part,
                                        work["tmp_out"], work["max_logits"], work["exp_sums"],
                                        "float32")
    sim.run(partials)
    ref = batch.reference()[0, 0]
    naive_mean = work["tmp_out"][0, 0].mean(axis=0)
    assert np.abs(naive_mean - ref).max() > 1e-3
    # ...while the reduce's formula over the same partials is exact.
    w = work["exp_sums"][0, 0] * np.exp(work["max_logits"][0, 0] - work["max_logits"].max())
    np.testing.assert_allclose(w @ work["tmp_out"][0, 0] / w.sum(), ref, atol=1e-5)


# -------------------------------------------------------------------- cache writes


@settings(SETTINGS, max_examples=20)
@given(dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
       num_tokens=st.integers(0, 12), num_kv_heads=st.integers(1, 3),
       head_dim=st.sampled_from([8, 64]), block_size=st.sampled_from([8, 16, 32]),
       fused_kv=st.booleans(), data=st.data())
def test_write_kv_equals_numpy_backend(sim, dtype, num_tokens, num_kv_heads, head_dim,
                                       block_size, fused_kv, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    num_blocks = -(-num_tokens // block_size) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = round_to(rng.standard_normal(shape), dtype)
    v_cache = round_to(rng.standard_normal(shape), dtype)
    slots = rng.choice(num_blocks * block_size, size=num_tokens, replace=False)
    skip = data.draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens))
    slot_mapping = np.where(skip, -1, slots).astype(np.int64)
    kv = round_to(rng.standard_normal((num_tokens, 2, num_kv_heads, head_dim)), dtype)
    k, v = (kv[:, 0], kv[:, 1]) if fused_kv else (kv[:, 0].copy(), kv[:, 1].copy())
    k_ref, v_ref = k_cache.copy(), v_cache.copy()
    NumpyBackend().write_kv(k, v, k_ref, v_ref, slot_mapping)
    launch = cl.write_kv_launch(k, v, k_cache, v_cache, slot_mapping)
    assert (launch is None) == (num_tokens == 0)
    sim.run_all([launch])
    np.testing.assert_array_equal(k_cache, k_ref)
    np.testing.assert_array_equal(v_cache, v_ref)


@settings(SETTINGS, max_examples=20)
@given(dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
       num_blocks=st.integers(2, 12), block_size=st.sampled_from([8, 16, 32]),
       num_kv_heads=st.integers(1, 2), data=st.data())
def test_copy_blocks_equals_numpy_backend(sim, dtype, num_blocks, block_size, num_kv_heads,
                                          data):
    """Copy-on-write pairs: sources may repeat (one shared block forked twice), destinations
    are distinct and never a source."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    ids = rng.permutation(num_blocks)
    num_dst = data.draw(st.integers(0, num_blocks - 1))
    dst, sources = ids[:num_dst], ids[num_dst:]
    src = rng.choice(sources, size=num_dst)
    pairs = np.stack([src, dst], axis=1).astype(np.int64).reshape(-1, 2)
    assert cl.copy_pairs_are_independent(pairs, num_blocks)
    shape = (num_blocks, block_size, num_kv_heads, 64)
    k_cache = round_to(rng.standard_normal(shape), dtype)
    v_cache = round_to(rng.standard_normal(shape), dtype)
    k_ref, v_ref = k_cache.copy(), v_cache.copy()
    NumpyBackend().copy_blocks(k_ref, v_ref, pairs)
    sim.run_all([cl.copy_blocks_launch(k_cache, v_cache, pairs)])
    np.testing.assert_array_equal(k_cache, k_ref)
    np.testing.assert_array_equal(v_cache, v_ref)


# ------------------------------------------------------------- argument packing


def test_an_argument_of_the_wrong_width_is_refused(sim):
    """An int64 where the kernel takes int (CuPy would pass it and the kernel would misread
    it) and a bare Python float are both errors, not wrong answers."""
    batch = Batch("float32", 64, 1, 1, 8, context_lens=[4], q_lens=[1], fused_qkv=False, seed=5)
    launch = cl.decode_v1_launch(batch.out(), *batch.args(), batch.scale, 1, "float32")
    args = list(launch.args)
    args[7] = np.int64(args[7])  # q_stride
    with pytest.raises(RuntimeError, match="parameter 7"):
        sim.run(cl.Launch(launch.kernel, launch.grid, launch.block, tuple(args)))
    args[7], args[-1] = launch.args[7], float(launch.args[-1])
    with pytest.raises(TypeError, match="NumPy scalar"):
        sim.run(cl.Launch(launch.kernel, launch.grid, launch.block, tuple(args)))
    with pytest.raises(RuntimeError, match="takes 13 parameters"):
        sim.run(cl.Launch(launch.kernel, launch.grid, launch.block, launch.args[:-1]))
