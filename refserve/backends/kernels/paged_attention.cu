// paged_attention.cu: attention of query tokens over refserve's paged KV cache.
//
// Every kernel reads keys and values through the block table, accumulates in float32 and
// keeps a running ("online") softmax, so no score vector of context length is ever stored.
//
//   paged_attention_v1_kernel<T, HEAD_DIM, NUM_THREADS>      decode: one block walks the
//                                                            whole context of one sequence
//   paged_attention_v2_kernel<T, HEAD_DIM, NUM_THREADS>      decode, split context: one block
//                                                            per partition of the context
//   paged_attention_v2_reduce_kernel<T>                      combines v2's partitions
//   varlen_paged_attention_kernel<T, HEAD_DIM, NUM_THREADS>  prefill chunks / speculative
//                                                            verify: one block per query token
//
// Template parameters: T = float | __half | __nv_bfloat16 (query, cache and output element
// type); HEAD_DIM = 64 | 128; NUM_THREADS = 128 (4 warps). Which v1/v2 to launch is decided
// on the host by refserve/backends/cuda_launch.py:choose_partitioning.
//
// Shapes (S sequences, N query tokens, H query heads, Hkv KV heads, D = HEAD_DIM,
// G = H / Hkv query heads per KV head, P = max_partitions):
//   q                [N, H, D]               T      row n starts at q + n * q_stride
//                                                   (heads and dims contiguous)
//   out              [N, H, D]               T      contiguous
//   k_cache, v_cache [num_blocks, block_size, Hkv, D]  T, contiguous, 16-byte aligned
//   block_tables     [S, max_blocks]         int32  physical block of each logical block;
//                                                   entries past ceil(context_len /
//                                                   block_size) are never read
//   context_lens     [S]                     int32  keys visible to the sequence's last query
//   query_start_loc  [S + 1]                 int32  query rows of sequence s:
//                                                   query_start_loc[s] .. [s + 1] - 1
//   tmp_out          [S, H, P, D]            float32  v2: each partition's normalised output
//   max_logits       [S, H, P]               float32  v2: each partition's max score
//   exp_sums         [S, H, P]               float32  v2: sum of exp(score - max_logit)
//
// Grid / block (head_chunks = ceil(G / kMaxGroup); blockIdx.y = kv_head * head_chunks + chunk):
//   v1      grid (S, Hkv * head_chunks)      block (NUM_THREADS)
//   v2      grid (S, Hkv * head_chunks, P)   block (NUM_THREADS)
//   reduce  grid (S, H)                      block (D)
//   varlen  grid (N - token_offset, Hkv * head_chunks)   block (NUM_THREADS)
// The decode kernels serve sequences 0 .. S-1 with one query each, at row query_start_loc[s];
// the varlen kernel serves query rows token_offset .. N-1 (decode rows come first).
//
// Inside a block (one KV head, up to kMaxGroup of its query heads):
//   * a "key group" of kLanesPerKey = D / kVec lanes holds one key: each lane loads one
//     16-byte vector (kVec elements) of that key and of its value, so a warp holds
//     kKeysPerWarp keys at a time and the block kKeysPerStep;
//   * the lane multiplies its slice with the same slice of every query head of the group (q
//     kept in registers): every K/V load serves all G heads (grouped-query attention);
//   * the dot product is finished with __shfl_xor_sync inside the key group;
//   * each key group keeps its own online-softmax state (max m, exp-sum l, output acc) per
//     head, so no cross-lane traffic is needed while walking the keys;
//   * at the end the states are merged: key groups of a warp by shuffles, warps through
//     shared memory (FlashAttention's merge: rescale both to the larger max, then add).
//
// __launch_bounds__(NUM_THREADS, 1): with the thread count alone ptxas capped the float
// kernels at 96 registers and spilled; asking for only one resident block lets it keep the
// whole online-softmax state (2 * kMaxGroup * kVec floats per lane) in registers.
//
// Why a finite -FLT_MAX instead of -inf as the initial max: exp(-FLT_MAX - m) is 0 for any real
// m, and two empty states merge to an empty state (exp(0) * 0) without a NaN from
// (-inf) - (-inf).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace refserve_attn {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Query heads served by one block; a GQA group larger than this is split into head chunks
// (mirrored in cuda_launch.py as MAX_GROUP). It bounds the registers: 2 * kMaxGroup * kVec.
constexpr int kMaxGroup = 8;
constexpr float kNegHuge = -3.402823466e+38f;  // -FLT_MAX, see the header

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// One 16-byte load of N = 16 / sizeof(T) elements, converted to float. `p` is 16-byte aligned.
template <typename T, int N>
__device__ __forceinline__ void load_vec16(const T* p, float (&out)[N]) {
  static_assert(N * sizeof(T) == 16, "a vector is 16 bytes");
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(elems[i]);
}

template <typename T, int HEAD_DIM, int NUM_THREADS>
struct Layout {
  static constexpr int kVec = 16 / sizeof(T);             // elements per 16-byte load
  static constexpr int kLanesPerKey = HEAD_DIM / kVec;     // lanes holding one key
  static constexpr int kKeysPerWarp = kWarpSize / kLanesPerKey;
  static constexpr int kNumWarps = NUM_THREADS / kWarpSize;
  static constexpr int kKeysPerStep = kNumWarps * kKeysPerWarp;
  static_assert(HEAD_DIM % kVec == 0, "HEAD_DIM must be a multiple of the 16-byte vector");
  static_assert(kLanesPerKey <= kWarpSize && (kLanesPerKey & (kLanesPerKey - 1)) == 0,
                "one key must be a power-of-two number of lanes within a warp");
  static_assert(NUM_THREADS % kWarpSize == 0, "whole warps only");
};

// Each warp's softmax state after its keys, before the block-wide merge (shared memory).
template <int HEAD_DIM, int NUM_WARPS>
struct WarpStates {
  float max_logit[NUM_WARPS][kMaxGroup];
  float exp_sum[NUM_WARPS][kMaxGroup];
  float acc[NUM_WARPS][kMaxGroup][HEAD_DIM];  // un-normalised: sum of exp(s - max) * v
};

// The query heads and KV head of this block, from blockIdx.y.
struct HeadGroup {
  int kv_head;
  int first_head;  // first query head served by this block
  int num_heads;   // 1 .. kMaxGroup query heads, all reading kv_head
};

__device__ __forceinline__ HeadGroup head_group_of_block(int num_heads, int num_kv_heads) {
  const int group = num_heads / num_kv_heads;
  const int head_chunks = (group + kMaxGroup - 1) / kMaxGroup;
  const int kv_head = blockIdx.y / head_chunks;
  const int chunk = blockIdx.y % head_chunks;
  const int served = min(kMaxGroup, group - chunk * kMaxGroup);
  return HeadGroup{kv_head, kv_head * group + chunk * kMaxGroup, served};
}

// Fold state b into state a: both are rescaled to the larger max, then added.
template <int N>
__device__ __forceinline__ void merge_state(float& m, float& l, float (&acc)[N], float m_b,
                                            float l_b, const float (&acc_b)[N]) {
  const float m_new = fmaxf(m, m_b);
  const float ca = expf(m - m_new);
  const float cb = expf(m_b - m_new);
  l = l * ca + l_b * cb;
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = acc[i] * ca + acc_b[i] * cb;
  m = m_new;
}

// Attention of the block's query heads over keys [key_begin, key_end) of one sequence.
// q_heads points at the first served head of the query row ([num_q_heads, HEAD_DIM]).
// Leaves each warp's state in `states` and ends with __syncthreads(); every thread of the
// block must call it (it shuffles and synchronises).
template <typename T, int HEAD_DIM, int NUM_THREADS>
__device__ void attend_keys(const T* __restrict__ q_heads, int num_q_heads, float scale,
                            const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                            const int* __restrict__ block_table, int block_size,
                            int num_kv_heads, int kv_head, int key_begin, int key_end,
                            WarpStates<HEAD_DIM, NUM_THREADS / kWarpSize>& states) {
  using L = Layout<T, HEAD_DIM, NUM_THREADS>;
  constexpr int V = L::kVec;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int key_in_step = warp * L::kKeysPerWarp + lane / L::kLanesPerKey;
  const int dim0 = (lane % L::kLanesPerKey) * V;  // this lane's slice of the head dim

  float q[kMaxGroup][V];  // this lane's slice of every served query head, times scale
  float m[kMaxGroup], l[kMaxGroup], acc[kMaxGroup][V];
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h) {
    m[h] = kNegHuge;
    l[h] = 0.f;
#pragma unroll
    for (int i = 0; i < V; ++i) acc[h][i] = q[h][i] = 0.f;
    if (h < num_q_heads) {
      load_vec16(q_heads + h * HEAD_DIM + dim0, q[h]);
#pragma unroll
      for (int i = 0; i < V; ++i) q[h][i] *= scale;
    }
  }

  // The loop bound is the same for every thread: lanes past key_end still shuffle.
  for (int step = key_begin; step < key_end; step += L::kKeysPerStep) {
    const int key = step + key_in_step;
    const bool valid = key < key_end;
    float k[V], v[V];
    if (valid) {
      const long long block = block_table[key / block_size];
      const long long slot = block * block_size + key % block_size;
      const long long offset = (slot * num_kv_heads + kv_head) * HEAD_DIM + dim0;
      load_vec16(k_cache + offset, k);
      load_vec16(v_cache + offset, v);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) k[i] = v[i] = 0.f;
    }
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h) {
      if (h < num_q_heads) {  // the same for the whole block
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < V; ++i) s += q[h][i] * k[i];
#pragma unroll
        for (int offset = L::kLanesPerKey / 2; offset > 0; offset /= 2) {
          s += __shfl_xor_sync(kFullMask, s, offset);
        }
        if (valid) {  // online softmax: rescale the running state to the new max
          const float m_new = fmaxf(m[h], s);
          const float rescale = expf(m[h] - m_new);
          const float p = expf(s - m_new);
          l[h] = l[h] * rescale + p;
#pragma unroll
          for (int i = 0; i < V; ++i) acc[h][i] = acc[h][i] * rescale + p * v[i];
          m[h] = m_new;
        }
      }
    }
  }

  // Merge the key groups of the warp (butterfly: every group ends with the warp's state).
#pragma unroll
  for (int offset = L::kLanesPerKey; offset < kWarpSize; offset *= 2) {
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h) {
      if (h < num_q_heads) {
        float acc_b[V];
        const float m_b = __shfl_xor_sync(kFullMask, m[h], offset);
        const float l_b = __shfl_xor_sync(kFullMask, l[h], offset);
#pragma unroll
        for (int i = 0; i < V; ++i) acc_b[i] = __shfl_xor_sync(kFullMask, acc[h][i], offset);
        merge_state(m[h], l[h], acc[h], m_b, l_b, acc_b);
      }
    }
  }
  if (lane < L::kLanesPerKey) {  // key group 0 publishes the warp's state
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h) {
      if (h < num_q_heads) {
#pragma unroll
        for (int i = 0; i < V; ++i) states.acc[warp][h][dim0 + i] = acc[h][i];
        if (lane == 0) {
          states.max_logit[warp][h] = m[h];
          states.exp_sum[warp][h] = l[h];
        }
      }
    }
  }
  __syncthreads();
}

// The block's result for served head h, dim d: merges the warps' states from shared memory.
// Outputs the block's max logit, exp-sum and normalised output sum_k softmax_k * v_k[d].
template <int HEAD_DIM, int NUM_WARPS>
__device__ __forceinline__ void block_result(const WarpStates<HEAD_DIM, NUM_WARPS>& states,
                                             int h, int d, float& max_logit, float& exp_sum,
                                             float& out) {
  float m = kNegHuge;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) m = fmaxf(m, states.max_logit[w][h]);
  float l = 0.f, acc = 0.f;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) {
    const float c = expf(states.max_logit[w][h] - m);  // 0 for a warp that saw no key
    l += states.exp_sum[w][h] * c;
    acc += states.acc[w][h][d] * c;
  }
  max_logit = m;
  exp_sum = l;
  out = acc / l;  // l >= 1: the key holding the max contributes exp(0)
}

}  // namespace refserve_attn

// ------------------------------------------------------------------------------ decode v1

template <typename T, int HEAD_DIM, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS, 1) paged_attention_v1_kernel(
    T* __restrict__ out,                     // [N, H, D]
    const T* __restrict__ q,                 // [N, H, D], token stride q_stride
    const T* __restrict__ k_cache,           // [num_blocks, block_size, Hkv, D]
    const T* __restrict__ v_cache,           // [num_blocks, block_size, Hkv, D]
    const int* __restrict__ block_tables,    // [S, max_blocks]
    const int* __restrict__ context_lens,    // [S]
    const int* __restrict__ query_start_loc,  // [S + 1]
    int q_stride, int max_blocks, int block_size, int num_heads, int num_kv_heads,
    float scale) {
  using namespace refserve_attn;
  __shared__ WarpStates<HEAD_DIM, NUM_THREADS / kWarpSize> states;
  const int seq = blockIdx.x;
  const HeadGroup g = head_group_of_block(num_heads, num_kv_heads);
  const long long row = query_start_loc[seq];
  attend_keys<T, HEAD_DIM, NUM_THREADS>(
      q + row * q_stride + g.first_head * HEAD_DIM, g.num_heads, scale, k_cache, v_cache,
      block_tables + (long long)seq * max_blocks, block_size, num_kv_heads, g.kv_head, 0,
      context_lens[seq], states);
  for (int idx = threadIdx.x; idx < g.num_heads * HEAD_DIM; idx += NUM_THREADS) {
    const int h = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float max_logit, exp_sum, o;
    block_result(states, h, d, max_logit, exp_sum, o);
    out[(row * num_heads + g.first_head + h) * HEAD_DIM + d] = from_float<T>(o);
  }
}

// ------------------------------------------------------------------------------ decode v2

template <typename T, int HEAD_DIM, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS, 1) paged_attention_v2_kernel(
    float* __restrict__ tmp_out,             // [S, H, P, D]
    float* __restrict__ max_logits,          // [S, H, P]
    float* __restrict__ exp_sums,            // [S, H, P]
    const T* __restrict__ q,                 // [N, H, D], token stride q_stride
    const T* __restrict__ k_cache,           // [num_blocks, block_size, Hkv, D]
    const T* __restrict__ v_cache,           // [num_blocks, block_size, Hkv, D]
    const int* __restrict__ block_tables,    // [S, max_blocks]
    const int* __restrict__ context_lens,    // [S]
    const int* __restrict__ query_start_loc,  // [S + 1]
    int q_stride, int max_blocks, int block_size, int num_heads, int num_kv_heads,
    float scale, int partition_size) {
  using namespace refserve_attn;
  __shared__ WarpStates<HEAD_DIM, NUM_THREADS / kWarpSize> states;
  const int seq = blockIdx.x;
  const int partition = blockIdx.z;
  const int max_partitions = gridDim.z;
  const int context_len = context_lens[seq];
  const int key_begin = partition * partition_size;
  if (key_begin >= context_len) return;  // the whole block: this sequence is shorter
  const int key_end = min(key_begin + partition_size, context_len);
  const HeadGroup g = head_group_of_block(num_heads, num_kv_heads);
  const long long row = query_start_loc[seq];
  attend_keys<T, HEAD_DIM, NUM_THREADS>(
      q + row * q_stride + g.first_head * HEAD_DIM, g.num_heads, scale, k_cache, v_cache,
      block_tables + (long long)seq * max_blocks, block_size, num_kv_heads, g.kv_head,
      key_begin, key_end, states);
  for (int idx = threadIdx.x; idx < g.num_heads * HEAD_DIM; idx += NUM_THREADS) {
    const int h = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float max_logit, exp_sum, o;
    block_result(states, h, d, max_logit, exp_sum, o);
    const long long part = ((long long)seq * num_heads + g.first_head + h) * max_partitions +
                           partition;
    tmp_out[part * HEAD_DIM + d] = o;
    if (d == 0) {
      max_logits[part] = max_logit;
      exp_sums[part] = exp_sum;
    }
  }
}

// Combines the partitions of one (sequence, head): with M = max_p max_logits[p] and
// w_p = exp_sums[p] * exp(max_logits[p] - M), out = sum_p w_p * tmp_out[p] / sum_p w_p.
// Each thread recomputes the weights of its output dims (no shared memory, no barrier):
// partitions are few (context / partition_size) and the exps are cheap next to the loads.
template <typename T>
__global__ void paged_attention_v2_reduce_kernel(
    T* __restrict__ out,                     // [N, H, D]
    const float* __restrict__ tmp_out,       // [S, H, P, D]
    const float* __restrict__ max_logits,    // [S, H, P]
    const float* __restrict__ exp_sums,      // [S, H, P]
    const int* __restrict__ context_lens,    // [S]
    const int* __restrict__ query_start_loc,  // [S + 1]
    int num_heads, int head_dim, int partition_size, int max_partitions) {
  using namespace refserve_attn;
  const int seq = blockIdx.x, head = blockIdx.y;
  const int num_partitions = (context_lens[seq] + partition_size - 1) / partition_size;
  const long long base = ((long long)seq * num_heads + head) * max_partitions;
  float m = kNegHuge;
  for (int p = 0; p < num_partitions; ++p) m = fmaxf(m, max_logits[base + p]);
  float denom = 0.f;
  for (int p = 0; p < num_partitions; ++p) denom += exp_sums[base + p] * expf(max_logits[base + p] - m);
  const long long row = query_start_loc[seq];
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int p = 0; p < num_partitions; ++p) {
      const float w = exp_sums[base + p] * expf(max_logits[base + p] - m);
      acc += w * tmp_out[(base + p) * head_dim + d];
    }
    out[(row * num_heads + head) * head_dim + d] = from_float<T>(acc / denom);
  }
}

// ----------------------------------------------------------------- varlen (prefill/verify)

// One block per (query token, KV head chunk). Query j of a chunk of q_len tokens sits at
// position context_len - q_len + j and sees keys 0 .. that position (causal inside the chunk).
// Simple rather than fast: each query token re-reads its keys (no tiling over queries).
template <typename T, int HEAD_DIM, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS, 1) varlen_paged_attention_kernel(
    T* __restrict__ out,                     // [N, H, D]
    const T* __restrict__ q,                 // [N, H, D], token stride q_stride
    const T* __restrict__ k_cache,           // [num_blocks, block_size, Hkv, D]
    const T* __restrict__ v_cache,           // [num_blocks, block_size, Hkv, D]
    const int* __restrict__ block_tables,    // [S, max_blocks]
    const int* __restrict__ context_lens,    // [S]
    const int* __restrict__ query_start_loc,  // [S + 1]
    int q_stride, int max_blocks, int block_size, int num_heads, int num_kv_heads,
    float scale, int num_seqs, int token_offset) {
  using namespace refserve_attn;
  __shared__ WarpStates<HEAD_DIM, NUM_THREADS / kWarpSize> states;
  const int token = token_offset + blockIdx.x;
  // The sequence owning this token: the last s with query_start_loc[s] <= token (binary
  // search; empty chunks share their start with the next sequence and are skipped).
  int lo = 0, hi = num_seqs;  // invariant: query_start_loc[lo] <= token < query_start_loc[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (query_start_loc[mid] <= token) lo = mid; else hi = mid;
  }
  const int seq = lo;
  const int q_len = query_start_loc[seq + 1] - query_start_loc[seq];
  const int position = context_lens[seq] - q_len + (token - query_start_loc[seq]);
  const HeadGroup g = head_group_of_block(num_heads, num_kv_heads);
  attend_keys<T, HEAD_DIM, NUM_THREADS>(
      q + (long long)token * q_stride + g.first_head * HEAD_DIM, g.num_heads, scale, k_cache,
      v_cache, block_tables + (long long)seq * max_blocks, block_size, num_kv_heads,
      g.kv_head, 0, position + 1, states);
  for (int idx = threadIdx.x; idx < g.num_heads * HEAD_DIM; idx += NUM_THREADS) {
    const int h = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float max_logit, exp_sum, o;
    block_result(states, h, d, max_logit, exp_sum, o);
    out[((long long)token * num_heads + g.first_head + h) * HEAD_DIM + d] = from_float<T>(o);
  }
}
