"""Paged attention of the tuned CPU backend, compiled: every query reads its keys and values
straight from the blocks its block table names.

WHY. The reference gathers each sequence's context into one array per layer, then runs a
softmax over it: over long contexts the copy is most of a decode step (16 decodes over 1,000
keys copy 24 MB per layer, 30 layers a step). A compiled loop has no reason to copy: it
follows the block table key by key, as vLLM's CPU kernel and FlashDecoding do.

THE WORK. A task is one sequence of at most MAX_QUERY_LEN query tokens (a decode row is one
token, a verify row 1 + k); tasks are split between the threads (prange). Its R = tokens x H
query rows attend keys 0 .. its last token's position. Per task, with s = (q · scale) · k
(cpu_simd.py's vectors: the head dimension must be a whole number of them):

    pass 1   key by key through the block table (`block_tables[i, n // block_size]`
             holds key n at offset `n % block_size`), each key read once for all R rows:
             the scores
    pass 2   per row: m = max s, p = exp(s - m), l = Σ p (a stable softmax; exp by
             cpu_exp.exp32, vectorised)
    pass 3   key by key again, each value read once: o += p · v for the R rows;
             out = o / l

Each row runs over the keys up to its own position only (causal), so a token's sums are
grouped and ordered the same in a decode as in a verify chunk: bitwise the same output.

So K and V are read once per task, in block order (a block's slots of all kv heads are
contiguous), and nothing the size of a context is written but the task's scores (R x keys
floats, in cache). Longer chunks (prefills) run as the NumPy tiles of cpu_attention.py over
OpenBLAS, which measured as fast from 16 query tokens up (a float32 score here is a dot
product of 64 terms finished by a horizontal sum; OpenBLAS's sgemm runs many queries per key
at full width). One thread, SmolLM2 shapes (9 heads, 3 kv heads of 64), blocks of 16, 8
sequences over 200 keys each, ms per layer (load 3):

    query tokens per sequence     1      2      5      8      16
    compiled                    0.20   0.36   0.64   0.90   2.78
    NumPy (views, tiles)        0.30   0.78   1.18   1.26   2.60

A prefix several rows share is read from the cache by each of them (where the first left it,
in cache); the NumPy forms read it once for all, as one matrix product, and are faster on
one thread there: 16 decodes over a shared 1000-token prefix, 30 layers, 31 against 46 ms.

EQUALITY. The reference's softmax(q · Kᵀ · scale + mask) · V in float32, the same products
summed in another order (dot products by vector lanes, the sums key by key): within float32
rounding (tests/test_backend_equality_cpu.py and test_backend_equality_cpu_attention.py).
"""

from __future__ import annotations

import numpy as np

from refserve.backends.compiled import jit, prange
from refserve.backends.cpu_exp import exp32
from refserve.backends.cpu_simd import LANES, vadd, vfma, vload, vsplat, vstore, vsum, vzero

MAX_QUERY_LEN = 8    # longer chunks (prefills) run as NumPy tiles over OpenBLAS (below)


def attention_tasks(query_start_loc: np.ndarray, max_query_len: int = MAX_QUERY_LEN
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The step's sequences split by query length (host arrays): (tasks, long) where tasks
    [N, 3] int64 holds rows (sequence, first token, stop token) of the sequences with at
    most `max_query_len` query tokens (decodes, verifies), and `long` the other sequences'
    indices (prefill chunks)."""
    q_lens = np.diff(np.asarray(query_start_loc, dtype=np.int64))
    short = q_lens <= max_query_len
    seqs = np.flatnonzero(short)
    tasks = np.stack([seqs, query_start_loc[:-1][short], query_start_loc[1:][short]], axis=1)
    return tasks.astype(np.int64).reshape(-1, 3), np.flatnonzero(~short)


@jit(inline=True)
def _dot(a, i, b, j, vectors):
    """a[i : i + n] · b[j : j + n] for n = vectors · LANES (flat arrays), by lanes: two
    running sums, so that consecutive multiply-adds do not wait for each other."""
    even, odd = vzero(), vzero()
    for v in range(0, vectors - 1, 2):
        even = vfma(vload(a, i + v * LANES), vload(b, j + v * LANES), even)
        odd = vfma(vload(a, i + (v + 1) * LANES), vload(b, j + (v + 1) * LANES), odd)
    if vectors % 2:
        v = vectors - 1
        even = vfma(vload(a, i + v * LANES), vload(b, j + v * LANES), even)
    return vsum(vadd(even, odd))


@jit(inline=True)
def _axpy(p, b, j, acc, i, vectors):
    """acc[i : i + n] += p · b[j : j + n] for n = vectors · LANES (flat arrays)."""
    weight = vsplat(p)
    for v in range(vectors):
        at = i + v * LANES
        vstore(acc, at, vfma(weight, vload(b, j + v * LANES), vload(acc, at)))


@jit(inline=True)
def _walk(accumulate, cache, rows_flat, scores, table, block_size, num_kv_heads, group,
          first, tokens, vectors):
    """Every (key n, row r) pair of a task in key order, key n read from the flat cache
    (`cache`, slot table[n // block_size] · block_size + n % block_size) once for the rows
    that see it (token t sees keys 0 .. first + t; row r = t · H + h, h of kv head n's).
    accumulate=False (pass 1): scores[r, n] = rows_flat[r] · k_n, rows_flat the queries;
    accumulate=True (pass 3): rows_flat[r] += scores[r, n] · v_n, rows_flat the outputs."""
    head_dim = vectors * LANES
    num_heads = num_kv_heads * group
    for n in range(first + tokens):
        slot = table[n // block_size] * block_size + n % block_size
        for kv in range(num_kv_heads):
            at = (slot * num_kv_heads + kv) * head_dim
            for t in range(max(0, n - first), tokens):
                for h in range(kv * group, (kv + 1) * group):
                    r = t * num_heads + h
                    if accumulate:
                        _axpy(scores[r, n], cache, at, rows_flat, r * head_dim, vectors)
                    else:
                        scores[r, n] = _dot(rows_flat, r * head_dim, cache, at, vectors)


@jit(parallel=True)
def paged_attention_kernel(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                           tasks, scale, out):
    """out[t, h] = softmax(q[t, h] · K[:p+1, kv]ᵀ · scale) · V[:p+1, kv] for every query
    token t of every task (module docstring), kv = h // G, p = t's position.

    q, out [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D], all C-contiguous
    float32 with D a multiple of LANES; block_tables [S, max_blocks]; context_lens [S];
    query_start_loc [S+1]; tasks [N, 3] from `attention_tasks`; scale float32."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group, vectors = num_heads // num_kv_heads, head_dim // LANES
    keys, values = k_cache.reshape(-1), v_cache.reshape(-1)
    for task in prange(tasks.shape[0]):
        seq, t0, t1 = tasks[task, 0], tasks[task, 1], tasks[task, 2]
        tokens = t1 - t0
        # Token t0 + t sits at position first + t and sees keys 0 .. first + t.
        first = context_lens[seq] - (query_start_loc[seq + 1] - t0)
        num_keys = first + tokens                           # the task's last token's keys
        rows = tokens * num_heads                           # row r = t · H + h
        queries = (q[t0:t1] * scale).reshape(-1)            # [rows · D]
        scores = np.empty((rows, num_keys), dtype=np.float32)
        _walk(False, keys, queries, scores, block_tables[seq], block_size, num_kv_heads,
              group, first, tokens, vectors)                # pass 1: q · k
        total = np.empty(rows, dtype=np.float32)
        for r in range(rows):                               # pass 2: softmax
            visible = first + r // num_heads + 1
            top = scores[r, 0]
            for n in range(1, visible):
                top = max(top, scores[r, n])
            mass = np.float32(0)
            for n in range(visible):
                e = exp32(scores[r, n] - top)
                scores[r, n] = e
                mass += e
            total[r] = mass
        acc = np.zeros(rows * head_dim, dtype=np.float32)
        _walk(True, values, acc, scores, block_tables[seq], block_size, num_kv_heads,
              group, first, tokens, vectors)                # pass 3: p · v
        for t in range(tokens):
            for h in range(num_heads):
                r = t * num_heads + h
                for d in range(head_dim):
                    out[t0 + t, h, d] = acc[r * head_dim + d] / total[r]
