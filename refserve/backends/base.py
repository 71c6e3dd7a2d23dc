"""The `Backend` interface: the data-plane ops of one engine step, plus array helpers.

The model's elementwise math (RMSNorm, RoPE, SiLU, residual adds) is written once against
`backend.xp` (numpy or cupy). The ops below live behind this interface, because they are the
ones a faster backend replaces (with kernels on a GPU, with tuned forms on a CPU):

    forward          one model forward over a prepared step                (eager, or a graph)
    prepare_weight   a weight W [out, in] in the form `linear` takes       (once, at load)
    linear           x · Wᵀ: every dense product of the model              (a matmul)
    write_kv         scatter this step's K/V into their slots              (one scatter)
    paged_attention  attention of each query over its paged context        (gather + softmax)
    copy_blocks      copy whole blocks, for copy-on-write                  (block copy)
    swap_out         device blocks -> host blocks, swap preemption         (DMA to host)
    swap_in          host blocks -> device blocks, resuming it             (DMA to device)
    sampling_weights the nucleus: temperature, min-p, top-k, top-p per row  (sort + mask)
    sample           one token per logits row: the inverse CDF of those weights (a draw)
    rejection_sample the accept / residual step of speculative decoding    (per row)

Randomness enters every op as explicit uniforms, so two backends fed the same arrays can be
compared exactly (tests/test_backend_equality_*.py).

The host side of swapping is a second pool of blocks with the same layout, in host memory
(`allocate_host_kv_cache`; its bookkeeping is refserve/kv_cache/host_pool.py).

KV cache layout (docs/architecture.md, "KV cache layout"), one pair per layer:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]   in the engine's dtype

Physical block `b` holds the tokens in slots `b * block_size ... b * block_size + block_size - 1`,
so `k_cache.reshape(-1, num_kv_heads, head_dim)[slot]` is one token's keys. The naive
contiguous cache is the special case `block_size = max_model_len`, one block per sequence.

Attention metadata: one `AttentionMetadata` per step (refserve/backends/attention_metadata.py),
built on the host by `ModelRunner.prepare` and handed unchanged to every layer. It holds the
integer arrays (slot_mapping, query_start_loc, context_lens, block_tables; decode rows first)
on the device and the scalars a kernel launch needs (num_seqs, num_decodes,
max_decode_context_len) on the host. No op may read a device array back to the host: every size
it needs is a host scalar of the metadata or an array shape.

dtype: `resolve_dtype(name)` maps EngineConfig.dtype ("auto", "float32", "float16",
"bfloat16") to the numpy dtype the backend computes and caches in, or raises ValueError.
Weights and KV cache use it; only the logits are upcast to float32.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from refserve.backends.attention_metadata import PAD_BLOCK, AttentionMetadata
from refserve.config import DTYPES

__all__ = ["PAD_BLOCK", "AttentionMetadata", "Array", "Backend"]

# An array of whichever library the backend computes with (numpy.ndarray or cupy.ndarray).
Array = Any


class Backend(abc.ABC):
    """Where the KV cache lives and how the paged-attention ops run on it.

    Subclasses set `name` (the string `get_backend` accepts) and `xp` (the array module).
    Every op works in place on caches created by `allocate_kv_cache`.
    """

    name: str
    xp: Any  # numpy or cupy: the model's dense math is written against xp

    # ------------------------------------------------------------------ arrays

    @abc.abstractmethod
    def to_device(self, array: Any) -> Array:
        """Return `array` (NumPy or array-like) as an `xp` array on this backend's device.

        Identity for an ndarray on the CPU backends; a host-to-device copy on a GPU.
        """

    @abc.abstractmethod
    def to_numpy(self, array: Array) -> np.ndarray:
        """Return `array` as a host `numpy.ndarray` (identity on the CPU backends)."""

    def resolve_dtype(self, dtype: str) -> np.dtype:
        """The numpy dtype for EngineConfig.dtype `dtype` ("auto" = this backend's default).

        The base implementation accepts every name of config.DTYPES whose numpy dtype
        exists (bfloat16 has none in plain NumPy). Raises ValueError naming the choices.
        """
        if dtype == "auto":
            return np.dtype(np.float32)
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
        try:
            return np.dtype(dtype)
        except TypeError:
            raise ValueError(f"dtype={dtype!r} is not supported by the {self.name} "
                             "backend") from None

    def free_device_memory(self) -> int | None:
        """Bytes of device memory still free (after the weights are loaded). With
        `total_device_memory` the engine sizes the KV pool by vLLM's rule: total ×
        gpu_memory_utilization - (total - free) - activations. None means the cache lives in
        host memory, sized from `EngineConfig.kv_cache_memory_bytes` instead (the CPU backends)."""
        return None

    def total_device_memory(self) -> int | None:
        """Bytes of device memory in all (None on host-memory backends)."""
        return None

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any = np.float32,
    ) -> list[tuple[Array, Array]]:
        """Allocate one `(k_cache, v_cache)` pair per layer, each zero-filled and C-contiguous.

        Shape of each array: `[num_blocks, block_size, num_kv_heads, head_dim]`.

        Zero-filled rather than uninitialised on purpose: `paged_attention` gathers whole
        blocks, so slots past a sequence's length are read (then masked to weight 0). Masking
        turns any finite value into nothing, but `0 * NaN` is NaN, so the pool must never hold
        NaN/inf garbage.
        """
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError(
                "allocate_kv_cache needs positive sizes, got "
                f"num_layers={num_layers} num_blocks={num_blocks} block_size={block_size} "
                f"num_kv_heads={num_kv_heads} head_dim={head_dim}"
            )
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return [
            (self.xp.zeros(shape, dtype=dtype), self.xp.zeros(shape, dtype=dtype))
            for _ in range(num_layers)
        ]

    # ------------------------------------------------------------ the model

    @abc.abstractmethod
    def forward(self, model, inputs, kv_caches: list[tuple[Array, Array]]) -> Array:
        """One forward of `model` over a prepared step: `inputs` is ModelRunner.prepare's
        ModelInputs (host arrays, and `inputs.attn` with the device copies of the attention
        arrays). Returns the model's logits [inputs.num_logits, V] float32 on the device.
        How the forward runs is the backend's choice: the CPU backends call model.forward
        on the host arrays; the CuPy backend copies the inputs to the device, and replays a
        CUDA graph of a whole decode step where it can (cuda_graphs.py)."""

    # ------------------------------------------------------------ dense products

    def prepare_weight(self, weight: Array) -> Any:
        """`weight` W [out, in] (Hugging Face's layout, on this device, in the model's dtype)
        in the form `linear` takes, called once per weight when the model loads. The
        reference keeps W as it is; a tuned backend may store another layout or choose a
        product form per shape here."""
        return weight

    def weight_matrix(self, weight: Any) -> Array:
        """W [out, in] of a prepared weight, never a copy (a view where the backend stores
        another layout). A tied embedding reads its rows here, so the table is stored once."""
        return weight

    @abc.abstractmethod
    def linear(self, x: Array, weight: Any) -> Array:
        """x [T, in] · Wᵀ -> [T, out], for `weight` from `prepare_weight(W)`, W [out, in].

        Every dense product of the model is this one op. x is 2-D: a (T, 1, in) batch would
        run as T separate products. The result may be a transposed view, which every later
        op accepts."""

    # ------------------------------------------------------------ data plane

    @abc.abstractmethod
    def write_kv(
        self,
        k: Array,
        v: Array,
        k_cache: Array,
        v_cache: Array,
        slot_mapping: Array,
    ) -> None:
        """Scatter this step's keys and values into their cache slots, in place.

        Shapes:
            k, v:              [T, num_kv_heads, head_dim]
            k_cache, v_cache:  [num_blocks, block_size, num_kv_heads, head_dim]
            slot_mapping:      [T] int, flat slot = block_id * block_size + offset

        For every t with `slot_mapping[t] >= 0`:
            k_cache.reshape(-1, num_kv_heads, head_dim)[slot_mapping[t]] = k[t]   (same for v)
        Tokens with slot -1 are skipped (their K/V is already cached or not wanted), and every
        other slot is left untouched.
        """

    @abc.abstractmethod
    def paged_attention(
        self,
        q: Array,
        k_cache: Array,
        v_cache: Array,
        attn: AttentionMetadata,
        scale: float,
    ) -> Array:
        """Causal attention of a ragged batch of query chunks over paged contexts.

        Shapes:
            q:                 [T, num_heads, head_dim]
            k_cache, v_cache:  [num_blocks, block_size, num_kv_heads, head_dim]
            attn:              this step's metadata (see attention_metadata.py): device
                               arrays query_start_loc [S+1], context_lens [S],
                               block_tables [S, max_blocks] (PAD_BLOCK past each context),
                               host scalars num_seqs, num_decodes,
                               max_decode_context_len
            returns out:       [T, num_heads, head_dim], same dtype as q

        Sequence i has `q_len = query_start_loc[i+1] - query_start_loc[i]` query tokens and a
        context of `L = context_lens[i]` keys (this step's keys already written). Query j of
        the chunk (0 <= j < q_len) sits at position `p = L - q_len + j` and attends keys
        0..p, read through the block table: key position `n` lives in physical block
        `block_tables[i, n // block_size]` at offset `n % block_size`. Then

            out[t, h] = softmax(q[t, h] · K[:p+1, kv]ᵀ · scale) · V[:p+1, kv]

        with grouped-query attention: head h reads kv head `kv = h // (num_heads //
        num_kv_heads)`. A prefill chunk, a decode step (q_len == 1) and a speculative verify
        are all this one case. Rows 0 .. num_decodes-1 are decodes (q_len == 1, token t is
        row t), so a backend may run them as one batch and the rest per chunk, choosing
        launch sizes from the host scalars. Never reads a block-table entry at or past
        ceil(context_lens[i] / block_size), and never reads a device value back to the host.
        """

    @abc.abstractmethod
    def copy_blocks(self, k_cache: Array, v_cache: Array, src_to_dst: Array) -> None:
        """Copy whole blocks in place (the copy half of copy-on-write).

        Shapes:
            k_cache, v_cache:  [num_blocks, block_size, num_kv_heads, head_dim]
            src_to_dst:        [N, 2] int, row (src, dst)

        For every row, every slot of block src is copied into block dst, in both caches.
        All copies read the caches as they were before any of them wrote.
        """

    # ------------------------------------------------------------ swapping

    def allocate_host_kv_cache(self, num_layers: int, num_blocks: int, block_size: int,
                               num_kv_heads: int, head_dim: int, dtype: Any = np.float32
                               ) -> list[tuple[np.ndarray, np.ndarray]]:
        """The host block pool of swap preemption: one `(host_k, host_v)` pair per layer,
        NumPy arrays `[num_blocks, block_size, num_kv_heads, head_dim]` in host memory, the
        layout of the device cache. Plain memory here; a GPU backend returns page-locked
        (pinned) memory, the only kind a copy engine can read or write asynchronously."""
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError(f"allocate_host_kv_cache needs positive sizes, got "
                             f"num_layers={num_layers} num_blocks={num_blocks}")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return [(self.host_zeros(shape, dtype), self.host_zeros(shape, dtype))
                for _ in range(num_layers)]

    def host_zeros(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A zero-filled host array for the host block pool (pinned on a GPU backend)."""
        return np.zeros(shape, dtype=dtype)

    @abc.abstractmethod
    def swap_out(self, k_cache: Array, v_cache: Array, host_k: np.ndarray,
                 host_v: np.ndarray, block_mapping: np.ndarray) -> None:
        """Copy whole device blocks into host blocks: a preempted sequence leaves the GPU.

        Shapes:
            k_cache, v_cache:  [num_blocks, block_size, num_kv_heads, head_dim]  (device)
            host_k, host_v:    [num_host_blocks, block_size, num_kv_heads, head_dim] (host),
                               same dtype
            block_mapping:     [N, 2] int, a HOST (NumPy) array, row (device block, host block)

        For every row: host_k[host] = k_cache[device], host_v[host] = v_cache[device]. Host
        blocks are distinct. The copies may still be in flight on return (a GPU enqueues them
        on the current stream, so they run before any later kernel: a device block freed
        right after swap_out may be reused by the next forward); read the host arrays only
        after synchronizing.
        """

    @abc.abstractmethod
    def swap_in(self, k_cache: Array, v_cache: Array, host_k: np.ndarray,
                host_v: np.ndarray, block_mapping: np.ndarray) -> None:
        """Copy host blocks back into device blocks: a swapped-out sequence resumes.

        Shapes as in `swap_out`; block_mapping rows are (host block, device block). For every
        row: k_cache[device] = host_k[host], same for v. Device blocks are distinct. Enqueued
        before the forward that reads them, so that forward sees the copied KV.
        """

    def startup_note(self) -> str:
        """How this backend runs, for the engine's start-up line ("" for nothing to say):
        the tuned CPU backend names its thread policy there."""
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    # ---------------------------------------------------------------- sampling

    @abc.abstractmethod
    def sampling_weights(self, logits: Array, temperature: np.ndarray, top_k: np.ndarray,
                         top_p: np.ndarray, min_p: np.ndarray) -> Array:
        """THE NUCLEUS of refserve/sampling/sampler.py's docstring, row by row: the unnormalised
        distribution a token is drawn from.

        Shapes and dtypes (B rows, V = vocabulary size; host or device arrays, the backend
        moves what it needs):
            logits       [B, V]  float32  after the logits processors
            temperature  [B]     float64  > 0 (a greedy row never gets here: its token is
                                          the argmax)
            top_k        [B]     int64    0 (or >= V): off
            top_p        [B]     float32  1: off
            min_p        [B]     float32  0: off
            returns      [B, V]  float32  on this backend's device

        Row b, with x = logits[b]: e = exp((x - max x) · (1/T)), 1/T rounded once to
        float32, on the tokens min_p, top_k and top_p keep, exactly 0 elsewhere. Ties are
        decided on logits, never on rounded probabilities. The plain sampler (`sample`) and
        speculative decoding's p and q (sampling/warping.py) both read these weights, so
        both keep the same set.
        """

    @abc.abstractmethod
    def sample(self, logits: Array, temperature: np.ndarray, top_k: np.ndarray,
               top_p: np.ndarray, min_p: np.ndarray, uniforms: np.ndarray) -> Array:
        """One token id per row of logits: the inverse CDF of the row's `sampling_weights`
        at its uniform.

        Arguments as `sampling_weights`, plus uniforms [B] float64, u in [0, 1), one per
        row; returns [B] int64 token ids on this backend's device:
            token = min{t : c_t > u · c_{V-1}},  c = running sum of the weights in token-id
                                                 order, in float64
        so a token of weight 0 is never drawn.
        """

    # ------------------------------------------------------ speculative decoding

    def rejection_sample(
        self,
        draft_token_ids: Array,
        draft_probs: Array | None,
        target_probs: Array,
        accept_uniforms: Array,
        draw_uniforms: Array,
    ) -> tuple[Array, Array]:
        """The accept / residual-resample step of speculative decoding for B rows.

        Shapes and dtypes (V = vocabulary size, k = max drafts per row):
            draft_token_ids  [B, k]       int64    drafts x_i; -1 padding after a row's n_b
            draft_probs      [B, k, V]    float32  warped q_i, or None: one-hot q (n-gram)
            target_probs     [B, k+1, V]  float32  warped p_i; p_{n_b} is the bonus row
            accept_uniforms  [B, k]       float64  u_i in [0, 1), one per draft position
            draw_uniforms    [B]          float64  u in [0, 1), one per row
            returns output_token_ids [B, k+1] int64 (-1 padded), num_accepted [B] int64

        Contract (refserve/sampling/rejection_sampler.py states it in full), in float64:
          * draft i of row b is accepted iff accept_uniforms[b, i] * q_i(x_i) < p_i(x_i)
            (q_i(x_i) = 1 when draft_probs is None); num_accepted[b] is the length of the
            leading run of accepted drafts; uniforms at or after the first rejection and
            under padding are read by nobody.
          * the row then emits one token at position j = num_accepted[b], drawn with
            draw_uniforms[b] by inverse CDF from w = max(0, p_j - q_j) (recovered token;
            w = p_j if that is all zero) or, if j == n_b, from w = p_j (bonus token):
            token = min{t : c_t > u * c_{V-1}}, c = cumsum(w) in float64 in index order.
        So backends given the same arrays emit the same tokens. This default runs the NumPy
        reference on host copies; a GPU backend replaces it with a kernel.
        """
        from refserve.sampling.rejection_sampler import rejection_sample

        host = self.to_numpy
        output_token_ids, num_accepted = rejection_sample(
            host(draft_token_ids),
            None if draft_probs is None else host(draft_probs),
            host(target_probs),
            host(accept_uniforms),
            host(draw_uniforms),
        )
        return self.to_device(output_token_ids), self.to_device(num_accepted)


def check_block_pairs(pairs: Any, num_src_blocks: int, num_dst_blocks: int, op: str,
                      pools: tuple[str, str] = ("source", "destination")) -> np.ndarray:
    """Block copies (copy_blocks, swap_out, swap_in) as a checked [N, 2] int64 host array of
    rows (src, dst). Raises ValueError for a block id out of range or a repeated destination
    (two copies into one block: no order makes that meaningful). The one check of both
    rules: every backend's copy and swap ops call it. `pools` names the two columns."""
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    for col, limit, name in ((0, num_src_blocks, pools[0]), (1, num_dst_blocks, pools[1])):
        if ((pairs[:, col] < 0) | (pairs[:, col] >= limit)).any():
            raise ValueError(f"{op}: {name} block ids must be in [0, {limit}), got "
                             f"{pairs[:, col].tolist()}")
    dst = pairs[:, 1]
    if len(np.unique(dst)) != len(dst):
        raise ValueError(f"{op}: a destination block appears twice in {dst.tolist()}")
    return pairs


def check_swap(cache: Any, host: np.ndarray, block_mapping: Any, to_host: bool) -> np.ndarray:
    """`block_mapping` as a checked [N, 2] int64 host array for swap_out (to_host=True: rows
    (device, host)) or swap_in (rows (host, device)): both pools of one block layout, then
    `check_block_pairs`."""
    if tuple(cache.shape[1:]) != tuple(host.shape[1:]) or np.dtype(cache.dtype) != host.dtype:
        raise ValueError(f"swap: device blocks {tuple(cache.shape[1:])} {cache.dtype} and host "
                         f"blocks {tuple(host.shape[1:])} {host.dtype} must have one layout")
    if to_host:
        return check_block_pairs(block_mapping, cache.shape[0], host.shape[0], "swap_out",
                                 ("device", "host"))
    return check_block_pairs(block_mapping, host.shape[0], cache.shape[0], "swap_in",
                             ("host", "device"))


def contiguous_runs(pairs: np.ndarray) -> list[tuple[int, int, int]]:
    """Rows (src, dst) grouped into runs (first src, first dst, length) in which both ids
    count up by one, in row order: one copy per run instead of one per block (the host pool
    hands out consecutive blocks, so a swapped sequence often is a few runs)."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in np.asarray(pairs, dtype=np.int64).reshape(-1, 2).tolist():
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs
