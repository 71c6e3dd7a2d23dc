// cache_ops.cu: the two KV-cache writes, reshape-and-cache and copy-on-write block copies.
//
// Both only move bytes, so they are written once for every element type: memory is handled
// in 16-byte vectors (uint4). The host (refserve/backends/cuda_launch.py) checks that rows,
// strides and pointers are multiples of 16 bytes before launching.
//
//   write_kv_kernel     grid (T)     block (min(row_vecs, 128) rounded up to a warp)
//     k, v               [T, row_vecs] uint4   token t's K/V (all KV heads) start at
//                                              k + t * k_stride (v + t * v_stride)
//     k_cache, v_cache   [num_slots, row_vecs] uint4   = [num_blocks, block_size, Hkv, D]
//     slot_mapping       [T] int64              flat slot of token t; -1 = skip the token
//     row_vecs = Hkv * D * sizeof(element) / 16
//   Duplicate slots (other than -1) are not allowed: two blocks would race for one row
//   (the scheduler never produces them).
//
//   copy_blocks_kernel  grid (N, 2)  block (256); blockIdx.y: 0 = k_cache, 1 = v_cache
//     k_cache, v_cache   [num_blocks, block_vecs] uint4
//     src_to_dst         [N, 2] int64   row (src, dst): block dst := block src
//     block_vecs = block_size * Hkv * D * sizeof(element) / 16
//   Thread blocks run in any order, so the copies see the caches as they were before any of
//   them wrote (the Backend.copy_blocks contract) only if no dst is also a src and the dsts
//   are distinct. Copy-on-write always satisfies this (src is shared, dst is a fresh block);
//   the host checks it and falls back to a gather-then-scatter otherwise.

extern "C" __global__ void write_kv_kernel(
    const uint4* __restrict__ k,              // [T, row_vecs], token stride k_stride
    const uint4* __restrict__ v,              // [T, row_vecs], token stride v_stride
    uint4* __restrict__ k_cache,              // [num_slots, row_vecs]
    uint4* __restrict__ v_cache,              // [num_slots, row_vecs]
    const long long* __restrict__ slot_mapping,  // [T]
    int row_vecs, int k_stride, int v_stride) {
  const long long t = blockIdx.x;
  const long long slot = slot_mapping[t];
  if (slot < 0) return;  // the whole block: this token's K/V is not written
  for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) {
    k_cache[slot * row_vecs + i] = k[t * k_stride + i];
    v_cache[slot * row_vecs + i] = v[t * v_stride + i];
  }
}

extern "C" __global__ void copy_blocks_kernel(
    uint4* __restrict__ k_cache,              // [num_blocks, block_vecs]
    uint4* __restrict__ v_cache,              // [num_blocks, block_vecs]
    const long long* __restrict__ src_to_dst,  // [N, 2]
    long long block_vecs) {
  uint4* cache = blockIdx.y == 0 ? k_cache : v_cache;
  const long long src = src_to_dst[2 * blockIdx.x];
  const long long dst = src_to_dst[2 * blockIdx.x + 1];
  for (long long i = threadIdx.x; i < block_vecs; i += blockDim.x) {
    cache[dst * block_vecs + i] = cache[src * block_vecs + i];
  }
}
