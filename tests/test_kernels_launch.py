"""cuda_launch: the v1/v2 rule, launch geometry and the argument checks (pure Python, no GPU)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refserve.backends import cuda_launch as cl

H200_SMS = 132


# ------------------------------------------------------------------ choose_partitioning


def test_short_contexts_run_v1():
    part = cl.choose_partitioning(num_seqs=1, num_heads=32, num_kv_heads=8,
                                  max_context_len=512, num_sms=H200_SMS)
    assert part == cl.Partitioning(False, 512, 1)


def test_few_sequences_with_long_contexts_run_v2():
    part = cl.choose_partitioning(num_seqs=1, num_heads=32, num_kv_heads=8,
                                  max_context_len=513, num_sms=H200_SMS)
    assert part == cl.Partitioning(True, 512, 2)
    part = cl.choose_partitioning(16, 32, 8, 32768, H200_SMS)
    assert part.use_v2 and part.max_partitions == 64


def test_many_sequences_run_v1_even_with_long_contexts():
    # 64 sequences x 8 KV heads = 512 blocks >= 2 per SM: the GPU is already full.
    part = cl.choose_partitioning(64, 32, 8, 32768, H200_SMS)
    assert not part.use_v2 and part.max_partitions == 1


@given(num_seqs=st.integers(1, 300), num_kv_heads=st.sampled_from([1, 2, 8]),
       group=st.sampled_from([1, 4, 9]), max_context_len=st.integers(1, 40000),
       partition_size=st.sampled_from([256, 512]))
def test_rule_and_grid_cover_the_longest_context(num_seqs, num_kv_heads, group,
                                                 max_context_len, partition_size):
    num_heads = num_kv_heads * group
    part = cl.choose_partitioning(num_seqs, num_heads, num_kv_heads, max_context_len,
                                  H200_SMS, partition_size)
    blocks = num_seqs * num_kv_heads * cl.head_chunks(num_heads, num_kv_heads)
    long_context = max_context_len > partition_size
    assert part.use_v2 == (long_context and blocks < cl.MIN_BLOCKS_PER_SM * H200_SMS)
    if part.use_v2:
        assert (part.max_partitions - 1) * partition_size < max_context_len
        assert part.max_partitions * partition_size >= max_context_len


def test_choose_partitioning_rejects_nonpositive_sizes():
    with pytest.raises(ValueError, match="num_seqs=0"):
        cl.choose_partitioning(0, 32, 8, 100, H200_SMS)


def test_head_chunks_split_groups_larger_than_max_group():
    assert cl.head_chunks(32, 8) == 1
    assert cl.head_chunks(9, 1) == 2
    assert cl.head_chunks(64, 4) == 2
    assert cl.head_chunks(8 * cl.MAX_GROUP, 8) == 1


# ------------------------------------------------------------------------ launches


def attention_arrays(dtype="float16", num_tokens=3, num_heads=4, num_kv_heads=2, head_dim=64):
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype]
    q = np.zeros((num_tokens, num_heads, head_dim), dtype=np_dtype)
    cache = np.zeros((6, 16, num_kv_heads, head_dim), dtype=np_dtype)
    return dict(out=np.zeros_like(q), q=q, k_cache=cache, v_cache=cache.copy(),
                block_tables=np.zeros((num_tokens, 2), dtype=np.int32),
                context_lens=np.ones(num_tokens, dtype=np.int32),
                query_start_loc=np.arange(num_tokens + 1, dtype=np.int32))


def all_launches(dtype="float16"):
    a = attention_arrays(dtype)
    part = cl.Partitioning(True, 16, 2)
    shapes = cl.v2_workspace_shapes(3, 4, 64, 2)
    work = [np.zeros(shapes[n], dtype=np.float32) for n in ("tmp_out", "max_logits",
                                                            "exp_sums")]
    k = np.zeros((3, 2, 64), dtype=a["q"].dtype)
    return [
        cl.decode_v1_launch(*a.values(), 0.125, 3, dtype),
        *cl.decode_v2_launches(*a.values(), 0.125, 3, part, *work, dtype),
        cl.varlen_launch(*a.values(), 0.125, 3, 1, dtype),
        cl.write_kv_launch(k, k, a["k_cache"], a["v_cache"], np.zeros(3, dtype=np.int64)),
        cl.copy_blocks_launch(a["k_cache"], a["v_cache"], np.array([[0, 1]], dtype=np.int64)),
    ]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_scalar_argument_is_a_sized_numpy_scalar(dtype):
    """A bare Python int/float would reach the kernel as 64 bits (CuPy's rule)."""
    for launch in all_launches(dtype):
        assert launch.kernel in cl.name_expressions()
        for arg in launch.args:
            assert isinstance(arg, (np.ndarray, np.int32, np.int64, np.float32)), (
                launch.kernel, arg)


def test_grids_follow_the_kernel_headers():
    v1, v2, reduce, varlen, write, copy = all_launches()
    assert v1.grid == (3, 2, 1) and v1.block == (cl.NUM_THREADS, 1, 1)
    assert v2.grid == (3, 2, 2)                # (S, Hkv * head_chunks, max_partitions)
    assert reduce.grid == (3, 4, 1) and reduce.block == (64, 1, 1)  # (S, H), D threads
    assert varlen.grid == (2, 2, 1)            # tokens from token_offset = 1
    assert write.grid == (3, 1, 1)
    assert copy.grid == (1, 2, 1)              # (pairs, k and v)
    assert v1.kernel == "paged_attention_v1_kernel<__half, 64, 128>"
    assert reduce.kernel == "paged_attention_v2_reduce_kernel<__half>"


def test_q_stride_of_a_fused_qkv_view_is_in_elements():
    a = attention_arrays("float16")
    qkv = np.zeros((3, (4 + 2 * 2) * 64), dtype=np.float16)
    a["q"] = qkv[:, : 4 * 64].reshape(3, 4, 64)
    launch = cl.decode_v1_launch(*a.values(), 0.125, 3, "float16")
    assert launch.args[7] == np.int32(8 * 64)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(q=a["q"].astype(np.float32), out=a["out"].astype(np.float32)),
     "not a float16 array"),
    (lambda a: a.update(block_tables=a["block_tables"].astype(np.int64)), "block_tables"),
    (lambda a: a.update(context_lens=a["context_lens"][::-1]), "context_lens"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :, :1]), "must be equal"),
    (lambda a: a.update(q=np.zeros((3, 4, 80), np.float16), out=np.zeros((3, 4, 80),
                                                                         np.float16)),
     "head_dim"),
    (lambda a: a.update(q=np.zeros((3, 2 * 4 * 64 + 4), np.float16)[:, :256].reshape(3, 4, 64)),
     "multiples of 16 bytes"),
    # row counts that disagree: the kernel would read past an array's end
    (lambda a: a.update(context_lens=a["context_lens"][:2].copy()), "need 3 query_start_loc"),
    (lambda a: a.update(query_start_loc=a["query_start_loc"][:3].copy()),
     "3 context_lens need 4"),
    (lambda a: a.update(block_tables=a["block_tables"][:2].copy()), "3 block-table rows"),
    (lambda a: a.update(context_lens=np.ones(2, np.int32), block_tables=np.zeros((2, 2),
                        np.int32), query_start_loc=np.arange(3, dtype=np.int32)),
     "num_seqs=3: the metadata has 2 rows"),
])
def test_attention_launch_refuses_bad_arrays(change, message):
    a = attention_arrays("float16")
    change(a)
    with pytest.raises(ValueError, match=message):
        cl.decode_v1_launch(*a.values(), 0.125, 3, "float16")


def test_varlen_launch_must_cover_every_row():
    a = attention_arrays("float16")
    with pytest.raises(ValueError, match="covers every row"):
        cl.varlen_launch(*a.values(), 0.125, 2, 1, "float16")


def test_write_kv_launch_is_none_for_no_tokens_and_checks_slot_dtype():
    cache = np.zeros((2, 8, 1, 64), dtype=np.float32)
    k = np.zeros((0, 1, 64), dtype=np.float32)
    assert cl.write_kv_launch(k, k, cache, cache.copy(), np.zeros(0, np.int64)) is None
    k = np.zeros((2, 1, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        cl.write_kv_launch(k, k, cache, cache.copy(), np.zeros(2, np.int32))


def test_copy_pairs_independence():
    assert cl.copy_pairs_are_independent(np.array([[0, 2], [0, 3], [1, 4]]), 5)
    assert cl.copy_pairs_are_independent(np.zeros((0, 2), np.int64), 5)
    # a chain 1 -> 2 -> 3: block 2 is read and written, so one launch could read it late
    assert not cl.copy_pairs_are_independent(np.array([[1, 2], [2, 3]]), 5)
    with pytest.raises(ValueError, match="destination block appears twice"):
        cl.copy_pairs_are_independent(np.array([[0, 2], [1, 2]]), 5)
    with pytest.raises(ValueError, match="block ids"):
        cl.copy_pairs_are_independent(np.array([[0, 5]]), 5)


def test_name_expressions_are_unique_and_complete():
    names = cl.name_expressions()
    # 3 attention kernels x 3 dtypes x 2 head dims, 3 reduces, 2 rejection samplers, 2 copies
    assert len(names) == len(set(names)) == 3 * 3 * 2 + 3 + 2 + 2
    assert "rejection_sample_kernel<double>" in names
    assert "varlen_paged_attention_kernel<__nv_bfloat16, 128, 128>" in names
