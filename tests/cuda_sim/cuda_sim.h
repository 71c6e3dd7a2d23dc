// cuda_sim.h: run refserve's CUDA kernels on the CPU, for the test suite only.
//
// The kernel sources (refserve/backends/kernels/*.cu) are compiled UNCHANGED by g++ -std=c++20
// with this header force-included and tests/cuda_sim on the include path (its cuda_fp16.h and
// cuda_bf16.h stand in for CUDA's). Each CUDA thread of a block becomes one std::thread; the
// grid's blocks run one after another on those same threads, so a `__shared__` variable can
// simply be a function-`static` one: at any moment exactly one block uses it.
//
// What is modelled:
//   threadIdx, blockIdx, blockDim, gridDim (thread_local), warpSize, __shared__ (static),
//   __syncthreads (a std::barrier over the block), __syncwarp and the warp shuffles
//   __shfl_sync / _xor / _down / _up (a per-warp std::barrier around an exchange buffer; only
//   the full mask of the warp's lanes, anything else aborts), __half and __nv_bfloat16 with
//   round-to-nearest-even conversions, the uint4 / float4 16-byte vectors (16-byte aligned,
//   as on the GPU), the float math the kernels use (expf, fmaxf, __dadd_rn, ...), __global__ /
//   __device__ / __forceinline__ / __launch_bounds__ as no-ops, and a launcher:
//   cuda_sim::launch(kernel, grid, block, args...), plus cuda_sim_launch(), a C entry point
//   taking cuLaunchKernel-style parameter pointers for ctypes (CUDA_SIM_ENTRY_POINT).
//
// Checked, with an abort and a message: a __syncthreads() reached after another thread of the
// block returned (a deadlock on the GPU), a shuffle with a partial mask or from a lane that
// does not exist, a kernel that makes no progress for kStallSeconds (e.g. threads waiting at
// different barriers), and (through the C entry point) parameter count, size and kind.
//
// What is NOT modelled: memory coalescing, caches, bandwidth and timing of any kind;
// registers and occupancy limits (nvcc's -Xptxas -v test covers spills); real warp
// divergence, lock-step execution or independent thread scheduling (threads of a warp run
// freely between barriers); the CUDA memory model (plain C++ memory, ordered by the barriers
// only), atomics, dynamic shared memory, streams, cooperative groups, and block-to-block
// concurrency (blocks never overlap, so races *between* blocks go unseen). Shared memory is
// zero at load and keeps the previous block's values, where a GPU's is undefined.

#pragma once

#include <math.h>

#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

// ----------------------------------------------------------------- device math and types

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
// Correctly rounded float64 operations that CUDA never contracts into an FMA; on the CPU a
// plain operation is already one IEEE rounding (x86-64 SSE2, no FMA without -mfma).
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}

struct __half {
  unsigned short bits;
};
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float x) {
  const _Float16 f = static_cast<_Float16>(x);  // IEEE binary16, round to nearest even
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}
inline __half __float2half(float x) { return __float2half_rn(x); }

struct __nv_bfloat16 {
  unsigned short bits;
};
inline float __bfloat162float(__nv_bfloat16 b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  __nv_bfloat16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a (quiet) NaN
    b.bits = 0x7fc0;
    return b;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  b.bits = static_cast<unsigned short>(u >> 16);
  return b;
}
inline __nv_bfloat16 __float2bfloat16(float x) { return __float2bfloat16_rn(x); }

// ------------------------------------------------------------------------- the runtime

namespace cuda_sim {

constexpr int kStallSeconds = 30;

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda_sim: %s (block %u,%u,%u thread %u,%u,%u)\n", what, blockIdx.x,
               blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
  std::fflush(stderr);
  std::abort();
}

inline std::atomic<unsigned long long> g_progress{0};  // barrier phases completed

struct CountPhase {
  void operator()() noexcept { g_progress.fetch_add(1, std::memory_order_relaxed); }
};
struct NextBlock {  // runs once all threads left a block, before any starts the next
  void operator()() noexcept;
};

// Barriers and shuffle buffers of the running launch (one launch at a time).
struct BlockSync {
  unsigned num_threads;
  std::barrier<CountPhase> block;           // __syncthreads
  std::barrier<NextBlock> between_blocks;   // nobody starts block b+1 before all left b
  std::vector<std::unique_ptr<std::barrier<CountPhase>>> warps;
  std::vector<unsigned> warp_lanes;         // lanes that exist in each warp
  std::vector<std::array<std::uint64_t, 32>> shfl;
  std::atomic<unsigned> exited{0};          // threads that returned from the current block

  explicit BlockSync(unsigned n)
      : num_threads(n), block(n), between_blocks(n), shfl((n + 31) / 32) {
    for (unsigned w = 0; w < (n + 31) / 32; ++w) {
      const unsigned lanes = std::min(32u, n - 32 * w);
      warps.push_back(std::make_unique<std::barrier<CountPhase>>(lanes));
      warp_lanes.push_back(lanes);
    }
  }
};

inline BlockSync* g_sync = nullptr;
inline thread_local unsigned t_lane = 0, t_warp = 0;

inline void NextBlock::operator()() noexcept {
  g_progress.fetch_add(1, std::memory_order_relaxed);
  g_sync->exited.store(0);
}

inline void warp_barrier() { g_sync->warps[t_warp]->arrive_and_wait(); }

inline void check_mask(unsigned mask, const char* op) {
  const unsigned lanes = g_sync->warp_lanes[t_warp];
  const unsigned all = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
  if (mask != all) fail((std::string(op) + ": only the full mask of the warp is modelled").c_str());
}

// Every lane publishes `var`, then reads lane `src` (its own value if src is -1).
template <class T>
T exchange(T var, int src) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of <= 8 bytes");
  auto& slots = g_sync->shfl[t_warp];
  std::memcpy(&slots[t_lane], &var, sizeof(T));
  warp_barrier();  // every lane has written
  T out = var;
  if (src >= 0) {
    if (static_cast<unsigned>(src) >= g_sync->warp_lanes[t_warp]) fail("shuffle from an absent lane");
    std::memcpy(&out, &slots[src], sizeof(T));
  }
  warp_barrier();  // every lane has read before anyone writes again
  return out;
}

template <class... P>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, std::type_identity_t<P>... args) {
  static std::mutex one_launch_at_a_time;  // __shared__ statics belong to one block at a time
  std::lock_guard<std::mutex> lock(one_launch_at_a_time);
  const unsigned n = block.x * block.y * block.z;
  if (n == 0 || n > 1024 || grid.x * grid.y * grid.z == 0) {
    std::fprintf(stderr, "cuda_sim: invalid launch grid (%u,%u,%u) block (%u,%u,%u)\n", grid.x,
                 grid.y, grid.z, block.x, block.y, block.z);
    std::abort();
  }
  BlockSync sync(n);
  g_sync = &sync;
  std::mutex done_mutex;
  std::condition_variable done_cv;
  unsigned done = 0;
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (unsigned i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      threadIdx = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
      blockDim = block;
      gridDim = grid;
      t_lane = i % 32;
      t_warp = i / 32;
      for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = uint3{x, y, z};
            kernel(args...);
            sync.exited.fetch_add(1);
            sync.between_blocks.arrive_and_wait();
          }
      std::lock_guard<std::mutex> g(done_mutex);
      ++done;
      done_cv.notify_one();
    });
  }
  // Watchdog: a kernel whose threads wait at different barriers would hang forever.
  std::unique_lock<std::mutex> wait_lock(done_mutex);
  unsigned long long last = g_progress.load();
  auto last_change = std::chrono::steady_clock::now();
  while (!done_cv.wait_for(wait_lock, std::chrono::seconds(1), [&] { return done == n; })) {
    const unsigned long long now = g_progress.load();
    if (now != last) {
      last = now;
      last_change = std::chrono::steady_clock::now();
    } else if (std::chrono::steady_clock::now() - last_change >
               std::chrono::seconds(kStallSeconds)) {
      std::fprintf(stderr, "cuda_sim: no barrier completed for %d s: threads of a block wait "
                   "at different __syncthreads / shuffles (divergent barrier)\n", kStallSeconds);
      std::abort();
    }
  }
  wait_lock.unlock();
  for (auto& t : threads) t.join();
  g_sync = nullptr;
}

// ------------------------------------------------- cuLaunchKernel-style entry for ctypes

template <class P>
constexpr char param_kind() {
  return std::is_pointer_v<P> ? 'p' : std::is_floating_point_v<P> ? 'f' : 'i';
}

template <class... P, std::size_t... I>
void launch_unpacked(void (*kernel)(P...), dim3 grid, dim3 block, void** params,
                     std::index_sequence<I...>) {
  launch(kernel, grid, block, *static_cast<std::remove_cv_t<P>*>(params[I])...);
}

// params[i] points at the value of parameter i; sizes/kinds describe what the caller packed,
// so that an int64 packed for an int parameter is an error rather than a misread value.
template <class... P>
int launch_packed(void (*kernel)(P...), dim3 grid, dim3 block, int num_params, void** params,
                  const int* sizes, const char* kinds, std::string& error) {
  constexpr int expected_sizes[] = {static_cast<int>(sizeof(P))...};
  constexpr char expected_kinds[] = {param_kind<P>()...};
  if (num_params != static_cast<int>(sizeof...(P))) {
    error = "kernel takes " + std::to_string(sizeof...(P)) + " parameters, got " +
            std::to_string(num_params);
    return 1;
  }
  for (int i = 0; i < num_params; ++i) {
    if (sizes[i] != expected_sizes[i] || kinds[i] != expected_kinds[i]) {
      error = "parameter " + std::to_string(i) + ": kernel expects kind '" +
              expected_kinds[i] + "' of " + std::to_string(expected_sizes[i]) +
              " bytes, got kind '" + kinds[i] + "' of " + std::to_string(sizes[i]) + " bytes";
      return 1;
    }
  }
  launch_unpacked(kernel, grid, block, params, std::index_sequence_for<P...>{});
  return 0;
}

using PackedLauncher = int (*)(dim3, dim3, int, void**, const int*, const char*, std::string&);

}  // namespace cuda_sim

inline void __syncthreads() {
  if (cuda_sim::g_sync->exited.load() != 0) {
    cuda_sim::fail("__syncthreads() after another thread of the block returned");
  }
  cuda_sim::g_sync->block.arrive_and_wait();
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  cuda_sim::check_mask(mask, "__syncwarp");
  cuda_sim::warp_barrier();
}

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  cuda_sim::check_mask(mask, "__shfl_sync");
  const int lane = static_cast<int>(cuda_sim::t_lane);
  return cuda_sim::exchange(var, lane / width * width + src_lane % width);
}

template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  cuda_sim::check_mask(mask, "__shfl_xor_sync");
  const int lane = static_cast<int>(cuda_sim::t_lane);
  const int src = lane ^ lane_mask;
  // CUDA: a lane may read earlier width-groups, but reading a later one returns its own value.
  return cuda_sim::exchange(var, src >= (lane / width + 1) * width ? -1 : src);
}

template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  cuda_sim::check_mask(mask, "__shfl_down_sync");
  const int lane = static_cast<int>(cuda_sim::t_lane);
  const int src = lane + static_cast<int>(delta);
  return cuda_sim::exchange(var, src >= (lane / width + 1) * width ? -1 : src);
}

template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  cuda_sim::check_mask(mask, "__shfl_up_sync");
  const int lane = static_cast<int>(cuda_sim::t_lane);
  const int src = lane - static_cast<int>(delta);
  return cuda_sim::exchange(var, src < lane / width * width ? -1 : src);
}

// One registry entry: CUDA_SIM_KERNEL("name<T, 64, 128>", name<T, 64, 128>).
#define CUDA_SIM_KERNEL(NAME, ...)                                                          \
  {NAME, [](dim3 g, dim3 b, int n, void** p, const int* s, const char* k, std::string& e) { \
     return ::cuda_sim::launch_packed(&__VA_ARGS__, g, b, n, p, s, k, e);                   \
   }}

// Defines `int cuda_sim_launch(...)`, the C entry point over a registry of kernels: returns 0,
// or 1 with a message in `error` (unknown kernel, parameters that do not match).
#define CUDA_SIM_ENTRY_POINT(...)                                                            \
  extern "C" int cuda_sim_launch(const char* name, unsigned gx, unsigned gy, unsigned gz,   \
                                 unsigned bx, unsigned by, unsigned bz, int num_params,     \
                                 void** params, const int* sizes, const char* kinds,        \
                                 char* error, int error_len) {                              \
    static const std::map<std::string, ::cuda_sim::PackedLauncher> registry = {__VA_ARGS__}; \
    std::string message;                                                                    \
    const auto it = registry.find(name);                                                    \
    int rc = 1;                                                                             \
    if (it == registry.end()) {                                                             \
      message = std::string("no kernel named ") + name + " in this build";                  \
    } else {                                                                                \
      rc = it->second(dim3(gx, gy, gz), dim3(bx, by, bz), num_params, params, sizes, kinds, \
                      message);                                                             \
    }                                                                                       \
    std::snprintf(error, error_len, "%s", message.c_str());                                 \
    return rc;                                                                              \
  }
