"""The NumPy reference backend: every data-plane op written the plainest correct way, on the CPU.

This is the backend the course reads (`backend="numpy"`). Each op is its definition in NumPy:

    forward          model.forward(the step's arrays), eagerly
    linear           x @ W.T
    write_kv         k_slots[slot_mapping] = k                 (one scatter)
    copy_blocks      cache[dst] = cache[src]
    swap_out/in      host[dst] = cache[src]; cache[dst] = host[src]
    paged_attention  one sequence at a time: gather its keys and values through its block
                     table, then softmax(q · Kᵀ · scale + causal mask) · V
    sampling_weights sort each row, keep what min_p / top_k / top_p keep
    sample           the inverse CDF of those weights at the row's uniform
    rejection_sample refserve/sampling/rejection_sampler.py (Backend.rejection_sample)

Nothing here exists for speed. The tuned CPU backend (cpu_backend.py, `backend="cpu"`, what
`backend="auto"` picks without a GPU) overrides the ops a CPU runs faster another way, and
tests/test_backend_equality_cpu.py proves it equal to this file, op by op.

Everything runs in float32: `scale` is cast to the queries' dtype first, because a float64
scalar would silently promote every score matrix to float64.

Nothing here reads a device array back to the host (on a GPU that would stall the queue in
every layer): the per-sequence loop takes its bounds from the `AttentionMetadata`'s host
copies, like a kernel grid launched from the CPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refserve.backends.base import AttentionMetadata, Backend, check_block_pairs, check_swap


class NumpyBackend(Backend):
    """Reference backend: caches are numpy arrays in host memory, ops are numpy calls."""

    name = "numpy"
    xp = np

    # ------------------------------------------------------------------ arrays

    def to_device(self, array: Any) -> np.ndarray:
        """Identity for an ndarray (the host is the device); array-likes become ndarrays."""
        return np.asarray(array)

    to_numpy = to_device  # from the device to the host: the same identity

    def resolve_dtype(self, dtype: str) -> np.dtype:
        """float32 for "auto" and "float32"; ValueError for anything else (NumPy has no
        bfloat16, and float16 matmuls on a CPU are emulated and slow)."""
        if dtype in ("auto", "float32"):
            return np.dtype(np.float32)
        raise ValueError(f"dtype={dtype!r}: the {self.name} backend computes in float32; use "
                         "dtype='float32' or the cupy backend")

    # ------------------------------------------------------------ the model

    def forward(self, model, inputs, kv_caches) -> np.ndarray:
        """The model's forward on the step's arrays (host arrays are device arrays here)."""
        return model.forward(inputs.input_ids, inputs.positions, inputs.attn, kv_caches,
                             inputs.logits_indices)

    # ------------------------------------------------------------ dense products

    def linear(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """x @ W.T: x [T, in], W [out, in] as loaded (`prepare_weight` keeps it as it is)."""
        return x @ weight.T

    def write_kv(self, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                 slot_mapping: np.ndarray) -> None:
        """Scatter k, v `[T, num_kv_heads, head_dim]` into the flat slots of the caches;
        `slot_mapping[t] == -1` means "don't write token t". See `Backend.write_kv`.

        The flat view `[num_blocks * block_size, num_kv_heads, head_dim]` must be a view:
        `copy=False` raises where reshape would silently copy and the writes would be lost.
        """
        keep = slot_mapping >= 0
        k_cache.reshape(-1, *k.shape[1:], copy=False)[slot_mapping[keep]] = k[keep]
        v_cache.reshape(-1, *v.shape[1:], copy=False)[slot_mapping[keep]] = v[keep]

    def copy_blocks(self, k_cache: np.ndarray, v_cache: np.ndarray, src_to_dst: np.ndarray) -> None:
        """For each row (src, dst) of `src_to_dst [N, 2]`, block dst := block src, in place.

        The right-hand side `k_cache[src]` is a fancy-index gather, i.e. a copy, so all
        copies read the caches as they were before any write (a chain a->b, b->c copies the
        old b into c).
        """
        pairs = check_block_pairs(src_to_dst, len(k_cache), len(k_cache), "copy_blocks")
        src, dst = pairs[:, 0], pairs[:, 1]
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]

    def swap_out(self, k_cache, v_cache, host_k, host_v, block_mapping) -> None:
        """host_k[host] = k_cache[device] (and v) for each row (device, host): on a CPU the
        "host link" is a memcpy between two arrays. See `Backend.swap_out`."""
        pairs = check_swap(k_cache, host_k, block_mapping, to_host=True)
        check_swap(v_cache, host_v, pairs, to_host=True)
        host_k[pairs[:, 1]] = k_cache[pairs[:, 0]]
        host_v[pairs[:, 1]] = v_cache[pairs[:, 0]]

    def swap_in(self, k_cache, v_cache, host_k, host_v, block_mapping) -> None:
        """k_cache[device] = host_k[host] (and v) for each row (host, device)."""
        pairs = check_swap(k_cache, host_k, block_mapping, to_host=False)
        check_swap(v_cache, host_v, pairs, to_host=False)
        k_cache[pairs[:, 1]] = host_k[pairs[:, 0]]
        v_cache[pairs[:, 1]] = host_v[pairs[:, 0]]

    def paged_attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                        attn: AttentionMetadata, scale: float) -> np.ndarray:
        """q `[T, H, D]` -> out `[T, H, D]`, same dtype. See `Backend.paged_attention`.

        One sequence at a time, whatever its kind (a decode, a prefill chunk, a verify):
        gather its context through its block table, then causal attention of its queries
        over it.
        """
        scale = q.dtype.type(scale)
        out = np.empty_like(q)
        qsl, ctx = attn.query_start_loc_cpu, attn.context_lens_cpu
        for i in range(attn.num_seqs):
            start, end, context_len = int(qsl[i]), int(qsl[i + 1]), int(ctx[i])
            keys = gather_context(k_cache, attn.block_tables_cpu[i], context_len)  # [L, Hkv, D]
            values = gather_context(v_cache, attn.block_tables_cpu[i], context_len)
            out[start:end] = causal_attention(q[start:end], keys, values, scale)
        return out

    def sampling_weights(self, logits, temperature, top_k, top_p, min_p) -> np.ndarray:
        """The nucleus: `sampling_weights` below, with NumPy. See `Backend.sampling_weights`."""
        return sampling_weights(np, logits, temperature, top_k, top_p, min_p)

    def sample(self, logits, temperature, top_k, top_p, min_p, uniforms) -> np.ndarray:
        """One token per row: `sample_tokens` below, with NumPy. See `Backend.sample`."""
        return sample_tokens(np, logits, temperature, top_k, top_p, min_p, uniforms)


def gather_context(cache: np.ndarray, block_table: np.ndarray, num_keys: int) -> np.ndarray:
    """The first `num_keys` tokens of one sequence, `[num_keys, num_kv_heads, head_dim]`, in
    position order. `cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`;
    `block_table`: the sequence's row of physical block ids (host copy).

    Key n lives in physical block `block_table[n // block_size]` at offset `n % block_size`,
    that is in flat slot `block_table[n // block_size] * block_size + n % block_size` of the
    cache seen as one row per slot. Entries of the table past the context (PAD_BLOCK) are
    never read.
    """
    # BEGIN EXERCISE paged_attention_gather: key n is in block block_table[n // bs] at n % bs
    # ... return keys 0..num_keys-1 of `cache`: [num_keys, kv_heads, head_dim]
    block_size = cache.shape[1]
    positions = np.arange(num_keys)
    blocks = block_table[positions // block_size].astype(np.int64)
    slots = blocks * block_size + positions % block_size
    return cache.reshape(-1, *cache.shape[2:])[slots]
    # END EXERCISE


def causal_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                     scale: np.floating) -> np.ndarray:
    """softmax(q · Kᵀ · scale + causal mask) · V for one sequence's chunk of queries.

    q `[q_len, H, D]` holds the last q_len positions of the context; keys, values
    `[L, Hkv, D]` all L keys of the context (this chunk's included). Query j sits at position
    `L - q_len + j` and sees keys 0 ..= that position. Grouped-query attention: head h reads
    kv head `h // (H // Hkv)`, so each kv head is repeated for the H // Hkv heads of its
    group. Returns `[q_len, H, D]`.

    Stability: softmax(s) = exp(s - max s) / sum(exp(s - max s)). Every query sees key 0, so
    each row's max is finite, every exponent is <= 0, and a masked key gets exp(-inf) = 0.
    """
    q_len, num_heads, _ = q.shape
    context_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = np.repeat(keys, group, axis=1).transpose(1, 2, 0)       # [H, D, L]
    v = np.repeat(values, group, axis=1).transpose(1, 0, 2)     # [H, L, D]
    scores = (q * scale).transpose(1, 0, 2) @ k                 # [H, q_len, L]
    query_pos = context_len - q_len + np.arange(q_len)
    visible = np.arange(context_len)[None, :] <= query_pos[:, None]   # [q_len, L]
    scores = np.where(visible, scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    return (probs @ v).transpose(1, 0, 2)                       # [q_len, H, D]


def sampling_weights(xp: Any, logits, temperature, top_k, top_p, min_p):
    """`Backend.sampling_weights` (the nucleus of refserve/sampling/sampler.py), written against
    `xp` (numpy or cupy), so the CuPy backend runs this same code on the device.

    Every rule keeps a prefix of the row sorted largest first, so the rules are applied
    there, and the kept set is then "every logit >= the smallest kept one": ties with the
    last kept token stay, and in a run of ties the mass ranked before its first token
    decides for the whole run.
    """
    x = logits.astype(xp.float32, copy=False)
    batch, vocab = x.shape
    rows = xp.arange(batch)
    # 1/T rounded once to float32: the exponent is (x - max) · (1/T) in float32.
    inv_t = (1.0 / temperature).astype(xp.float32)
    desc = xp.sort(x, axis=-1)[:, ::-1]                            # largest first
    e = xp.exp((desc - desc[:, :1]) * inv_t[:, None])              # e[:, 0] = 1
    k = xp.where((top_k > 0) & (top_k < vocab), top_k, vocab)       # 0 or >= V: off
    keep = (desc >= desc[rows, k - 1][:, None]) & (e >= min_p[:, None])
    p = xp.where(keep, e, xp.float32(0))
    p = p / p.sum(axis=-1, keepdims=True)
    before = xp.zeros_like(p)                                       # mass ranked before
    before[:, 1:] = xp.cumsum(p[:, :-1], axis=-1)
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1)
    smallest_kept = desc[rows, keep.sum(axis=-1) - 1]
    return xp.where(x >= smallest_kept[:, None],
                    xp.exp((x - desc[:, :1]) * inv_t[:, None]), xp.float32(0))


def sample_tokens(xp: Any, logits, temperature, top_k, top_p, min_p, uniforms):
    """`Backend.sample` written against `xp`: the inverse CDF of `sampling_weights` at each
    row's uniform (int64 [B])."""
    weights = sampling_weights(xp, logits, temperature, top_k, top_p, min_p)
    cdf = xp.cumsum(weights.astype(xp.float64), axis=-1)
    target = xp.asarray(uniforms, dtype=xp.float64) * cdf[:, -1]
    return (cdf <= target[:, None]).sum(axis=-1).astype(xp.int64)
