// What the synchronisation instructions of the EP kernels cost on this GPU: n serial executions of
// each (fences, release/acquire stores and loads, barriers) in one block of 1 or 256 threads; the
// cost of one is the slope between n = 10 and n = 100. Used to tell which serial chains bound the
// kernels' fixed cost per call (docs/benchmarks.md). Standalone (no jax_ep):
//   nvcc -O2 -arch=sm_90 -o fence_cost tools/fence_cost.cu && ./fence_cost
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
__device__ uint64_t sink[1024];
template <int kMode>
__global__ void k(uint64_t* buf, int n) {
  uint64_t* p = buf + threadIdx.x * 16;
  for (int i = 0; i < n; ++i) {
    if (kMode == 0) { __threadfence_system(); }
    if (kMode == 1) { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
    if (kMode == 2) { asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"((uint64_t)i) : "memory"); }
    if (kMode == 3) { uint64_t v; asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); sink[threadIdx.x] += v; }
    if (kMode == 4) { asm volatile("fence.acq_rel.sys;\n\tst.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"((uint64_t)i) : "memory"); }
    if (kMode == 5) { uint64_t v; asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); sink[threadIdx.x] += v; }
    if (kMode == 6) { __threadfence(); }
    if (kMode == 7) { p[0] = i; __threadfence_system(); }
    if (kMode == 8) { __syncthreads(); }
  }
}
template <int kMode>
int run(const char* name, uint64_t* buf, int threads) {
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  k<kMode><<<1, threads>>>(buf, 10); CK(cudaDeviceSynchronize());
  for (int n : {0, 1, 10, 100}) {
    float best = 1e9;
    for (int rep = 0; rep < 20; ++rep) {
      CK(cudaEventRecord(a)); k<kMode><<<1, threads>>>(buf, n); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
      float ms; CK(cudaEventElapsedTime(&ms, a, b)); if (ms < best) best = ms;
    }
    printf("%-28s threads %4d n %4d  best %8.2f us\n", name, threads, n, best * 1000);
  }
  return 0;
}
int main() {
  uint64_t* buf; CK(cudaMalloc(&buf, 1 << 20)); CK(cudaMemset(buf, 0, 1 << 20));
  for (int threads : {1, 256}) {
    run<0>("__threadfence_system", buf, threads);
    run<1>("fence.acq_rel.sys", buf, threads);
    run<2>("st.release.sys", buf, threads);
    run<3>("ld.acquire.sys", buf, threads);
    run<4>("fence.acq_rel+st.relaxed", buf, threads);
    run<5>("ld.relaxed.sys", buf, threads);
    run<6>("__threadfence (gpu)", buf, threads);
    run<7>("store+__threadfence_system", buf, threads);
    run<8>("__syncthreads", buf, threads);
  }
  return 0;
}
