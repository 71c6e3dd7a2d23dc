// rejection_sample.cu: the accept / residual-resample step of speculative decoding.
//
// A kernel twin of refserve/sampling/rejection_sampler.py:rejection_sample, fed the same
// uniforms and emitting bit-identical tokens. For row b with n_b drafts (ids before the first
// -1), in float64:
//   accept draft i   iff  accept_uniforms[b, i] * q_i(x_i) < p_i(x_i)   (q_i(x_i) = 1 when
//                                                                       there are no q's)
//   j = num_accepted[b] = length of the leading run of accepted drafts
//   weights w = max(0, p_j - q_j) if j < n_b (recovered token; q_j one-hot at x_j when there
//               are no q's), falling back to w = p_j if that residual sums to 0;
//             = p_j                if j == n_b (bonus token)
//   token = min{t : c_t > u * c_{V-1}} = #{t : c_t <= u * c_{V-1}}  (clamped to V-1),
//           c = cumsum(w) in float64, in index order, u = draw_uniforms[b]
//
// Why bit-identical: NumPy's cumsum adds left to right, one rounding per add. Here thread 0
// makes that same chain of adds once over the whole row (pass 1), keeping the running sum at
// the start of each thread's chunk; pass 2 lets every thread continue the chain inside its own
// chunk from that exact starting value, so every c_t equals NumPy's bit for bit, and counts
// its c_t <= threshold; the integer counts add up exactly. The float64 operations are written
// as __dadd_rn / __dsub_rn / __dmul_rn so the compiler can never fuse them into an FMA (one
// rounding instead of two would change low bits). Pass 1 is a sequential chain of V dependent
// double adds per row (about 0.5 ms for V = 128k): the price of exact equality with the
// reference; rows run in parallel, one thread block each.
//
// Shapes (B rows, k = max drafts, V = vocabulary; P = float or double, the probability type):
//   output_token_ids  [B, k+1]   int64   accepted drafts, the recovered/bonus token, -1 after
//   num_accepted      [B]        int64
//   draft_token_ids   [B, k]     int64   drafts x_i in [0, V); -1 padding only as a suffix
//   draft_probs       [B, k, V]  P       q_i; ignored (any valid pointer) when !has_draft_probs
//   target_probs      [B, k+1, V] P      p_i; row b reads positions 0 .. n_b
//   accept_uniforms   [B, k]     double  u_i in [0, 1)
//   draw_uniforms     [B]        double  u in [0, 1)
// All contiguous. Ids are not range-checked here (the host op checks them; the engine makes
// them from its own sampler).
//
// Grid (B)   block (kRsThreads = 256): one thread block per row.

constexpr int kRsThreads = 256;

// The weight of token t of the row's final draw (see the header). `mode`: 0 = p (bonus or
// fallback), 1 = residual max(0, p - q) against draft_probs, 2 = residual against a one-hot q
// at token `one_hot`.
template <typename P>
__device__ __forceinline__ double draw_weight(const P* __restrict__ p, const P* __restrict__ q,
                                              int mode, long long one_hot, int t) {
  const double pt = static_cast<double>(p[t]);
  if (mode == 0) return pt;
  const double qt = mode == 1 ? static_cast<double>(q[t]) : (t == one_hot ? 1.0 : 0.0);
  const double d = __dsub_rn(pt, qt);
  return d > 0.0 || d != d ? d : 0.0;  // np.maximum(0, d): a NaN stays NaN (fmax would drop it)
}

template <typename P>
__global__ void __launch_bounds__(kRsThreads) rejection_sample_kernel(
    long long* __restrict__ output_token_ids,       // [B, k+1]
    long long* __restrict__ num_accepted,           // [B]
    const long long* __restrict__ draft_token_ids,  // [B, k]
    const P* __restrict__ draft_probs,              // [B, k, V] (unused if !has_draft_probs)
    const P* __restrict__ target_probs,             // [B, k+1, V]
    const double* __restrict__ accept_uniforms,     // [B, k]
    const double* __restrict__ draw_uniforms,       // [B]
    int k, int vocab, int has_draft_probs) {
  __shared__ double chunk_start[kRsThreads];  // running sum before each thread's chunk
  __shared__ int below[kRsThreads];           // per thread: #{t in chunk : c_t <= threshold}
  __shared__ int s_accepted, s_mode;
  __shared__ long long s_one_hot;
  __shared__ double s_threshold;

  const long long b = blockIdx.x;
  const int tid = threadIdx.x;
  const long long* drafts = draft_token_ids + b * k;
  const int chunk = (vocab + kRsThreads - 1) / kRsThreads;

  if (tid == 0) {
    // The accept test, draft by draft; the leading run stops at the first rejection or pad.
    int j = 0;
    while (j < k && drafts[j] >= 0) {
      const long long x = drafts[j];
      const double p_x = static_cast<double>(target_probs[(b * (k + 1) + j) * vocab + x]);
      const double q_x =
          has_draft_probs ? static_cast<double>(draft_probs[(b * k + j) * vocab + x]) : 1.0;
      if (!(__dmul_rn(accept_uniforms[b * k + j], q_x) < p_x)) break;
      ++j;
    }
    const bool rejected = j < k && drafts[j] >= 0;
    s_accepted = j;
    s_mode = rejected ? (has_draft_probs ? 1 : 2) : 0;
    s_one_hot = rejected ? drafts[j] : -1;
  }
  __syncthreads();
  const int j = s_accepted;
  const P* p = target_probs + (b * (k + 1) + j) * vocab;
  const P* q = has_draft_probs && j < k ? draft_probs + (b * k + j) * vocab : p;

  if (tid == 0) {
    // Pass 1: NumPy's cumsum chain over the whole row, noting each chunk's starting sum.
    // A residual that sums to 0 (p == q up to rounding) falls back to p: one more pass.
    int mode = s_mode;
    double total;
    for (;;) {
      total = 0.0;
      for (int c = 0; c < kRsThreads; ++c) {
        chunk_start[c] = total;
        const int end = min(vocab, (c + 1) * chunk);
        for (int t = c * chunk; t < end; ++t) {
          total = __dadd_rn(total, draw_weight(p, q, mode, s_one_hot, t));
        }
      }
      if (mode == 0 || total > 0.0) break;
      mode = 0;
    }
    s_mode = mode;
    s_threshold = __dmul_rn(draw_uniforms[b], total);
  }
  __syncthreads();

  // Pass 2: every thread re-walks its own chunk from the exact starting sum and counts.
  {
    const double threshold = s_threshold;
    double c_t = chunk_start[tid];
    int count = 0;
    const int end = min(vocab, (tid + 1) * chunk);
    for (int t = tid * chunk; t < end; ++t) {
      c_t = __dadd_rn(c_t, draw_weight(p, q, s_mode, s_one_hot, t));
      count += c_t <= threshold ? 1 : 0;
    }
    below[tid] = count;
  }
  __syncthreads();

  long long* out = output_token_ids + b * (k + 1);
  if (tid == 0) {
    long long token = 0;
    for (int c = 0; c < kRsThreads; ++c) token += below[c];
    if (token > vocab - 1) token = vocab - 1;  // only for u >= 1 (bad input), as in NumPy
    num_accepted[b] = j;
    out[j] = token;
  }
  for (int i = tid; i <= k; i += kRsThreads) {
    if (i < j) out[i] = drafts[i];
    else if (i > j) out[i] = -1;
  }
}
