"""The tuned CPU backend (`backend="cpu"`, what `backend="auto"` picks without a GPU).

It is the NumPy reference (numpy_backend.py) with the ops a CPU runs faster another way
overridden; every other op is the reference's own. tests/test_backend_equality_cpu.py
proves each override equal to the reference, and tests/test_default_model.py the greedy
tokens of the real model identical on both.

    linear           the few-row product forms, one per weight shape, chosen by a short
                     calibration when the weight is prepared (few_row_matmul.py). Differs
                     from the reference's x @ W.T only in float rounding: the same products,
                     summed in another order.
    paged_attention  every decode row (q_len == 1) in one vectorised batch gathered into
                     reused scratch buffers; contiguous-cache contexts read as views; prefill
                     chunks in query tiles that skip the keys after the tile. Differs from
                     the reference only in float rounding (scores and sums in another order).
    sample           the nucleus found by bisection instead of a sort of the whole row
                     (cpu_sampling.py). The same min_p and top_k sets and the same draw; the
                     top_p mass is summed in another order, so a token whose larger-logit
                     mass lies within float32 rounding of top_p may be kept by one and not
                     the other.

Thread policy: BLAS uses its own threads; the two-thread few-row form (chunked2) is kept by
calibration only where it wins (few_row_matmul.py).
"""

from __future__ import annotations

import math

import numpy as np

from refserve.backends.base import PAD_BLOCK, AttentionMetadata
from refserve.backends.cpu_sampling import sample_tokens
from refserve.backends.few_row_matmul import DenseWeight, fixed_plan
from refserve.backends.numpy_backend import NumpyBackend, check_attention_shapes

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


class CpuBackend(NumpyBackend):
    """The reference with the CPU speed-ups of the module docstring."""

    name = "cpu"

    def __init__(self, matmul: str | None = None) -> None:
        """`matmul`: one few-row form for every weight (few_row_matmul.FORMS, e.g. "plain"
        to time the products as one gemv / sgemm each); None: REFSERVE_MATMUL, else
        calibrated per weight shape."""
        self._plan = None if matmul is None else fixed_plan(matmul)
        # Reusable gather buffers for the decode batch, one per cache ("k", "v"), grown to the
        # largest batch seen. A fresh multi-MB array per layer costs a page fault per 4 KiB
        # page, which measured as 2/3 of the gather time; reusing the memory removes it.
        # Nothing returned to the caller aliases these buffers.
        self._scratch: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------ dense products

    def prepare_weight(self, weight: np.ndarray) -> DenseWeight:
        """W [out, in] stored in the layout of its shape's plan (calibrated on first use of
        the shape, then cached per process): see few_row_matmul.py."""
        return DenseWeight(weight, self._plan)

    def weight_matrix(self, weight: DenseWeight) -> np.ndarray:
        """W [out, in]: the stored array or a transposed view of it (never a copy)."""
        return weight.out_in

    def linear(self, x: np.ndarray, weight: DenseWeight) -> np.ndarray:
        """x · Wᵀ by the form the weight's plan names for x's row count. Differs from the
        reference's x @ W.T only in float rounding (the same products, another order)."""
        return weight(x)

    # ------------------------------------------------------- paged_attention

    def paged_attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                        attn: AttentionMetadata, scale: float) -> np.ndarray:
        """q `[T, H, D]` -> out `[T, H, D]`, same dtype. See `Backend.paged_attention`.

        Rows 0 .. num_decodes-1 (q_len == 1) go through one vectorised batch; the others
        (chunks of q_len > 1) are computed one sequence at a time, their sizes read from the
        metadata's host copies. No device value is read back: every `if` and every size
        below is a host scalar of `attn` or an array shape.
        """
        check_attention_shapes(q, k_cache, v_cache)
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

    def _decode_plan(self, attn: AttentionMetadata, block_size: int):
        """What every layer's decode batch shares, built by the first layer of the step and
        cached on the metadata: (gather table [B, nb], key limit, mask bias [B, 1, 1, keys]).

        Gather table: the first nb = ceil(max_decode_context_len / block_size) columns of the
        decode rows' block tables, with PAD_BLOCK entries replaced by the row's own first block,
        so the gather never dereferences a padding id (the keys read there are masked).
        """
        plan = attn.backend_cache.get("cpu_decode")
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
            plan = attn.backend_cache["cpu_decode"] = (table, num_keys, bias)
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

    # ---------------------------------------------------------------- sampling

    def sample(self, logits, temperature, top_k, top_p, min_p, uniforms) -> np.ndarray:
        """See `Backend.sample` and cpu_sampling.py (the nucleus by bisection)."""
        return sample_tokens(logits, temperature, top_k, top_p, min_p, uniforms)
