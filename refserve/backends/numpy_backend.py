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
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refserve.backends.base import Backend

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
        slot_mapping = np.asarray(slot_mapping)
        assert slot_mapping.shape == (k.shape[0],), (
            f"slot_mapping {slot_mapping.shape} needs one slot per token ({k.shape[0]})"
        )
        # The scatter goes through a reshaped *view*; on a non-contiguous cache reshape would
        # silently return a copy and the writes would be lost.
        if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
            raise ValueError("write_kv needs C-contiguous k_cache / v_cache")
        k_slots = k_cache.reshape(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, ...]
        v_slots = v_cache.reshape(-1, num_kv_heads, head_dim)

        keep = slot_mapping >= 0
        if keep.all():  # the common case: skip building filtered copies of k and v
            k_slots[slot_mapping] = k
            v_slots[slot_mapping] = v
        else:
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

    # ------------------------------------------------------- paged_attention

    def paged_attention(
        self,
        q: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        block_tables: np.ndarray,
        context_lens: np.ndarray,
        query_start_loc: np.ndarray,
        scale: float,
    ) -> np.ndarray:
        """q `[T, H, D]` float32 -> out `[T, H, D]` float32. See `Backend.paged_attention`.

        Sequences with q_len == 1 (decodes) go through one vectorised batch; the others
        (chunks of q_len > 1) are computed one sequence at a time.
        """
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, (
            f"cache {k_cache.shape} / {v_cache.shape} does not match q head_dim {head_dim}"
        )
        assert num_heads % num_kv_heads == 0, (
            f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )
        query_start_loc = np.asarray(query_start_loc, dtype=np.int64)
        context_lens = np.asarray(context_lens, dtype=np.int64)
        block_tables = np.asarray(block_tables)
        q_lens = np.diff(query_start_loc)
        assert query_start_loc[0] == 0 and query_start_loc[-1] == num_tokens, (
            f"query_start_loc must run from 0 to T={num_tokens}, got {query_start_loc}"
        )
        assert (q_lens >= 0).all() and (q_lens <= context_lens).all(), (
            "every chunk needs 0 <= q_len <= context_len"
        )
        # Cast once: a float64 scale would silently promote every score matrix to float64.
        scale = np.float32(scale)

        out = np.empty_like(q)
        decode = np.flatnonzero(q_lens == 1)
        if len(decode) > 0:
            rows = query_start_loc[decode]  # the single query token of each decode
            out[rows] = self._decode_batch(
                q[rows], k_cache, v_cache, block_tables[decode], context_lens[decode], scale
            )
        for i in np.flatnonzero(q_lens > 1):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            out[start:end] = self._chunk(
                q[start:end], k_cache, v_cache, block_tables[i], int(context_lens[i]), scale
            )
        assert out.dtype == q.dtype, f"attention changed dtype {q.dtype} -> {out.dtype}"
        return out

    @staticmethod
    def _gather_context(cache: np.ndarray, block_table: np.ndarray, num_keys: int) -> np.ndarray:
        """The first `num_keys` tokens of one sequence as `[num_keys, num_kv_heads, head_dim]`.

        Key n sits in block `block_table[n // block_size]` at offset `n % block_size`, so
        gathering the first ceil(num_keys / block_size) blocks and flattening them lines the
        keys up in position order. If they all sit in the first block (the contiguous cache),
        a slice of that block is already the answer: a view, no copy.
        """
        block_size = cache.shape[1]
        if num_keys <= block_size:
            return cache[block_table[0], :num_keys]
        num_blocks = -(-num_keys // block_size)
        blocks = np.take(cache, block_table[:num_blocks], axis=0)  # [nb, block_size, Hkv, D]
        return blocks.reshape(-1, *cache.shape[2:])[:num_keys]

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

    def _decode_batch(
        self,
        q: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        block_tables: np.ndarray,
        context_lens: np.ndarray,
        scale: np.float32,
    ) -> np.ndarray:
        """Attention of B single-token queries `[B, H, D]`, each at the end of its own context
        (so no causal mask inside the chunk: the query sees all context_lens[b] keys).
        Returns `[B, H, D]`.
        """
        batch, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        max_len = int(context_lens.max())
        # [B, H, D] -> [B, Hkv, G, D]: the G query heads of a kv head are the rows of one
        # matmul against that kv head's keys.
        q_grouped = (q * scale).reshape(batch, num_kv_heads, group, head_dim)

        if max_len <= block_size and max_len >= _VIEW_MIN_CONTEXT:
            # Contiguous cache: every context is a view of its first block, no gather.
            out = np.empty_like(q_grouped)
            for b in range(batch):
                length = int(context_lens[b])
                keys = k_cache[block_tables[b, 0], :length]  # [L, Hkv, D] view
                values = v_cache[block_tables[b, 0], :length]
                out[b] = _attend(
                    q_grouped[b],  # [Hkv, G, D]
                    keys.transpose(1, 2, 0),  # [Hkv, D, L]
                    values.transpose(1, 0, 2),  # [Hkv, L, D]
                    _ZERO,  # a decode query sees its whole context: nothing to mask
                )
            return out.reshape(batch, num_heads, head_dim)

        # Paged: gather every sequence's first num_blocks blocks into one padded batch.
        num_blocks = -(-max_len // block_size)
        if num_blocks == 1:
            # All contexts fit in one block: gather only its first max_len slots, not the
            # whole (possibly max_model_len-long) block.
            k_cache, v_cache = k_cache[:, :max_len], v_cache[:, :max_len]
        padded_len = num_blocks * k_cache.shape[1]
        table = block_tables[:, :num_blocks]  # [B, nb]; padding ids are valid blocks (0)
        keys = self._gather_blocks("k", k_cache, table)  # [B, nb, block_size, Hkv, D]
        values = self._gather_blocks("v", v_cache, table)
        keys = keys.reshape(batch, padded_len, num_kv_heads, head_dim)
        values = values.reshape(batch, padded_len, num_kv_heads, head_dim)
        # Key n of sequence b is visible iff n < context_lens[b]; the rest is padding (the
        # tail of a partly filled block, or whole padding blocks) and gets weight exp(-inf) = 0.
        visible = np.arange(padded_len)[None, :] < context_lens[:, None]  # [B, padded_len]
        bias = np.where(visible, _ZERO, _NEG_INF)[:, None, None, :]  # [B, 1, 1, padded_len]
        out = _attend(
            q_grouped,  # [B, Hkv, G, D]
            keys.transpose(0, 2, 3, 1),  # [B, Hkv, D, padded_len]
            values.transpose(0, 2, 1, 3),  # [B, Hkv, padded_len, D]
            bias,
        )
        return out.reshape(batch, num_heads, head_dim)

    def _gather_blocks(self, which: str, cache: np.ndarray, table: np.ndarray) -> np.ndarray:
        """`cache[table]` (shape `[*table.shape, block_size, Hkv, D]`) written into a reused
        scratch buffer instead of a fresh array. Valid until the next call with `which`."""
        assert table.min() >= 0 and table.max() < cache.shape[0], "block id out of range"
        shape = table.shape + cache.shape[1:]
        size = int(np.prod(shape))
        buffer = self._scratch.get(which)
        if buffer is None or buffer.size < size or buffer.dtype != cache.dtype:
            buffer = np.empty(size, dtype=cache.dtype)
            self._scratch[which] = buffer
        out = buffer[:size].reshape(shape)
        # mode="clip" lets take write straight into `out` (the default mode="raise" gathers
        # into a temporary first); the ids were range-checked above, so nothing is clipped.
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
