"""The NumPy reference backend: paged attention written as plain array math, on the CPU.

Everything runs in float32 (a stray float64 scalar would promote whole score matrices to
float64 and make attention 4-6x slower; `scale` is therefore cast to np.float32 first).

Attention, for one query at position p of a sequence whose keys are K, V:

    scores = q · K[:p+1]ᵀ · scale            (one score per visible key)
    out    = softmax(scores) · V[:p+1]

There is no attention kernel to read the paged cache directly, so each path first brings a
sequence's keys into one array:

  * decode batch (every sequence with q_len == 1): gather the blocks of all of them with their
    block tables into `[B, max_blocks * block_size, num_kv_heads, head_dim]`, mask the padding
    keys (position >= context_len), and run the whole batch as two batched matmuls.
  * per-sequence chunks (q_len > 1: prefill, a chunk in the middle of a prompt, a verify):
    gather this sequence's blocks, apply the causal mask inside the chunk.
  * contiguous special case: when a context fits in its sequence's first block (the naive
    cache with block_size = max_model_len, one block per sequence), `k_cache[block, :L]` is
    already a contiguous `[L, num_kv_heads, head_dim]` view, so it is read without any copy.

Nothing here reads a device array back to the host (which on a GPU would stall the queue in
every layer): sizes and per-sequence loop bounds come from the `AttentionMetadata`'s host
scalars and host copies, and what every layer shares (the decode gather table, the padding
mask) is built once per step and cached on the metadata.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from refserve.backends.base import PAD_BLOCK, AttentionMetadata, Backend, check_swap

# Prefill chunks are processed this many query tokens at a time, which bounds the score
# matrix at [num_heads, tile, L] floats, and lets each tile skip the keys after its last query
# (they are all causally masked), roughly halving the work of a full prefill.
_QUERY_TILE = 256

# The decode batch reads contiguous-cache contexts as per-sequence views only when the
# longest context is at least this many keys. Below it, the Python loop over sequences costs
# more than gathering the (short) contexts once and running one batched matmul. Measured on a
# 2-core CPU at SmolLM2 shapes (32 decodes): the break-even is between 32 and 48 keys.
_VIEW_MIN_CONTEXT = 48

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)


def _attend(q: np.ndarray, k_t: np.ndarray, v: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """softmax(q · Kᵀ + bias) · V over the last axis, in float32, numerically stable.

    Shapes (leading axes broadcast like np.matmul):
        q:     [..., M, D]   queries, already multiplied by `scale`
        k_t:   [..., D, N]   keys, transposed
        v:     [..., N, D]
        bias:  broadcastable to [..., M, N]: 0 where the key is visible, -inf where masked
        returns [..., M, D]

    Stability: softmax(s) = exp(s - max(s)) / sum(exp(s - max(s))); subtracting the row max
    keeps every exponent <= 0, so nothing overflows. Every row has at least one visible key,
    so the max is finite and masked keys get exactly exp(-inf) = 0.
    """
    scores = q @ k_t  # [..., M, N]
    scores += bias
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)  # in place: the score matrix is the largest temporary
    denom = scores.sum(axis=-1, keepdims=True)
    out = scores @ v  # [..., M, D]
    # Normalising after the matmul divides M*D numbers instead of M*N.
    out /= denom
    return out


class NumpyBackend(Backend):
    """Reference backend: caches are numpy arrays in host memory, ops are numpy calls."""

    name = "numpy"
    xp = np

    def __init__(self) -> None:
        # Reusable gather buffers for the decode batch, one per cache ("k", "v"), grown to the
        # largest batch seen. A fresh multi-MB array per layer costs a page fault per 4 KiB
        # page, which measured as 2/3 of the gather time; reusing the memory removes it.
        # Nothing returned to the caller aliases these buffers.
        self._scratch: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ arrays

    def to_device(self, array: Any) -> np.ndarray:
        """Identity for an ndarray (there is no device); array-likes become ndarrays."""
        return np.asarray(array)

    def to_numpy(self, array: Any) -> np.ndarray:
        """Identity for an ndarray."""
        return np.asarray(array)

    def resolve_dtype(self, dtype: str) -> np.dtype:
        """float32 for "auto" and "float32"; ValueError for anything else (NumPy has no
        bfloat16, and float16 matmuls on a CPU are emulated and slow)."""
        if dtype in ("auto", "float32"):
            return np.dtype(np.float32)
        raise ValueError(f"dtype={dtype!r}: the numpy backend computes in float32; use "
                         "dtype='float32' or the cupy backend")

    # -------------------------------------------------------------- write_kv

    def write_kv(
        self,
        k: np.ndarray,
        v: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        slot_mapping: np.ndarray,
    ) -> None:
        """Scatter k, v `[T, num_kv_heads, head_dim]` into the flat slots of the caches.

        `slot_mapping[t] == -1` means "don't write token t". See `Backend.write_kv`.
        """
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        assert k.shape == v.shape and k.shape[1:] == (num_kv_heads, head_dim), (
            f"k {k.shape} / v {v.shape} do not match cache heads {(num_kv_heads, head_dim)}"
        )
        assert slot_mapping.shape == (k.shape[0],), (
            f"slot_mapping {slot_mapping.shape} needs one slot per token ({k.shape[0]})"
        )
        # The scatter goes through a reshaped *view*; on a non-contiguous cache reshape would
        # silently return a copy and the writes would be lost.
        if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
            raise ValueError("write_kv needs C-contiguous k_cache / v_cache")
        k_slots = k_cache.reshape(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, ...]
        v_slots = v_cache.reshape(-1, num_kv_heads, head_dim)

        # Filter on the device, without asking the host whether anything is skipped (that
        # question is a device->host read). The filtered copies of k and v cost about as much
        # as the scatter itself, i.e. little next to the matmuls that produced them.
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        k_slots[slots] = k[keep]
        v_slots[slots] = v[keep]

    # ----------------------------------------------------------- copy_blocks

    def copy_blocks(self, k_cache: np.ndarray, v_cache: np.ndarray, src_to_dst: np.ndarray) -> None:
        """For each row (src, dst) of `src_to_dst [N, 2]`, block dst := block src, in place.

        The right-hand side `k_cache[src]` is a fancy-index gather, i.e. a copy, so all
        copies read the caches as they were before any write (a chain a->b, b->c copies the
        old b into c).
        """
        pairs = np.asarray(src_to_dst, dtype=np.int64).reshape(-1, 2)
        if len(pairs) == 0:
            return
        src, dst = pairs[:, 0], pairs[:, 1]
        assert len(np.unique(dst)) == len(dst), f"copy_blocks: duplicate destination in {dst}"
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]

    # ------------------------------------------------------- swap_out / swap_in

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

    # ------------------------------------------------------- paged_attention

    def paged_attention(
        self,
        q: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        attn: AttentionMetadata,
        scale: float,
    ) -> np.ndarray:
        """q `[T, H, D]` -> out `[T, H, D]`, same dtype. See `Backend.paged_attention`.

        Rows 0 .. num_decodes-1 (q_len == 1) go through one vectorised batch; the others
        (chunks of q_len > 1) are computed one sequence at a time, their sizes read from the
        metadata's host copies. No device value is read back: every `if` and every size
        below is a host scalar of `attn` or an array shape.
        """
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, (
            f"cache {k_cache.shape} / {v_cache.shape} does not match q head_dim {head_dim}"
        )
        assert num_heads % num_kv_heads == 0, (
            f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )
        # Cast once to q's dtype: a float64 scale would silently promote every score matrix.
        scale = q.dtype.type(scale)

        out = np.empty_like(q)
        num_decodes = attn.num_decodes
        if num_decodes > 0:
            out[:num_decodes] = self._decode_batch(q[:num_decodes], k_cache, v_cache, attn,
                                                   scale)
        # Host copies: the per-sequence loop is launched from the CPU, like a kernel grid.
        qsl, ctx = attn.query_start_loc_cpu, attn.context_lens_cpu
        for i in range(num_decodes, attn.num_seqs):
            start, end = int(qsl[i]), int(qsl[i + 1])
            out[start:end] = self._chunk(q[start:end], k_cache, v_cache,
                                         attn.block_tables_cpu[i], int(ctx[i]), scale)
        return out

    @staticmethod
    def _gather_context(cache: np.ndarray, block_table: np.ndarray, num_keys: int) -> np.ndarray:
        """The first `num_keys` tokens of one sequence as `[num_keys, num_kv_heads, head_dim]`.

        `block_table` is the row's host copy. Key n sits in block `block_table[n //
        block_size]` at offset `n % block_size`, so gathering the first ceil(num_keys /
        block_size) blocks and flattening them lines the keys up in position order; padding
        entries lie past those blocks and are never read. If the keys all sit in the first
        block (the contiguous cache), a slice of that block is already the answer: a view.
        """
        # BEGIN EXERCISE paged_attention_gather: key n is in block block_table[n // bs] at n % bs
        block_size = cache.shape[1]
        if num_keys <= block_size:
            return cache[block_table[0], :num_keys]
        num_blocks = -(-num_keys // block_size)
        blocks = np.take(cache, block_table[:num_blocks], axis=0)  # [nb, block_size, Hkv, D]
        return blocks.reshape(-1, *cache.shape[2:])[:num_keys]
        # END EXERCISE

    def _chunk(
        self,
        q: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        block_table: np.ndarray,
        context_len: int,
        scale: np.float32,
    ) -> np.ndarray:
        """Causal attention of one chunk of `q_len` queries `[q_len, H, D]` at the end of a
        context of `context_len` keys. Returns `[q_len, H, D]`.

        Query j sits at position `context_len - q_len + j` and sees keys 0 ..= that position.
        Grouped-query heads: q is viewed as `[Hkv, G, q_len, D]` (head h = kv * G + g, so
        h // G = kv) and each kv head's keys serve its G query heads through broadcasting.
        """
        q_len, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        first_pos = context_len - q_len  # position of query 0

        keys = self._gather_context(k_cache, block_table, context_len)  # [L, Hkv, D]
        values = self._gather_context(v_cache, block_table, context_len)
        # [L, Hkv, D] -> keys transposed per kv head [Hkv, 1, D, L] and values [Hkv, 1, L, D];
        # the 1 broadcasts over the G query heads of the group.
        k_t = keys.transpose(1, 2, 0)[:, None]
        v = values.transpose(1, 0, 2)[:, None]
        # [q_len, H, D] -> [Hkv, G, q_len, D]
        q_grouped = (q * scale).reshape(q_len, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)

        out = np.empty((num_kv_heads, group, q_len, head_dim), dtype=q.dtype)
        for start in range(0, q_len, _QUERY_TILE):
            end = min(start + _QUERY_TILE, q_len)
            # Keys after the tile's last query position are masked for the whole tile.
            num_keys = first_pos + end
            query_pos = first_pos + np.arange(start, end)  # [tile]
            key_pos = np.arange(num_keys)  # [num_keys]
            causal_bias = np.where(key_pos[None, :] <= query_pos[:, None], _ZERO, _NEG_INF)
            out[:, :, start:end] = _attend(
                q_grouped[:, :, start:end],
                k_t[..., :num_keys],
                v[..., :num_keys, :],
                causal_bias,  # [tile, num_keys], broadcast over [Hkv, G]
            )
        # [Hkv, G, q_len, D] -> [q_len, H, D]
        return out.transpose(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)

    def _decode_plan(self, attn: AttentionMetadata, block_size: int):
        """What every layer's decode batch shares, built by the first layer of the step and
        cached on the metadata: (gather table [B, nb], key limit, mask bias [B, 1, 1, keys]).

        Gather table: the first nb = ceil(max_decode_context_len / block_size) columns of the
        decode rows' block tables, with PAD_BLOCK entries replaced by the row's own first block,
        so the gather never dereferences a padding id (the keys read there are masked).
        """
        plan = attn.backend_cache.get("numpy_decode")
        if plan is None:
            batch, max_len = attn.num_decodes, attn.max_decode_context_len
            num_blocks = -(-max_len // block_size)
            table = attn.block_tables[:batch, :num_blocks]
            table = np.where(table == PAD_BLOCK, table[:, :1], table)
            # When every context fits in one block, gather only its first max_len slots (not
            # the whole, possibly max_model_len-long, block).
            num_keys = max_len if num_blocks == 1 else num_blocks * block_size
            # Key n of row b is visible iff n < context_lens[b]; the rest (the tail of a partly
            # filled block, or whole padding blocks) gets weight exp(-inf) = 0.
            visible = np.arange(num_keys)[None, :] < attn.context_lens[:batch, None]
            bias = np.where(visible, _ZERO, _NEG_INF)[:, None, None, :]
            plan = attn.backend_cache["numpy_decode"] = (table, num_keys, bias)
        return plan

    def _decode_batch(
        self,
        q: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        attn: AttentionMetadata,
        scale: np.float32,
    ) -> np.ndarray:
        """Attention of B = num_decodes single-token queries `[B, H, D]`, each at the end of
        its own context (no causal mask inside the chunk: the query sees all context_lens[b]
        keys). Returns `[B, H, D]`.

        The blocks of all B contexts are gathered into one padded batch
        `[B, num_keys, Hkv, D]` (reused scratch memory) and the whole batch runs as two
        batched matmuls. Measured at 32 decodes of 100-200 keys: gathering each row's own
        blocks in a Python loop copies 25% less but is no faster than this one `take`.
        """
        batch, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        # [B, H, D] -> [B, Hkv, G, D]: the G query heads of a kv head are the rows of one
        # matmul against that kv head's keys.
        q_grouped = (q * scale).reshape(batch, num_kv_heads, group, head_dim)
        max_len = attn.max_decode_context_len
        if _VIEW_MIN_CONTEXT <= max_len <= block_size:
            # Contiguous cache: every context is a view of its first block, no gather. The
            # loop reads lengths and block ids from the metadata's host copies.
            out = np.empty_like(q_grouped)
            for b in range(batch):
                block, length = attn.block_tables_cpu[b, 0], attn.context_lens_cpu[b]
                out[b] = _attend(
                    q_grouped[b],  # [Hkv, G, D]
                    k_cache[block, :length].transpose(1, 2, 0),  # [Hkv, D, L] view
                    v_cache[block, :length].transpose(1, 0, 2),  # [Hkv, L, D] view
                    _ZERO,  # a decode query sees its whole context: nothing to mask
                )
            return out.reshape(batch, num_heads, head_dim)

        table, num_keys, bias = self._decode_plan(attn, block_size)
        if num_keys < block_size:
            k_cache, v_cache = k_cache[:, :num_keys], v_cache[:, :num_keys]
        keys = self._gather_blocks("k", k_cache, table)  # [B, nb, block_size', Hkv, D]
        values = self._gather_blocks("v", v_cache, table)
        keys = keys.reshape(batch, num_keys, num_kv_heads, head_dim)
        values = values.reshape(batch, num_keys, num_kv_heads, head_dim)
        out = _attend(
            q_grouped,  # [B, Hkv, G, D]
            keys.transpose(0, 2, 3, 1),  # [B, Hkv, D, num_keys]
            values.transpose(0, 2, 1, 3),  # [B, Hkv, num_keys, D]
            bias,
        )
        return out.reshape(batch, num_heads, head_dim)

    def _gather_blocks(self, which: str, cache: np.ndarray, table: np.ndarray) -> np.ndarray:
        """`cache[table]` (shape `[*table.shape, block_size, Hkv, D]`) written into a reused
        scratch buffer instead of a fresh array. Valid until the next call with `which`."""
        shape = table.shape + cache.shape[1:]
        size = math.prod(shape)
        buffer = self._scratch.get(which)
        if buffer is None or buffer.size < size or buffer.dtype != cache.dtype:
            buffer = np.empty(size, dtype=cache.dtype)
            self._scratch[which] = buffer
        out = buffer[:size].reshape(shape)
        # mode="clip" lets take write straight into `out` (the default mode="raise" gathers
        # into a temporary first). Ids come from block tables the KV-cache manager filled, with
        # padding replaced (see _decode_plan), so nothing is clipped.
        return np.take(cache, table, axis=0, out=out, mode="clip")

    # ------------------------------------------------------ speculative decoding

    def rejection_sample(
        self,
        draft_token_ids: np.ndarray,
        draft_probs: np.ndarray | None,
        target_probs: np.ndarray,
        accept_uniforms: np.ndarray,
        draw_uniforms: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The reference itself (`refserve.spec_decode.rejection_sampler.rejection_sample`);
        shapes, dtypes and how the uniforms are consumed: `Backend.rejection_sample`."""
        from refserve.spec_decode.rejection_sampler import rejection_sample

        return rejection_sample(
            draft_token_ids, draft_probs, target_probs, accept_uniforms, draw_uniforms
        )
