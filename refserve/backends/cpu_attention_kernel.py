"""Paged attention of the tuned CPU backend, compiled: every query reads its keys and values
straight from the blocks its block table names.

WHY. The reference gathers each sequence's context into one array per layer, then runs a
softmax over it: over long contexts the copy is most of a decode step (16 decodes over 1,000
keys copy 24 MB per layer, 30 layers a step). A compiled loop has no reason to copy: it
follows the block table key by key, as vLLM's CPU kernel and FlashDecoding do, and a block
that several rows share (a shared prefix) is read from the cache by each of them, where the
first reader left it.

THE WORK. A task is one sequence of at most MAX_QUERY_LEN query tokens (a decode row is one
token, a verify row 1 + k); tasks are split between the threads (prange). Its R = tokens x H
query rows attend keys 0 .. its last token's position. Per task, with s = (q · scale) · k:

    pass 1   block by block through the block table (`block_tables[i, n // block_size]`
             holds key n at offset `n % block_size`), every key read once for all R rows:
             the scores, 4 keys per pass over the head dimension
    pass 2   per row: m = max s, p = exp(s - m), l = Σ p (a stable softmax)
    pass 3   block by block again, every value read once: o += p · v for the R rows,
             4 values per pass; out = o / l

Each row runs over the keys up to its own position only (causal), so a token's sums are
grouped and ordered the same in a decode as in a verify chunk: bitwise the same output.

so K and V are read once per task, in block order (a block's slots of all kv heads are
contiguous), and nothing the size of a context is written but the task's scores (R x keys
floats, in cache). Longer chunks (prefills) run as the NumPy tiles of cpu_attention.py over
OpenBLAS, which measured faster from 16 query tokens up (a float32 score is a dot product
of 64 terms here, finished by a horizontal sum; OpenBLAS's sgemm runs a dozen queries per
key at full width): one thread, SmolLM2 shapes, ms per layer, compiled / NumPy (load 5):

    query tokens x sequences @ context     1x8@200   2x8@200   5x8@200   16x8@200
    compiled                                 0.17      0.27      0.68      2.22
    NumPy (views of block runs, tiles)       0.20      0.46      0.76      1.89

EQUALITY. The reference's softmax(q · Kᵀ · scale + mask) · V in float32, the same products
summed in another order (dot products by vector lanes, the sums key by key): within float32
rounding (tests/test_backend_equality_cpu.py, attention cases).
"""

from __future__ import annotations

import numpy as np

from refserve.backends.compiled import jit, prange
from refserve.backends.cpu_exp import exp32

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
def _scores(queries, k_cache, block, count, kv, t, h, scores, n):
    """scores[t, h, n + i] = queries[t, h] · k_cache[block, i, kv] for i < count:
    4 keys per pass over d where 4 remain (the query row loaded once for them)."""
    i = 0
    while i + 4 <= count:
        s0 = s1 = s2 = s3 = np.float32(0)
        for d in range(queries.shape[2]):
            qd = queries[t, h, d]
            s0 += qd * k_cache[block, i, kv, d]
            s1 += qd * k_cache[block, i + 1, kv, d]
            s2 += qd * k_cache[block, i + 2, kv, d]
            s3 += qd * k_cache[block, i + 3, kv, d]
        scores[t, h, n + i], scores[t, h, n + i + 1] = s0, s1
        scores[t, h, n + i + 2], scores[t, h, n + i + 3] = s2, s3
        i += 4
    while i < count:
        s = np.float32(0)
        for d in range(queries.shape[2]):
            s += queries[t, h, d] * k_cache[block, i, kv, d]
        scores[t, h, n + i] = s
        i += 1


@jit(inline=True)
def _accumulate(acc, v_cache, block, count, kv, t, h, scores, n):
    """acc[t, h] += Σ_i scores[t, h, n + i] · v_cache[block, i, kv] for i < count:
    4 values per pass over d where 4 remain (acc loaded and stored once for them)."""
    i = 0
    while i + 4 <= count:
        p0, p1 = scores[t, h, n + i], scores[t, h, n + i + 1]
        p2, p3 = scores[t, h, n + i + 2], scores[t, h, n + i + 3]
        for d in range(acc.shape[2]):
            acc[t, h, d] += (p0 * v_cache[block, i, kv, d]
                             + p1 * v_cache[block, i + 1, kv, d]
                             + p2 * v_cache[block, i + 2, kv, d]
                             + p3 * v_cache[block, i + 3, kv, d])
        i += 4
    while i < count:
        p = scores[t, h, n + i]
        for d in range(acc.shape[2]):
            acc[t, h, d] += p * v_cache[block, i, kv, d]
        i += 1


@jit(parallel=True)
def paged_attention_kernel(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                           tasks, scale, out):
    """out[t, h] = softmax(q[t, h] · K[:p+1, kv]ᵀ · scale) · V[:p+1, kv] for every query
    token t of every task (module docstring), kv = h // G, p = t's position.

    q, out [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables
    [S, max_blocks]; context_lens [S]; query_start_loc [S+1]; tasks [N, 3] from
    `attention_tasks`; scale float32."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for task in prange(tasks.shape[0]):
        seq, t0, t1 = tasks[task, 0], tasks[task, 1], tasks[task, 2]
        tokens = t1 - t0
        # Token t0 + t sits at position first + t and sees keys 0 .. first + t.
        first = context_lens[seq] - (query_start_loc[seq + 1] - t0)
        num_keys = first + tokens                           # the task's last token's keys
        queries = np.empty((tokens, num_heads, head_dim), dtype=np.float32)   # q · scale
        for t in range(tokens):
            for h in range(num_heads):
                for d in range(head_dim):
                    queries[t, h, d] = q[t0 + t, h, d] * scale
        scores = np.empty((tokens, num_heads, num_keys), dtype=np.float32)
        for b in range((num_keys + block_size - 1) // block_size):      # pass 1: q · k
            n = b * block_size
            for t in range(tokens):
                # Only the keys token t sees: a row's sums then run over its own keys in
                # the same groups whatever else is in the task (decode and verify agree).
                count = min(block_size, first + t + 1 - n)
                for h in range(num_heads):
                    if count > 0:
                        _scores(queries, k_cache, block_tables[seq, b], count, h // group,
                                t, h, scores, n)
        total = np.empty((tokens, num_heads), dtype=np.float32)
        for t in range(tokens):                                          # pass 2: softmax
            visible = first + t + 1
            for h in range(num_heads):
                top = scores[t, h, 0]
                for n in range(1, visible):
                    top = max(top, scores[t, h, n])
                mass = np.float32(0)
                for n in range(visible):
                    e = exp32(scores[t, h, n] - top)
                    scores[t, h, n] = e
                    mass += e
                total[t, h] = mass
        acc = np.zeros((tokens, num_heads, head_dim), dtype=np.float32)
        for b in range((num_keys + block_size - 1) // block_size):      # pass 3: p · v
            n = b * block_size
            for t in range(tokens):
                count = min(block_size, first + t + 1 - n)
                for h in range(num_heads):
                    if count > 0:
                        _accumulate(acc, v_cache, block_tables[seq, b], count, h // group,
                                    t, h, scores, n)
        for t in range(tokens):
            for h in range(num_heads):
                for d in range(head_dim):
                    out[t0 + t, h, d] = acc[t, h, d] / total[t, h]
