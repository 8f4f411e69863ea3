// Per-SM ceilings of one GPU (session 47, docs/benchmarks.md): what N SMs can write and read, and
// the two row patterns of the throughput ops at the DeepSeek-V3 shape (4096 tokens, 8 rows of 14 KiB
// each): a token row read once and written to 8 rows (dispatch's and broadcast's receivers), and 8
// rows read and summed into one (combine), each by plain register copies and by bulk (TMA) copies.
//   nvcc -O3 -std=c++17 -arch=sm_90a -I. -o /tmp/sm_ceiling tools/sm_ceiling_probe.cu && /tmp/sm_ceiling
// /tmp/sm_ceiling reads: the read probe only, over four row patterns (row_table), at 24 and 132 SMs.
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <string>
#include <vector>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include "cuda/ep_device.cuh"
using namespace jax_ep;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

namespace fanout {
// Per-SM row fan-out ceiling on one GPU: a token row (14336 B) read once, written to K=8 rows.
constexpr int T = 4096, K = 8, ROW = 14336;
__device__ __forceinline__ char* dst_row(char* dst, int t, int k) { return dst + ((int64_t)k * T + t) * ROW; }

// At most `pending` (0-3) of this thread's committed bulk-store groups still read their source.
__device__ __forceinline__ void bulk_wait_read(int pending) {
  switch (pending) {
    case 3: asm volatile("cp.async.bulk.wait_group.read 3;" ::: "memory"); break;
    case 2: asm volatile("cp.async.bulk.wait_group.read 2;" ::: "memory"); break;
    case 1: asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory"); break;
    default: asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
}

// mode 0: register copy (warp_copy_raw<8>), mode 1: TMA one 13 KiB buffer (warp_copy_tma),
// mode 2: TMA two buffers of 7 KiB (next token's load in flight during this token's stores),
// mode 3: stores only from registers, mode 4: TMA stores only (no load), mode 5: TMA, 4 buffers of 3.5 KiB
template <int kMode>
__global__ void __launch_bounds__(512, 1) fan(const char* __restrict__ src, char* dst, int warps_total) {
  extern __shared__ __align__(128) char sm[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gw = blockIdx.x * 16 + warp;
  if constexpr (kMode == 0 || kMode == 3) {
    for (int t = gw; t < T; t += warps_total) {
      if (kMode == 0) {
        char* d = lane < K ? dst_row(dst, t, lane) : nullptr;
        warp_copy_raw<8>(src + (int64_t)t * ROW, ROW, 0xffu, d, lane);
      } else {
        const uint4 v = make_uint4(t, lane, 1, 2);
        for (int k = 0; k < K; ++k) {
          uint4* to = reinterpret_cast<uint4*>(dst_row(dst, t, k));
          for (int i = lane; i < ROW / 16; i += 32) to[i] = v;
        }
      }
    }
    return;
  } else if constexpr (kMode == 1 || kMode == 4) {
    TmaWarp tma = tma_warp_setup(sm, warp, lane);
    for (int t = gw; t < T; t += warps_total) {
      if (kMode == 1) {
        char* d = lane < K ? dst_row(dst, t, lane) : nullptr;
        warp_copy_tma(tma, src + (int64_t)t * ROW, ROW, 0xffu, d, lane);
      } else if (lane == 0) {
        tma_store_wait_read();
        for (int k = 0; k < K; ++k) {
          tma_store(dst_row(dst, t, k), tma.buffer, 13312);
          tma_store(dst_row(dst, t, k) + 13312, tma.buffer, ROW - 13312);
        }
        tma_store_commit();
      }
    }
    if (lane == 0) tma_store_wait_all();
  } else {
    // kNb buffers per warp of ROW / kNb bytes each (mode 2: 2 x 7 KiB, mode 5: 4 x 3.5 KiB), one mbarrier each:
    // a ring of pieces over the warp's tokens; a buffer is reloaded once its stores have read it.
    constexpr int kNb = kMode == 2 ? 2 : 4;
    constexpr int kPiece = ROW / kNb;
    uint64_t* bars = reinterpret_cast<uint64_t*>(sm) + warp * 4;
    char* buf = sm + 1024 + warp * ROW;
    if (lane == 0) for (int b = 0; b < kNb; ++b) mbarrier_init(bars + b, 1);
    __syncwarp();
    if (lane == 0) {
      uint32_t parity = 0;
      int t = gw;
      // prologue: the first token's pieces
      if (t < T) for (int b = 0; b < kNb; ++b) tma_load(buf + b * kPiece, src + (int64_t)t * ROW + b * kPiece, kPiece, bars + b);
      for (; t < T; t += warps_total) {
        const int tn = t + warps_total;
        for (int b = 0; b < kNb; ++b) {
          mbarrier_wait(bars + b, parity);
          for (int k = 0; k < K; ++k) tma_store(dst_row(dst, t, k) + b * kPiece, buf + b * kPiece, kPiece);
          tma_store_commit();
        }
        // refill every buffer for the next token as soon as its stores have read it
        if (tn < T) {
          for (int b = 0; b < kNb; ++b) {
            bulk_wait_read(kNb - 1 - b);  // buffer b's stores (group b of kNb) have read it
            tma_load(buf + b * kPiece, src + (int64_t)tn * ROW + b * kPiece, kPiece, bars + b);
          }
        }
        parity ^= 1u;
      }
      tma_store_wait_all();
    }
  }
}

template <int kMode>
float run(const char* src, char* dst, int nsm, int iters) {
  int smem = kMode == 1 || kMode == 4 ? kTmaSharedBytes : (kMode == 2 || kMode == 5 ? 1024 + 16 * ROW : 0);
  CK(cudaFuncSetAttribute(fan<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  fan<kMode><<<nsm, 512, smem>>>(src, dst, nsm * 16); CK(cudaGetLastError());
  CK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) fan<kMode><<<nsm, 512, smem>>>(src, dst, nsm * 16);
  CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
  float ms; CK(cudaEventElapsedTime(&ms, a, b));
  return ms * 1000.f / iters;
}

int run_all() {
  char *src, *dst;
  CK(cudaMalloc(&src, (size_t)T * ROW)); CK(cudaMalloc(&dst, (size_t)T * K * ROW));
  CK(cudaMemset(src, 1, (size_t)T * ROW));
  std::vector<char> h((size_t)T * ROW); for (size_t i = 0; i < h.size(); ++i) h[i] = (char)(i * 7 + 3);
  CK(cudaMemcpy(src, h.data(), h.size(), cudaMemcpyHostToDevice));
  const double wbytes = (double)T * K * ROW;
  const char* names[] = {"reg copy", "tma 1x13K", "tma 2x7K", "reg store only", "tma store only", "tma 4x3.5K"};
  printf("written %.1f MB per call\n", wbytes / 1e6);
  for (int nsm : {8, 16, 24, 32, 48, 132}) {
    float us[6] = {run<0>(src, dst, nsm, 10), run<1>(src, dst, nsm, 10), run<2>(src, dst, nsm, 10),
                   run<3>(src, dst, nsm, 10), run<4>(src, dst, nsm, 10), run<5>(src, dst, nsm, 10)};
    for (int m = 0; m < 6; ++m)
      printf("sms %3d %-16s %8.1f us  %7.1f GB/s written  %6.1f GB/s per SM\n", nsm, names[m], us[m], wbytes / us[m] / 1e3, wbytes / us[m] / 1e3 / nsm);
  }
  // check the 2x7K and 4x3.5K copies against the source
  for (int mode : {2, 5}) {
    CK(cudaMemset(dst, 0, (size_t)T * K * ROW));
    if (mode == 2) run<2>(src, dst, 24, 1); else run<5>(src, dst, 24, 1);
    std::vector<char> o((size_t)T * K * ROW); CK(cudaMemcpy(o.data(), dst, o.size(), cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (int k = 0; k < K; ++k) for (size_t i = 0; i < (size_t)T * ROW; ++i) bad += o[(size_t)k * T * ROW + i] != h[i];
    printf("mode %d check: %zu bytes differ\n", mode, bad);
  }
  // copy engine D2D
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a));
  for (int i = 0; i < 10; ++i) CK(cudaMemcpyAsync(dst, dst + (size_t)T * 4 * ROW, (size_t)T * 4 * ROW, cudaMemcpyDeviceToDevice));
  CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b)); float ms; CK(cudaEventElapsedTime(&ms, a, b));
  printf("cudaMemcpy D2D %.1f MB: %.1f us, %.1f GB/s written\n", T * 4.0 * ROW / 1e6, ms * 100, T * 4.0 * ROW / (ms * 100) / 1e3);
  return 0;
}
}  // namespace fanout

namespace reads {
// Per-SM read ceiling, and a plain combine (8 bf16 rows -> weighted f32 sum -> 1 bf16 row) per SM.
constexpr int T = 4096, K = 8, ROW = 14336, VEC = ROW / 16;  // 896 vectors per row, 28 per lane
// Where token t's k-th row is (rows[k * T + t]): the patterns of run_all's tables.
__device__ const int* g_rows;
__device__ __forceinline__ const char* y_row(const char* y, int t, int k) { return y + (int64_t)g_rows[k * T + t] * ROW; }

// mode 0: ldg read only (U vectors in flight per lane), mode 1: TMA bulk loads (2 x 14 KiB per warp in flight),
// mode 2: plain combine, register path: per lane, 2 vector positions x 8 rows in flight, f32 FMA in slot order
template <int kMode, int U>
__global__ void __launch_bounds__(512, 1) rd(const char* __restrict__ y, const float* __restrict__ w, char* out, int warps_total, unsigned* sink) {
  extern __shared__ __align__(128) char sm[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gw = blockIdx.x * 16 + warp;
  unsigned acc = 0;
  if constexpr (kMode == 0) {
    for (int t = gw; t < T; t += warps_total)
      for (int k = 0; k < K; ++k) {
        const uint4* p = reinterpret_cast<const uint4*>(y_row(y, t, k));
        for (int base = 0; base < VEC; base += 32 * U) {
          uint4 v[U];
#pragma unroll
          for (int u = 0; u < U; ++u) { int i = base + u * 32 + lane; v[u] = i < VEC ? __ldcg(p + i) : make_uint4(0,0,0,0); }
#pragma unroll
          for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
      }
  } else if constexpr (kMode == 1) {
    uint64_t* bars = reinterpret_cast<uint64_t*>(sm) + warp * 2;
    char* buf = sm + 1024 + warp * 2 * 7168;
    if (lane == 0) { mbarrier_init(bars, 1); mbarrier_init(bars + 1, 1); }
    __syncwarp();
    if (lane == 0) {
      uint32_t ph[2] = {0, 0}; int n = 0;
      for (int t = gw; t < T; t += warps_total)
        for (int k = 0; k < K; ++k)
          for (int h = 0; h < 2; ++h, ++n) {
            const int b = n & 1;
            if (n >= 2) { mbarrier_wait(bars + b, ph[b]); ph[b] ^= 1u; acc ^= buf[b * 7168]; }
            tma_load(buf + b * 7168, y_row(y, t, k) + h * 7168, 7168, bars + b);
          }
      for (int b = 0; b < 2 && n - 2 + b >= 0; ++b) { int bb = (n - 2 + b) & 1; mbarrier_wait(bars + bb, ph[bb]); ph[bb] ^= 1u; }
    }
  } else {
    for (int t = gw; t < T; t += warps_total) {
      float wk[K];
#pragma unroll
      for (int k = 0; k < K; ++k) wk[k] = __ldg(w + t * K + k);
      for (int base = 0; base < VEC; base += 32 * U) {
        uint4 v[U][K];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int k = 0; k < K; ++k) { int i = base + u * 32 + lane; if (i < VEC) v[u][k] = __ldcg(reinterpret_cast<const uint4*>(y_row(y, t, k)) + i); }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          int i = base + u * 32 + lane;
          if (i >= VEC) continue;
          float s[8];
          float f[8];
          unpack_bf16x8(v[u][0], f);
#pragma unroll
          for (int e = 0; e < 8; ++e) s[e] = wk[0] * f[e];
#pragma unroll
          for (int k = 1; k < K; ++k) { unpack_bf16x8(v[u][k], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) s[e] = fmaf(wk[k], f[e], s[e]); }
          reinterpret_cast<uint4*>(out + (int64_t)t * ROW)[i] = pack_bf16x8(s);
        }
      }
    }
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

template <int kMode, int U>
float run(const char* y, const float* w, char* out, unsigned* sink, int nsm, int iters) {
  int smem = kMode == 1 ? 1024 + 16 * 2 * 7168 : 0;
  CK(cudaFuncSetAttribute(rd<kMode, U>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  rd<kMode, U><<<nsm, 512, smem>>>(y, w, out, nsm * 16, sink); CK(cudaGetLastError());
  CK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) rd<kMode, U><<<nsm, 512, smem>>>(y, w, out, nsm * 16, sink);
  CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
  float ms; CK(cudaEventElapsedTime(&ms, a, b));
  return ms * 1000.f / iters;
}

// The row tables: "regular" (slot k's rows one block, tokens in order: the probe's first form),
// "expert-major" (each token to 8 distinct of 256 experts at random, rows grouped by expert in
// token order: combine's y), "shuffled in 2 MB" (regular, rows permuted within blocks of 146 rows:
// the same pages as regular, scattered inside them) and "random" (every row anywhere).
std::vector<int> row_table(int pattern) {
  std::vector<int> rows(T * K);
  srand(48);
  if (pattern == 1) {
    std::vector<int> expert(T * K), count(256, 0);
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        int e;
        bool again;
        do {
          e = rand() % 256;
          again = false;
          for (int j = 0; j < k; ++j) again |= expert[j * T + t] == e;
        } while (again);
        expert[k * T + t] = e;
        ++count[e];
      }
    }
    std::vector<int> start(256, 0);
    for (int e = 1; e < 256; ++e) start[e] = start[e - 1] + count[e - 1];
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) rows[k * T + t] = start[expert[k * T + t]]++;
  } else {
    for (int i = 0; i < T * K; ++i) rows[i] = i;
    const int block = pattern == 2 ? 146 : T * K;
    if (pattern >= 2) {
      for (int b0 = 0; b0 < T * K; b0 += block) {
        const int n = std::min(block, T * K - b0);
        for (int i = n - 1; i > 0; --i) std::swap(rows[b0 + i], rows[b0 + rand() % (i + 1)]);
      }
    }
  }
  return rows;
}

int run_all(bool patterns) {
  char *y, *out; float* w; unsigned* sink; int* rows;
  CK(cudaMalloc(&y, (size_t)T * K * ROW)); CK(cudaMalloc(&out, (size_t)T * ROW)); CK(cudaMalloc(&w, T * K * 4)); CK(cudaMalloc(&sink, 4));
  CK(cudaMalloc(&rows, T * K * 4)); CK(cudaMemcpyToSymbol(g_rows, &rows, sizeof(rows)));
  CK(cudaMemset(y, 0x3c, (size_t)T * K * ROW));
  std::vector<float> hw(T * K); for (int i = 0; i < T * K; ++i) hw[i] = 0.01f * (i % 97);
  CK(cudaMemcpy(w, hw.data(), T * K * 4, cudaMemcpyHostToDevice));
  const double rbytes = (double)T * K * ROW;
  printf("read %.1f MB per call\n", rbytes / 1e6);
  const char* names[] = {"regular", "expert-major", "shuffled in 2 MB", "random"};
  for (int pattern = 0; pattern < (patterns ? 4 : 1); ++pattern) {
    const std::vector<int> table = row_table(pattern);
    CK(cudaMemcpy(rows, table.data(), T * K * 4, cudaMemcpyHostToDevice));
    printf("rows: %s\n", names[pattern]);
    for (int nsm : patterns ? std::vector<int>{24, 132} : std::vector<int>{8, 16, 24, 32, 48, 132}) {
      struct { const char* name; float us; } r[] = {
        {"ldg U=4", run<0, 4>(y, w, out, sink, nsm, 10)},
        {"ldg U=8", run<0, 8>(y, w, out, sink, nsm, 10)},
        {"ldg U=14", run<0, 14>(y, w, out, sink, nsm, 10)},
        {"tma 2x7K", run<1, 1>(y, w, out, sink, nsm, 10)},
        {"combine U=1", run<2, 1>(y, w, out, sink, nsm, 10)},
        {"combine U=2", run<2, 2>(y, w, out, sink, nsm, 10)},
      };
      for (auto& x : r) printf("sms %3d %-12s %8.1f us  %7.1f GB/s read  %6.1f GB/s per SM\n", nsm, x.name, x.us, rbytes / x.us / 1e3, rbytes / x.us / 1e3 / nsm);
    }
  }
  return 0;
}
}  // namespace reads

// (no argument: both probes; "reads": the read probe over every row pattern)
int main(int argc, char** argv) {
  const bool patterns = argc > 1 && std::string(argv[1]) == "reads";
  if (!patterns) fanout::run_all();
  return reads::run_all(patterns);
}
