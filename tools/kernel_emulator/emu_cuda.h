// A CPU stand-in for the parts of CUDA the EP kernels use, so that the EP kernel families
// (cuda/{group,dispatch,combine,broadcast,slot_values}.cu) can run (slowly) on a machine without a
// GPU: every CUDA thread is an OS thread, blocks of a launch run one after the other (a kernel
// whose block 0 waits for the others: block 0 alongside them, see Launcher), warp
// intrinsics exchange values through a per-warp barrier, and each GPU is a process (driver.cc
// forks one per rank; device memory is a shared mapping at the same address in all of them). It
// checks the kernels' logic (indices, tables, flags, epochs, bit patterns), not their
// memory-model corner cases or their speed.
#pragma once

#define JAX_EP_EMULATION 1

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static

// ---- runtime API subset ----
typedef int cudaError_t;
enum : int { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
typedef void* cudaStream_t;
inline const char* cudaGetErrorName(cudaError_t e) { return e ? "cudaErrorInvalidValue" : "cudaSuccess"; }
inline const char* cudaGetErrorString(cudaError_t e) { return e ? "invalid argument" : "no error"; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

// ---- vector types ----
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(8) float2 { float x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline float2 make_float2(float a, float b) { return {a, b}; }

struct EmuDim3 { unsigned x, y, z; };
inline thread_local EmuDim3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0}, blockDim{1, 1, 1},
    gridDim{1, 1, 1};

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

namespace emu {
struct WarpCtx {
  std::barrier<> bar{32};
  uint64_t slot[32];
};
struct BlockCtx {
  explicit BlockCtx(unsigned threads) : bar(threads) {
    for (unsigned w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(new WarpCtx);
  }
  std::barrier<> bar;
  std::vector<std::unique_ptr<WarpCtx>> warps;
  std::vector<char> dynamic_shared;
  std::atomic<int> any{0};  // __syncthreads_or
};
inline thread_local BlockCtx* block = nullptr;
inline WarpCtx& warp() { return *block->warps[threadIdx.x / 32]; }
inline int lane() { return threadIdx.x & 31; }

template <class T>
T exchange(T value, int src) {
  static_assert(sizeof(T) <= 8, "values of up to 8 bytes");
  WarpCtx& w = warp();
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  w.slot[lane()] = bits;
  w.bar.arrive_and_wait();
  T out;
  const uint64_t got = w.slot[src & 31];
  std::memcpy(&out, &got, sizeof(T));
  w.bar.arrive_and_wait();
  return out;
}
inline uint64_t gather(uint64_t value, uint64_t all[32]) {
  WarpCtx& w = warp();
  w.slot[lane()] = value;
  w.bar.arrive_and_wait();
  for (int i = 0; i < 32; ++i) all[i] = w.slot[i];
  w.bar.arrive_and_wait();
  return 0;
}

// Blocks of a launch run one after the other, unless concurrent_blocks is set: then all at once
// (kernels whose blocks wait for each other, like the fused low-latency ones, need that).
inline bool concurrent_blocks = false;

// A GPU that dies mid-call (the drivers' JAX_EP_EMU_DIE): this process exits (_exit, every thread
// at once, as a killed process) in its kernel launch number die_launch (counted from 0 over the
// process), at its start when die_flags < 0, else at the (die_flags + 1)-th flag store (release
// stores) into [die_lo, die_hi), the communication buffers, or at the launch's end.
inline long die_launch = -1;
inline long die_flags = -1;
inline const char* die_lo = nullptr;
inline const char* die_hi = nullptr;
inline std::atomic<long> launches{0};
inline std::atomic<long> flags_left{-1};  // >= 0: counting down in the dying launch
inline void die() {
  std::fflush(stdout);
  _exit(0);
}
inline void flag_store(const void* address) {
  const char* p = static_cast<const char*>(address);
  if (p < die_lo || p >= die_hi || flags_left.load() < 0) return;
  if (flags_left.fetch_sub(1) == 0) die();
}
// Every launch calls it first: true when this launch is the one the process dies in.
inline bool launch_begins() {
  const long n = launches.fetch_add(1);
  if (n != die_launch) return false;
  if (die_flags < 0) die();
  flags_left.store(die_flags);
  return true;
}

// Runs kernel(args...) with `grid` blocks of `threads` threads. block0_waits
// (JAX_EP_LAUNCH_BLOCK0_WAITS: block 0 waits for the other blocks, which wait for nothing): block 0
// starts first and runs alongside the others, which run one after the other, so its wait really
// waits (on blocks not yet run, or running) and it holds while no other block is resident with it,
// the weakest schedule a GPU may give (no co-residency of the other blocks).
template <class Kernel>
struct Launcher {
  unsigned grid, threads;
  size_t shared_bytes;
  Kernel kernel;
  bool block0_waits = false;
  template <class... Args>
  void operator()(Args... args) const {
    const bool dies = launch_begins();
    run(args...);
    if (dies) die();  // the launch ended before its flag stores ran out
  }
  template <class... Args>
  void run(Args... args) const {
    if (concurrent_blocks) {
      std::vector<std::unique_ptr<BlockCtx>> blocks;
      std::vector<std::thread> pool;
      pool.reserve(static_cast<size_t>(grid) * threads);
      for (unsigned b = 0; b < grid; ++b) {
        blocks.emplace_back(new BlockCtx(threads));
        blocks.back()->dynamic_shared.assign(shared_bytes + 16, 0);
      }
      for (unsigned b = 0; b < grid; ++b) {
        BlockCtx* ctx = blocks[b].get();
        for (unsigned t = 0; t < threads; ++t) {
          pool.emplace_back([&, ctx, b, t] {
            threadIdx = {t, 0, 0};
            blockIdx = {b, 0, 0};
            blockDim = {threads, 1, 1};
            gridDim = {grid, 1, 1};
            block = ctx;
            kernel(args...);
            ctx->warps[t / 32]->bar.arrive_and_drop();
            ctx->bar.arrive_and_drop();
          });
        }
      }
      for (auto& th : pool) th.join();
      return;
    }
    // starts block b's threads into `pool` (its context: `ctx`)
    const auto start = [&](unsigned b, BlockCtx* ctx, std::vector<std::thread>& pool) {
      ctx->dynamic_shared.assign(shared_bytes + 16, 0);
      pool.reserve(threads);
      for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, ctx, b, t] {
          threadIdx = {t, 0, 0};
          blockIdx = {b, 0, 0};
          blockDim = {threads, 1, 1};
          gridDim = {grid, 1, 1};
          block = ctx;
          kernel(args...);
          ctx->warps[t / 32]->bar.arrive_and_drop();
          ctx->bar.arrive_and_drop();
        });
      }
    };
    std::unique_ptr<BlockCtx> first;
    std::vector<std::thread> first_pool;
    if (block0_waits && grid > 1) {
      first.reset(new BlockCtx(threads));
      start(0, first.get(), first_pool);
    }
    for (unsigned b = first ? 1 : 0; b < grid; ++b) {
      BlockCtx ctx(threads);
      std::vector<std::thread> pool;
      start(b, &ctx, pool);
      for (auto& th : pool) th.join();
    }
    for (auto& th : first_pool) th.join();
  }
};
template <class Kernel>
Launcher<Kernel> launch(unsigned grid, unsigned threads, size_t shared_bytes, Kernel kernel,
                        bool block0_waits = false) {
  return Launcher<Kernel>{grid, threads, shared_bytes, kernel, block0_waits};
}
}  // namespace emu

#define JAX_EP_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  ::emu::launch((grid), (block), (shared_bytes), kernel)
#define JAX_EP_LAUNCH_BLOCK0_WAITS(kernel, grid, block, shared_bytes, stream) \
  ::emu::launch((grid), (block), (shared_bytes), kernel, true)
#define JAX_EP_DYNAMIC_SHARED(type, name) \
  type* name = reinterpret_cast<type*>(::emu::block->dynamic_shared.data())

// ---- sync and warp intrinsics ----
inline void __syncthreads() { emu::block->bar.arrive_and_wait(); }
inline int __syncthreads_or(int pred) {
  emu::BlockCtx& b = *emu::block;
  if (pred) b.any.store(1);
  b.bar.arrive_and_wait();
  const int any = b.any.load();
  b.bar.arrive_and_wait();  // everyone has read it
  if (threadIdx.x == 0) b.any.store(0);
  b.bar.arrive_and_wait();  // reset before anyone's next call
  return any;
}
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp().bar.arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <class T>
T __shfl_sync(unsigned, T value, int src) { return emu::exchange(value, src); }
template <class T>
T __shfl_up_sync(unsigned, T value, unsigned delta) {
  const int lane = emu::lane();
  return emu::exchange(value, lane >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane);
}
template <class T>
T __shfl_xor_sync(unsigned, T value, int offset) { return emu::exchange(value, emu::lane() ^ offset); }
inline unsigned __ballot_sync(unsigned, int pred) {
  uint64_t all[32];
  emu::gather(pred ? 1 : 0, all);
  unsigned out = 0;
  for (int i = 0; i < 32; ++i) out |= (all[i] ? 1u : 0u) << i;
  return out;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline unsigned __match_any_sync(unsigned, int value) {
  uint64_t all[32];
  emu::gather(static_cast<uint32_t>(value), all);
  unsigned out = 0;
  for (int i = 0; i < 32; ++i) out |= (all[i] == static_cast<uint32_t>(value) ? 1u : 0u) << i;
  return out;
}
inline unsigned __reduce_max_sync(unsigned, unsigned value) {
  uint64_t all[32];
  emu::gather(value, all);
  unsigned out = 0;
  for (int i = 0; i < 32; ++i) out = std::max(out, static_cast<unsigned>(all[i]));
  return out;
}
inline unsigned __reduce_or_sync(unsigned, unsigned value) {
  uint64_t all[32];
  emu::gather(value, all);
  unsigned out = 0;
  for (int i = 0; i < 32; ++i) out |= static_cast<unsigned>(all[i]);
  return out;
}

// ---- memory ----
template <class T>
T __ldg(const T* p) { T v; std::memcpy(&v, p, sizeof(T)); return v; }
template <class T>
T __ldcg(const T* p) { T v; std::memcpy(&v, p, sizeof(T)); return v; }
template <class T>
T __ldcv(const T* p) { T v; std::memcpy(&v, p, sizeof(T)); return v; }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
inline int atomicCAS(int* p, int expected, int desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long expected,
                                    unsigned long long desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;
}
inline void __trap() {
  std::fflush(stdout);
  std::abort();
}

namespace jax_ep {
inline uint64_t global_timer_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}
inline uint64_t load_acquire_sys(const uint64_t* address) {
  sched_yield();  // these loads spin on peers: let the other threads run
  return __atomic_load_n(address, __ATOMIC_ACQUIRE);
}
inline uint64_t load_relaxed_sys(const uint64_t* address) {
  sched_yield();
  return __atomic_load_n(address, __ATOMIC_RELAXED);
}
inline void fence_acquire_sys() { std::atomic_thread_fence(std::memory_order_acquire); }
inline int32_t load_early(const int32_t* address) { return *address; }
inline int4 load_early4(const int32_t* address) {
  return int4{address[0], address[1], address[2], address[3]};
}
inline uint32_t atomic_add_acq_rel_gpu(uint32_t* address, uint32_t value) {
  return __atomic_fetch_add(address, value, __ATOMIC_ACQ_REL);
}
inline uint64_t atomic_add_acq_rel_gpu(uint64_t* address, uint64_t value) {
  return __atomic_fetch_add(address, value, __ATOMIC_ACQ_REL);
}
inline void backoff_sleep(uint32_t) {}
inline void store_release_sys(uint64_t* address, uint64_t value) {
  emu::flag_store(address);
  __atomic_store_n(address, value, __ATOMIC_RELEASE);
}
inline void store_relaxed_sys(uint64_t* address, uint64_t value) {
  __atomic_store_n(address, value, __ATOMIC_RELAXED);
}
inline void release_store_sys(uint64_t* address, uint64_t value) {
  emu::flag_store(address);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  __atomic_store_n(address, value, __ATOMIC_RELEASE);
}
inline uint32_t lanemask_lt() { return (1u << (threadIdx.x & 31)) - 1u; }
// Bulk copies complete immediately (memcpy). An mbarrier word holds its expected arrivals (bits
// 48..63), the arrivals of the current phase (32..47) and the completed phases (0..31); a bulk load
// counts as one arrival. Waiting on parity p returns once the phase of that parity is complete.
// Fences are no-ops.
inline void mbarrier_init(uint64_t* barrier, uint32_t count) {
  __atomic_store_n(barrier, static_cast<uint64_t>(count) << 48, __ATOMIC_RELEASE);
}
inline void mbarrier_arrive(uint64_t* barrier) {
  uint64_t old = __atomic_load_n(barrier, __ATOMIC_ACQUIRE);
  for (;;) {
    const uint64_t count = old >> 48, arrived = ((old >> 32) & 0xFFFF) + 1, phases = old & 0xFFFFFFFFu;
    const uint64_t next = arrived == count ? (count << 48) | ((phases + 1) & 0xFFFFFFFFu)
                                           : (count << 48) | (arrived << 32) | phases;
    if (__atomic_compare_exchange_n(barrier, &old, next, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return;
  }
}
inline void tma_load(void* dst, const void* src, uint32_t bytes, uint64_t* barrier) {
  std::memcpy(dst, src, bytes);
  mbarrier_arrive(barrier);
}
inline void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
  while ((__atomic_load_n(barrier, __ATOMIC_ACQUIRE) & 1u) == parity) sched_yield();
}
inline void tma_store(void* dst, const void* src, uint32_t bytes) { std::memcpy(dst, src, bytes); }
inline void tma_store_commit() {}
inline void tma_store_wait_read() {}
inline void tma_store_wait_all() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void fence_proxy_async_global() {}
inline void fence_proxy_async_shared() {}
// A cache hint: nothing to fetch, but its operands must be valid (16-byte aligned, 16-byte multiple).
inline void prefetch_l2(const void* src, uint32_t bytes) {
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0 || bytes == 0 || bytes % 16 != 0) {
    std::fprintf(stderr, "prefetch_l2: misaligned operands (%p, %u bytes)\n", src, bytes);
    std::abort();
  }
}
// cp.async copies complete immediately.
inline void cp_async_16(void* dst, const void* src) { std::memcpy(dst, src, 16); }
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}

}  // namespace jax_ep
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
template <class F>
inline cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) { return cudaSuccess; }
// Stream-ordered like a kernel: launches run to completion, so a plain memset is in order.
template <class S>
inline cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, S) {
  std::memset(dst, value, bytes);
  return cudaSuccess;
}

// ---- bit casts and integer intrinsics ----
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }

// ---- bfloat16 ----
struct __nv_bfloat16 { uint16_t bits; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline uint16_t emu_bf16_rn(float f) {
  const unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {emu_bf16_rn(f)}; }
inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float(static_cast<unsigned>(b.bits) << 16); }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return {{emu_bf16_rn(lo)}, {emu_bf16_rn(hi)}};
}

// ---- fp8 e4m3 (round to nearest even, saturate to +-448, NaN -> 0x7f) ----
typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
inline uint8_t emu_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (a >= 464.0f) return sign | 0x7e;  // beyond the rounding range of 448: saturate
  if (a < 0.015625f) {                   // below 2^-6: subnormal, steps of 2^-9
    const float q = std::nearbyint(a * 512.0f);
    return sign | static_cast<uint8_t>(q);  // q == 8 is the smallest normal, same encoding
  }
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exponent = e - 1;               // a = (2m) * 2^exponent
  float q = std::nearbyint(std::ldexp(a, 3 - exponent));  // in [8, 16]
  if (q >= 16.0f) {
    q = 8.0f;
    exponent += 1;
  }
  const int code = ((exponent + 7) << 3) | (static_cast<int>(q) - 8);
  if (code >= 0x7f) return sign | 0x7e;
  return sign | static_cast<uint8_t>(code);
}
inline __nv_fp8x2_storage_t __nv_cvt_float2_to_fp8x2(float2 v, __nv_saturation_t,
                                                       __nv_fp8_interpretation_t) {
  return static_cast<__nv_fp8x2_storage_t>(emu_e4m3(v.x) | (emu_e4m3(v.y) << 8));
}
