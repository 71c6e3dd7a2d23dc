"""The tuned CPU backend's paged attention (cpu_attention.py) equals the reference's on the
layouts it reads differently: contexts in runs of consecutive blocks (read as views), runs
shared by several rows (a prefix cache hit, forked samples: one matmul for all readers),
runs cut where another row's run ends, leftovers gathered, partial softmaxes merged online.

Equal means |tuned - reference| <= 1e-6 + 1e-5 |reference| (float32 scores and sums in
another order), against the NumPy reference and the float64 dense attention of
test_paged_attention.py. Every threshold of the plan is forced both ways (min_view_work 1:
every piece a view; huge: every key gathered), so each path meets every case.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_paged_attention import paged_attention
from test_paged_attention import reference as dense_reference

from refserve.backends import CpuBackend, NumpyBackend, compiled
from refserve.backends.attention_metadata import PAD_BLOCK
from refserve.backends.cpu_attention import MIN_VIEW_WORK, PagedAttention, plan_decode

REFERENCE = NumpyBackend()
COMPILED = CpuBackend(kernels="compiled") if compiled.available() else None
ALL_VIEWS, DEFAULT, ALL_GATHERED = 1, MIN_VIEW_WORK, 10**9


def tuned(min_view_work: int) -> CpuBackend:
    """The NumPy forms' attention (the compiled kernel plans nothing: every row reads its
    own blocks), with this view threshold."""
    backend = CpuBackend(kernels="numpy")
    backend._attention = PagedAttention(min_view_work)
    return backend


def shared_batch(rng, block_size, num_kv_heads, group, head_dim, prefix_len, rows,
                 consecutive=True, twins=0, spare_blocks=2):
    """A ragged batch whose rows start with one shared prefix of `prefix_len` tokens (its
    full blocks shared, as the prefix cache shares them) and go on with their own tokens.

    rows: (own_len, q_len) per row, own_len >= 1 tokens after the prefix; decodes are put
    first. consecutive: physical ids handed out in order (the first row's own blocks right
    after the prefix's, so its run crosses the end of the shared part, as a fresh pool hands
    them out), else shuffled. twins: that many extra decode rows repeating the first decode
    row's whole table and length (forked samples before copy-on-write: a shared, partly
    filled last block). Returns test_paged_attention.build_batch's tuple.
    """
    num_heads = num_kv_heads * group
    rows = sorted(rows, key=lambda r: r[1] != 1)
    shared_blocks = prefix_len // block_size  # only full blocks are shared
    own = [prefix_len - shared_blocks * block_size + n for n, _ in rows]
    counts = [-(-n // block_size) for n in own]
    num_blocks = shared_blocks + sum(counts) + spare_blocks
    ids = np.arange(num_blocks) if consecutive else rng.permutation(num_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = (rng.standard_normal(shape) * 100).astype(np.float32)  # garbage: must not leak
    v_cache = (rng.standard_normal(shape) * 100).astype(np.float32)
    prefix_k = rng.standard_normal((prefix_len, num_kv_heads, head_dim)).astype(np.float32)
    prefix_v = rng.standard_normal((prefix_len, num_kv_heads, head_dim)).astype(np.float32)

    tables, lens, logical, qs, next_id = [], [], [], [], shared_blocks
    for (own_len, q_len), count in zip(rows, counts):
        table = [*ids[:shared_blocks], *ids[next_id:next_id + count]]
        next_id += count
        keys = np.concatenate([prefix_k, rng.standard_normal(
            (own_len, num_kv_heads, head_dim)).astype(np.float32)])
        values = np.concatenate([prefix_v, rng.standard_normal(
            (own_len, num_kv_heads, head_dim)).astype(np.float32)])
        for pos in range(len(keys)):  # slot arithmetic by hand, independent of write_kv
            k_cache[table[pos // block_size], pos % block_size] = keys[pos]
            v_cache[table[pos // block_size], pos % block_size] = values[pos]
        tables.append(table)
        lens.append(len(keys))
        logical.append((keys, values))
        qs.append(rng.standard_normal((q_len, num_heads, head_dim)).astype(np.float32))
    num_decodes = sum(q_len == 1 for _, q_len in rows)
    if num_decodes:
        for _ in range(twins):  # decode rows stay first
            tables.insert(0, tables[0])
            lens.insert(0, lens[0])
            logical.insert(0, logical[0])
            qs.insert(0, rng.standard_normal((1, num_heads, head_dim)).astype(np.float32))
    width = max(map(len, tables)) + 1
    block_tables = np.full((len(tables), width), PAD_BLOCK, dtype=np.int32)
    for i, table in enumerate(tables):
        block_tables[i, :len(table)] = table
    q = np.concatenate(qs)
    query_start_loc = np.zeros(len(qs) + 1, dtype=np.int32)
    query_start_loc[1:] = np.cumsum([len(x) for x in qs])
    return (q, k_cache, v_cache, block_tables, np.array(lens, dtype=np.int32),
            query_start_loc, logical)


def check(batch, min_view_work):
    """The NumPy forms with this view threshold, and the compiled kernel (which reads every
    row's blocks itself, shared or not), against the reference and the dense float64 one."""
    q, k_cache, v_cache, tables, ctx, qsl, logical = batch
    scale = np.float32(1 / np.sqrt(q.shape[2]))
    ref = paged_attention(REFERENCE, q, k_cache, v_cache, tables, ctx, qsl, scale)
    for backend in (tuned(min_view_work), COMPILED):
        if backend is None:
            continue
        got = paged_attention(backend, q, k_cache, v_cache, tables, ctx, qsl, scale)
        assert got.dtype == np.float32 and got.shape == q.shape
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, dense_reference(q, logical, qsl, scale), rtol=1e-5,
                                   atol=1e-6)


@st.composite
def row(draw):
    """(own tokens after the prefix, q_len): a decode, a prefill of the own tokens, or a
    chunk of them."""
    own = draw(st.integers(1, 40))
    kind = draw(st.sampled_from(["decode", "decode", "prefill", "chunk"]))
    q_len = {"decode": 1, "prefill": own, "chunk": draw(st.integers(1, own))}[kind]
    return own, q_len


@settings(max_examples=80, deadline=None)
@given(block_size=st.sampled_from([1, 4, 16, 128]), num_kv_heads=st.sampled_from([1, 2, 3]),
       group=st.sampled_from([1, 3, 4]), head_dim=st.sampled_from([8, 64]),
       prefix_len=st.integers(0, 70), rows=st.lists(row(), min_size=1, max_size=7),
       consecutive=st.booleans(), twins=st.integers(0, 2),
       min_view_work=st.sampled_from([ALL_VIEWS, 40, DEFAULT, ALL_GATHERED]),
       seed=st.integers(0, 2**32 - 1))
def test_paged_attention_over_shared_runs_equals_the_reference(
        block_size, num_kv_heads, group, head_dim, prefix_len, rows, consecutive, twins,
        min_view_work, seed):
    """Ragged batches of decodes, prefills and chunks over a shared prefix, GQA or not, in
    runs or scattered, forked twins, every view threshold."""
    batch = shared_batch(np.random.default_rng(seed), block_size, num_kv_heads, group,
                         head_dim, prefix_len, rows, consecutive, twins)
    check(batch, min_view_work)


@pytest.mark.parametrize("min_view_work", [ALL_VIEWS, DEFAULT, ALL_GATHERED])
@pytest.mark.parametrize("consecutive", [True, False])
def test_sixteen_decodes_over_a_long_shared_prefix_at_smollm_shapes(min_view_work,
                                                                    consecutive):
    """The shared-prefix workload's decode step: 16 decodes over a 1,000-token prefix (H=9,
    Hkv=3, D=64, blocks of 16), each with 17-40 tokens of its own, beside two chunks."""
    rng = np.random.default_rng(7)
    rows = [(int(n), 1) for n in rng.integers(17, 41, size=16)] + [(30, 30), (25, 9)]
    batch = shared_batch(rng, 16, 3, 3, 64, 1000, rows, consecutive)
    check(batch, min_view_work)


def test_large_scores_do_not_overflow_the_merge():
    """Scores of hundreds (keys and queries scaled up): each piece subtracts its own max and
    the merge rescales by e^(m - M) <= 1, so nothing overflows; pieces whose max differs by
    far more than float32's exponent range still merge to the reference."""
    rng = np.random.default_rng(3)
    q, k_cache, v_cache, tables, ctx, qsl, logical = shared_batch(
        rng, 4, 1, 2, 8, 40, [(20, 1), (9, 1), (30, 1)])
    k_cache *= 30
    q *= 30
    logical = [(k * 30, v) for k, v in logical]
    check((q, k_cache, v_cache, tables, ctx, qsl, logical), ALL_VIEWS)


# ------------------------------------------------------------------------- the plan


def covered(plan, block_size):
    """Per decode row, the sorted (block, slot) pairs the plan reads for it (pieces and
    gathered blocks, with the gathered mask applied)."""
    reads: dict[int, list[tuple[int, int]]] = {}
    for piece in plan.pieces:
        rows = (range(piece.rows.start, piece.rows.stop) if isinstance(piece.rows, slice)
                else piece.rows.tolist())
        slots = [(piece.first + n // block_size, n % block_size)
                 for n in range(piece.num_keys)]
        for b in rows:
            reads.setdefault(b, []).extend(slots)
    for g in plan.gathered:
        visible = g.bias[:, 0, 0, :] == 0
        for r, b in enumerate(g.rows.tolist()):
            for n in np.flatnonzero(visible[r]):
                block = int(g.table[r, n // block_size])
                reads.setdefault(b, []).append((block, int(n % block_size)))
    return {b: sorted(v) for b, v in reads.items()}


def expected_reads(tables, lens, block_size):
    return {b: sorted((int(tables[b, n // block_size]), n % block_size) for n in range(n_))
            for b, n_ in enumerate(lens)}


@settings(max_examples=100, deadline=None)
@given(block_size=st.sampled_from([1, 2, 16]), prefix_len=st.integers(0, 60),
       rows=st.lists(st.integers(1, 40).map(lambda n: (n, 1)), min_size=1, max_size=8),
       consecutive=st.booleans(), twins=st.integers(0, 2),
       min_view_work=st.sampled_from([ALL_VIEWS, 24, DEFAULT, ALL_GATHERED]),
       seed=st.integers(0, 2**32 - 1))
def test_the_plan_reads_every_key_of_every_row_exactly_once(block_size, prefix_len, rows,
                                                            consecutive, twins,
                                                            min_view_work, seed):
    """Pieces and the gathered blocks together cover each decode row's context, slot by
    slot, once: no key missed, none counted twice, no slot past the context."""
    _, _, _, tables, lens, _, _ = shared_batch(np.random.default_rng(seed), block_size, 1, 1,
                                               4, prefix_len, rows, consecutive, twins)
    plan = plan_decode(tables, lens, block_size, min_view_work)
    assert covered(plan, block_size) == expected_reads(tables, lens, block_size)
    for piece in plan.pieces:
        assert 0 < piece.num_keys <= piece.num_blocks * block_size
        assert piece.num_keys > (piece.num_blocks - 1) * block_size


def test_a_shared_prefix_is_one_piece_for_all_its_readers():
    """16 rows over 62 shared blocks, the first row's own blocks right after them: the run
    of that row is cut where the others' runs end, and the prefix is one piece of 992 keys
    read by all 16 (one matmul); each row's own tail is gathered."""
    rows = [(17 + i, 1) for i in range(16)]  # 2 blocks of their own each
    _, _, _, tables, lens, _, _ = shared_batch(np.random.default_rng(0), 16, 1, 1, 4, 992,
                                               rows)
    plan = plan_decode(tables, lens, 16)
    assert [(p.first, p.num_blocks, p.num_keys, p.rows) for p in plan.pieces] == [
        (0, 62, 992, slice(0, 16))]
    (g,) = plan.gathered
    assert g.rows.tolist() == list(range(16))
    assert g.table.shape == (16, 2)


def test_scattered_blocks_are_gathered_and_long_runs_are_views():
    """Single-block runs are too small for a view of their own at the default threshold;
    a 30-block run (480 keys) is one."""
    tables = np.array([[5, 9, 2, 7], [10, 11, 12, 13]] + [[0] * 4], dtype=np.int32)[:2]
    tables = np.pad(tables, ((0, 0), (0, 26)), constant_values=PAD_BLOCK)
    tables[1, :30] = np.arange(10, 40)
    plan = plan_decode(tables, np.array([60, 480]), 16)
    assert [(p.first, p.num_blocks, p.rows) for p in plan.pieces] == [(10, 30, slice(1, 2))]
    (g,) = plan.gathered
    assert g.rows.tolist() == [0]
    assert g.table.tolist() == [[5, 9, 2, 7]]


def test_a_long_private_context_is_gathered_apart_from_short_tails():
    """Row 0 holds 40 scattered blocks of its own (it computed the prefix itself); rows 1-3
    have 1-2 blocks of their own. The short tails are one batch of width 2, not padded to
    row 0's 40 blocks; row 0 is a batch of its own."""
    tables = np.full((4, 40), PAD_BLOCK, dtype=np.int32)
    tables[0] = np.arange(100, 180, 2)                 # no two blocks consecutive
    tables[1, :2], tables[2, :1], tables[3, :2] = [3, 9], [5], [7, 11]
    plan = plan_decode(tables, np.array([640, 20, 16, 30]), 16)
    assert plan.pieces == ()
    assert [(g.rows.tolist(), g.table.shape) for g in plan.gathered] == [
        ([0], (1, 40)), ([1, 2, 3], (3, 2))]
    assert covered(plan, 16) == expected_reads(tables, [640, 20, 16, 30], 16)
