"""How the CUDA kernels in `kernels/*.cu` are launched: names, grids and argument lists.

Everything here is pure host-side Python on array *metadata* (shape, dtype, strides, address),
so it runs without a GPU: the CuPy backend executes the `Launch` records with
`cupy.RawModule`, and the test suite executes the very same records on the CPU through the
CUDA simulator in tests/cuda_sim. A wrong grid, a missing argument or an int64 passed where a
kernel takes an int therefore fails a CPU test, not only a GPU run.

Argument packing rule: arrays are passed as they are (a kernel parameter `T*` receives the
array's data pointer, view offset included) and every scalar is wrapped in the NumPy type of
its C parameter (`np.int32` for `int`, `np.int64` for `long long`, `np.float32` for `float`).
A bare Python int or float would reach CuPy as a 64-bit value, which a kernel declared with
`int` or `float` would misread.

Element types (EngineConfig.dtype -> CUDA type): float32 -> float, float16 -> __half,
bfloat16 -> __nv_bfloat16. Arrays of bfloat16 are uint16 arrays of the raw bits (NumPy and
CuPy have no bfloat16 dtype), so launches take the dtype *name*, not the array dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from refserve.backends.base import check_block_pairs

KERNEL_DIR = Path(__file__).parent / "kernels"
KERNEL_FILES = ("paged_attention.cu", "cache_ops.cu", "rejection_sample.cu")

CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
HEAD_DIMS = (64, 128)        # instantiated head dims (one 16-byte vector per lane per key)
NUM_THREADS = 128            # threads per attention block: 4 warps
MAX_GROUP = 8                # query heads per attention block (kMaxGroup in the .cu)
PARTITION_SIZE = 512         # keys per v2 partition
PROB_TYPES = {"float32": "float", "float64": "double"}  # rejection_sample probabilities
REJECTION_SAMPLE_THREADS = 256  # kRsThreads in rejection_sample.cu
MIN_BLOCKS_PER_SM = 2        # v1 is chosen once it launches at least this many blocks per SM
ATTENTION_KERNELS = (
    "paged_attention_v1_kernel",
    "paged_attention_v2_kernel",
    "varlen_paged_attention_kernel",
)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: `module.get_function(kernel)(grid, block, args)` in CuPy terms."""

    kernel: str                   # name expression: "paged_attention_v1_kernel<float, 64, 128>"
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[Any, ...]         # arrays and NumPy scalars, in the kernel's parameter order


def attention_kernel_name(kernel: str, dtype: str, head_dim: int) -> str:
    """The name expression of one instantiation of an attention kernel template."""
    return f"{kernel}<{CUDA_TYPES[dtype]}, {head_dim}, {NUM_THREADS}>"


def reduce_kernel_name(dtype: str) -> str:
    return f"paged_attention_v2_reduce_kernel<{CUDA_TYPES[dtype]}>"


def name_expressions(dtypes=tuple(CUDA_TYPES), head_dims=HEAD_DIMS) -> list[str]:
    """Every kernel instantiation the backend may launch (RawModule's name_expressions)."""
    names = [attention_kernel_name(k, d, h)
             for k in ATTENTION_KERNELS for d in dtypes for h in head_dims]
    names += [reduce_kernel_name(d) for d in dtypes]
    names += [rejection_sample_kernel_name(p) for p in PROB_TYPES]
    return names + ["write_kv_kernel", "copy_blocks_kernel"]


def rejection_sample_kernel_name(prob_dtype: str) -> str:
    return f"rejection_sample_kernel<{PROB_TYPES[prob_dtype]}>"


def kernel_source(file_name: str) -> str:
    return (KERNEL_DIR / file_name).read_text()


# ------------------------------------------------------------------------ v1 / v2 choice


@dataclass(frozen=True)
class Partitioning:
    use_v2: bool
    partition_size: int
    max_partitions: int   # partitions of the longest context (the v2 grid's z extent)


def head_chunks(num_heads: int, num_kv_heads: int) -> int:
    """Blocks per KV head: a block serves at most MAX_GROUP query heads of its GQA group."""
    return -(-(num_heads // num_kv_heads) // MAX_GROUP)


def choose_partitioning(num_seqs: int, num_heads: int, num_kv_heads: int,
                        max_context_len: int, num_sms: int,
                        partition_size: int = PARTITION_SIZE) -> Partitioning:
    """v1 or v2 for a decode batch, from host scalars only.

    v1 runs one block per (sequence, KV head, head chunk) over the whole context. When that
    is already at least MIN_BLOCKS_PER_SM blocks per SM (many sequences), the GPU is full and
    v2 would only add the partial-result round trip and a second launch: v1. Likewise when
    the longest context fits in one partition (short contexts): v1. Otherwise (few sequences,
    long contexts) v1 would leave most SMs idle while a few blocks walk thousands of keys, so
    v2 cuts each context into `partition_size`-key partitions that run in parallel.
    """
    if min(num_seqs, num_heads, num_kv_heads, num_sms, partition_size) <= 0:
        raise ValueError(f"choose_partitioning needs positive sizes, got num_seqs={num_seqs} "
                         f"num_heads={num_heads} num_kv_heads={num_kv_heads} "
                         f"num_sms={num_sms} partition_size={partition_size}")
    max_partitions = max(1, -(-max_context_len // partition_size))
    v1_blocks = num_seqs * num_kv_heads * head_chunks(num_heads, num_kv_heads)
    use_v2 = max_partitions > 1 and v1_blocks < MIN_BLOCKS_PER_SM * num_sms
    return Partitioning(use_v2, partition_size, max_partitions if use_v2 else 1)


# ----------------------------------------------------------------------- array checks


def _address(array: Any) -> int:
    """Data pointer of a NumPy or CuPy array (view offset included)."""
    data = array.data
    return data.ptr if hasattr(data, "ptr") else array.ctypes.data


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_int_array(name: str, array: Any, dtype: Any, ndim: int) -> None:
    _require(array.dtype == np.dtype(dtype) and array.ndim == ndim
             and array.flags.c_contiguous,
             f"{name} must be a C-contiguous {np.dtype(dtype).name} array of {ndim} dims, "
             f"got {array.dtype} {array.shape}")


def _vec16_stride(name: str, array: Any) -> int:
    """Token stride of a [T, Hkv, D] array in 16-byte vectors; heads and dims must be dense."""
    t_stride, h_stride, d_stride = array.strides
    item = array.dtype.itemsize
    _require(d_stride == item and h_stride == array.shape[2] * item,
             f"{name}: heads and dims must be contiguous (strides {array.strides})")
    _require(t_stride % 16 == 0 and _address(array) % 16 == 0,
             f"{name}: token stride {t_stride} B and address must be multiples of 16 bytes")
    return t_stride // 16


@dataclass(frozen=True)
class _Geometry:
    num_heads: int
    head_dim: int
    num_kv_heads: int
    block_size: int
    max_blocks: int
    q_stride: int     # elements between query tokens


def _attention_geometry(out, q, k_cache, v_cache, block_tables, context_lens,
                        query_start_loc, dtype: str, num_seqs: int) -> _Geometry:
    _require(dtype in CUDA_TYPES, f"dtype={dtype!r}: choose one of {', '.join(CUDA_TYPES)}")
    item = ITEMSIZE[dtype]
    _require(q.ndim == 3 and out.shape == q.shape,
             f"q {q.shape} and out {out.shape} must both be [T, num_heads, head_dim]")
    _require(k_cache.ndim == 4 and v_cache.shape == k_cache.shape,
             f"k_cache {k_cache.shape} / v_cache {v_cache.shape} must be equal "
             "[num_blocks, block_size, num_kv_heads, head_dim]")
    for name, a in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        _require(a.dtype.itemsize == item, f"{name} has {a.dtype}, not a {dtype} array")
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    _require(head_dim == cache_head_dim, f"q head_dim {head_dim} != cache {cache_head_dim}")
    _require(head_dim in HEAD_DIMS, f"head_dim {head_dim}: kernels exist for {HEAD_DIMS}")
    _require(num_heads % num_kv_heads == 0,
             f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    for name, a in (("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        _require(a.flags.c_contiguous and _address(a) % 16 == 0,
                 f"{name} must be C-contiguous and 16-byte aligned")
    q_stride = _vec16_stride("q", q) * 16 // item
    _check_int_array("block_tables", block_tables, np.int32, 2)
    _check_int_array("context_lens", context_lens, np.int32, 1)
    _check_int_array("query_start_loc", query_start_loc, np.int32, 1)
    # A kernel indexes these by row with no bounds check of its own: a short array is an
    # out-of-bounds read with no error message. Shapes only (no device read).
    rows = len(context_lens)
    _require(len(query_start_loc) == rows + 1 and block_tables.shape[0] == rows,
             f"{rows} context_lens need {rows + 1} query_start_loc entries and {rows} "
             f"block-table rows, got {len(query_start_loc)} and {block_tables.shape[0]}")
    _require(1 <= num_seqs <= rows, f"num_seqs={num_seqs}: the metadata has {rows} rows")
    _require(block_tables.shape[1] >= 1, "block_tables needs at least one column")
    return _Geometry(num_heads, head_dim, num_kv_heads, block_size, block_tables.shape[1],
                     q_stride)


def _common_args(g: _Geometry, q, k_cache, v_cache, block_tables, context_lens,
                 query_start_loc, scale: float) -> tuple:
    """The parameters the attention kernels share, from `q` to `scale`, in order."""
    return (q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
            np.int32(g.q_stride), np.int32(g.max_blocks), np.int32(g.block_size),
            np.int32(g.num_heads), np.int32(g.num_kv_heads), np.float32(scale))


# ------------------------------------------------------------------- attention launches


def decode_v1_launch(out, q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                     scale: float, num_seqs: int, dtype: str) -> Launch:
    """Decode sequences 0 .. num_seqs-1 (one query each, at row query_start_loc[s])."""
    g = _attention_geometry(out, q, k_cache, v_cache, block_tables, context_lens,
                            query_start_loc, dtype, num_seqs)
    return Launch(
        attention_kernel_name("paged_attention_v1_kernel", dtype, g.head_dim),
        (num_seqs, g.num_kv_heads * head_chunks(g.num_heads, g.num_kv_heads), 1),
        (NUM_THREADS, 1, 1),
        (out,) + _common_args(g, q, k_cache, v_cache, block_tables, context_lens,
                              query_start_loc, scale),
    )


def v2_workspace_shapes(num_seqs: int, num_heads: int, head_dim: int,
                        max_partitions: int) -> dict[str, tuple[int, ...]]:
    """float32 scratch of the v2 kernels: partial outputs, max logits, exp-sums."""
    return {
        "tmp_out": (num_seqs, num_heads, max_partitions, head_dim),
        "max_logits": (num_seqs, num_heads, max_partitions),
        "exp_sums": (num_seqs, num_heads, max_partitions),
    }


def decode_v2_launches(out, q, k_cache, v_cache, block_tables, context_lens,
                       query_start_loc, scale: float, num_seqs: int,
                       partitioning: Partitioning, tmp_out, max_logits, exp_sums,
                       dtype: str) -> list[Launch]:
    """The split-context kernel, then the reduce that combines its partitions.

    `partitioning.max_partitions` must cover the longest context of the batch (it is the
    grid's z extent); the workspace arrays have `v2_workspace_shapes(...)`, float32.
    """
    g = _attention_geometry(out, q, k_cache, v_cache, block_tables, context_lens,
                            query_start_loc, dtype, num_seqs)
    shapes = v2_workspace_shapes(num_seqs, g.num_heads, g.head_dim, partitioning.max_partitions)
    for name, a in (("tmp_out", tmp_out), ("max_logits", max_logits), ("exp_sums", exp_sums)):
        _require(a.dtype == np.float32 and tuple(a.shape) == shapes[name]
                 and a.flags.c_contiguous,
                 f"{name} must be C-contiguous float32 {shapes[name]}, got {a.dtype} {a.shape}")
    p = partitioning
    partials = Launch(
        attention_kernel_name("paged_attention_v2_kernel", dtype, g.head_dim),
        (num_seqs, g.num_kv_heads * head_chunks(g.num_heads, g.num_kv_heads), p.max_partitions),
        (NUM_THREADS, 1, 1),
        (tmp_out, max_logits, exp_sums)
        + _common_args(g, q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                       scale)
        + (np.int32(p.partition_size),),
    )
    reduce = Launch(
        reduce_kernel_name(dtype),
        (num_seqs, g.num_heads, 1),
        (g.head_dim, 1, 1),
        (out, tmp_out, max_logits, exp_sums, context_lens, query_start_loc,
         np.int32(g.num_heads), np.int32(g.head_dim), np.int32(p.partition_size),
         np.int32(p.max_partitions)),
    )
    return [partials, reduce]


def varlen_launch(out, q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                  scale: float, num_seqs: int, token_offset: int, dtype: str) -> Launch:
    """Causal attention of query rows token_offset .. T-1 (prefill chunks, verify)."""
    g = _attention_geometry(out, q, k_cache, v_cache, block_tables, context_lens,
                            query_start_loc, dtype, num_seqs)
    _require(num_seqs == len(context_lens), f"varlen_launch covers every row: num_seqs="
             f"{num_seqs}, the metadata has {len(context_lens)}")
    num_tokens = q.shape[0] - token_offset
    _require(num_tokens > 0, f"varlen_launch: no query rows from token_offset {token_offset}")
    return Launch(
        attention_kernel_name("varlen_paged_attention_kernel", dtype, g.head_dim),
        (num_tokens, g.num_kv_heads * head_chunks(g.num_heads, g.num_kv_heads), 1),
        (NUM_THREADS, 1, 1),
        (out,) + _common_args(g, q, k_cache, v_cache, block_tables, context_lens,
                              query_start_loc, scale)
        + (np.int32(num_seqs), np.int32(token_offset)),
    )


# ---------------------------------------------------------------------- cache launches


def write_kv_launch(k, v, k_cache, v_cache, slot_mapping) -> Launch | None:
    """Reshape-and-cache: row t of k/v into slot slot_mapping[t] (-1 skipped). None if T == 0."""
    _require(k.ndim == 3 and v.shape == k.shape and k.dtype == v.dtype,
             f"k {k.shape} {k.dtype} / v {v.shape} {v.dtype} must be equal [T, Hkv, D]")
    _require(k_cache.ndim == 4 and v_cache.shape == k_cache.shape
             and k_cache.shape[2:] == k.shape[1:]
             and k_cache.dtype == v_cache.dtype == k.dtype,
             f"caches {k_cache.shape} {k_cache.dtype} do not hold k {k.shape} {k.dtype}")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        _require(a.flags.c_contiguous and _address(a) % 16 == 0,
                 f"{name} must be C-contiguous and 16-byte aligned")
    _check_int_array("slot_mapping", slot_mapping, np.int64, 1)
    _require(slot_mapping.shape[0] == k.shape[0],
             f"slot_mapping {slot_mapping.shape} needs one slot per token ({k.shape[0]})")
    row_bytes = k.shape[1] * k.shape[2] * k.dtype.itemsize
    _require(row_bytes % 16 == 0, f"a token's K row ({row_bytes} B) must be 16-byte multiple")
    if k.shape[0] == 0:
        return None
    row_vecs = row_bytes // 16
    threads = min(128, 32 * math.ceil(row_vecs / 32))
    return Launch("write_kv_kernel", (k.shape[0], 1, 1), (threads, 1, 1),
                  (k, v, k_cache, v_cache, slot_mapping, np.int32(row_vecs),
                   np.int32(_vec16_stride("k", k)), np.int32(_vec16_stride("v", v))))


def copy_pairs_are_independent(src_to_dst: np.ndarray, num_blocks: int) -> bool:
    """Whether copy_blocks_kernel may run `src_to_dst` (host [N, 2] ints) in one launch.

    Raises ValueError for a block id out of range or a duplicate destination (two copies
    into one block: no order makes that meaningful). Returns False when some dst is also a
    src: thread blocks run in any order, so the kernel could read a block after another copy
    overwrote it; the caller then gathers all sources first (the Backend.copy_blocks rule).
    """
    pairs = check_block_pairs(src_to_dst, num_blocks, num_blocks, "copy_blocks")
    return not np.isin(pairs[:, 1], pairs[:, 0]).any()


def copy_blocks_launch(k_cache, v_cache, src_to_dst) -> Launch | None:
    """Copy-on-write block copies for device `src_to_dst` [N, 2] int64; None if N == 0.

    Only valid when `copy_pairs_are_independent` holds for the same pairs.
    """
    _require(k_cache.ndim == 4 and v_cache.shape == k_cache.shape
             and k_cache.dtype == v_cache.dtype,
             f"k_cache {k_cache.shape} / v_cache {v_cache.shape} must be equal")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        _require(a.flags.c_contiguous and _address(a) % 16 == 0,
                 f"{name} must be C-contiguous and 16-byte aligned")
    _check_int_array("src_to_dst", src_to_dst, np.int64, 2)
    _require(src_to_dst.shape[1] == 2, f"src_to_dst {src_to_dst.shape} must be [N, 2]")
    block_bytes = math.prod(k_cache.shape[1:]) * k_cache.dtype.itemsize
    _require(block_bytes % 16 == 0, f"a block ({block_bytes} B) must be a 16-byte multiple")
    if src_to_dst.shape[0] == 0:
        return None
    return Launch("copy_blocks_kernel", (src_to_dst.shape[0], 2, 1), (256, 1, 1),
                  (k_cache, v_cache, src_to_dst, np.int64(block_bytes // 16)))


# ------------------------------------------------------------------- speculative decoding


def rejection_sample_launch(output_token_ids, num_accepted, draft_token_ids, draft_probs,
                            target_probs, accept_uniforms, draw_uniforms) -> Launch | None:
    """The accept / residual-resample kernel for B rows (Backend.rejection_sample's contract);
    None when B == 0. `draft_probs` None means one-hot q (n-gram drafts): the kernel then
    gets target_probs as a stand-in pointer it never reads, and has_draft_probs = 0.

    Checks shapes, dtypes and contiguity only: the values (ids in range, padding a suffix,
    uniforms in [0, 1)) live on the device and are not read back.
    """
    _check_int_array("draft_token_ids", draft_token_ids, np.int64, 2)
    batch, k = draft_token_ids.shape
    _require(target_probs.ndim == 3 and target_probs.shape[:2] == (batch, k + 1)
             and target_probs.flags.c_contiguous,
             f"target_probs must be C-contiguous [B, k+1, V] = [{batch}, {k + 1}, V], "
             f"got {target_probs.shape}")
    prob = np.dtype(target_probs.dtype).name
    _require(prob in PROB_TYPES, f"target_probs has {target_probs.dtype}; the kernel reads "
             f"{', '.join(PROB_TYPES)}")
    vocab = target_probs.shape[2]
    if draft_probs is not None:
        _require(draft_probs.shape == (batch, k, vocab) and draft_probs.dtype == target_probs.dtype
                 and draft_probs.flags.c_contiguous,
                 f"draft_probs must be C-contiguous {target_probs.dtype} {(batch, k, vocab)} "
                 f"or None, got {draft_probs.dtype} {draft_probs.shape}")
    _check_int_array("output_token_ids", output_token_ids, np.int64, 2)
    _require(output_token_ids.shape == (batch, k + 1),
             f"output_token_ids must be [B, k+1] = {(batch, k + 1)}")
    _check_int_array("num_accepted", num_accepted, np.int64, 1)
    _require(num_accepted.shape == (batch,), f"num_accepted must be [B] = ({batch},)")
    for name, a, shape in (("accept_uniforms", accept_uniforms, (batch, k)),
                           ("draw_uniforms", draw_uniforms, (batch,))):
        _require(a.dtype == np.float64 and tuple(a.shape) == shape and a.flags.c_contiguous,
                 f"{name} must be C-contiguous float64 {shape}, got {a.dtype} {a.shape}")
    if batch == 0:
        return None
    return Launch(
        rejection_sample_kernel_name(prob), (batch, 1, 1), (REJECTION_SAMPLE_THREADS, 1, 1),
        (output_token_ids, num_accepted, draft_token_ids,
         target_probs if draft_probs is None else draft_probs, target_probs, accept_uniforms,
         draw_uniforms, np.int32(k), np.int32(vocab), np.int32(draft_probs is not None)))
