// Low-latency dispatch / combine (see low_latency.h). After the start kernel (group discovery,
// the call's start barrier), one data kernel per op:
//  dispatch: warp w sends every token routed to expert e = w, w + W, ... (a ballot scan over the
//    tokens in order gives each its slot) into the expert's rank's receive slots, converting to
//    bf16/fp8 on the way, then raises that (expert, source rank) flag with the count; then warps
//    take (local expert, source rank) pairs, wait for the flag and copy the slots to the outputs.
//  combine: warps take (local expert, source rank) pairs and return each filled slot's row to its
//    source's (token, top-k) slot, then raise the pair's flag there; then each block waits for
//    every pair's flag and its warps sum each token's weighted rows in top-k order (float32).
// Every warp sends before it waits, so the kernels cannot deadlock while all blocks are resident
// (the grid is at most the SMs - 1).
#include "cuda/ep_device.cuh"
#include "cuda/low_latency.h"

namespace jax_ep {
namespace {

constexpr int kLLThreads = 512;
constexpr int kLLWarps = kLLThreads / 32;

__device__ __forceinline__ int global_warp() { return blockIdx.x * kLLWarps + (threadIdx.x >> 5); }
__device__ __forceinline__ int total_warps() { return gridDim.x * kLLWarps; }

// The top-k slot of token t that names expert e (sanitised: the first such slot), or -1.
__device__ __forceinline__ int slot_of_expert(const int32_t* topk_idx, int64_t t, int K, int e) {
  for (int k = 0; k < K; ++k) {
    if (__ldg(topk_idx + t * K + k) == e) return k;
  }
  return -1;
}

template <bool kXF32, int kRow>
__global__ void __launch_bounds__(kLLThreads)
    ll_dispatch_kernel(DeviceState* state, LLLayout L, const char* x, const int32_t* topk_idx,
                       int T, int K, int E, int H, char* rows, float* scales, int32_t* counts,
                       int32_t* src_slot) {
  const int lane = threadIdx.x & 31;
  char* own = own_comm_buffer(state);
  const OpInfo* info = reinterpret_cast<const OpInfo*>(own + L.base.op_info);
  const int me = info->rank, R = info->size;
  const uint64_t expected = info->expected;
  const int local = E / R;
  const int64_t x_row_bytes = static_cast<int64_t>(H) * (kXF32 ? 4 : 2);

  // ---- send: expert by expert, tokens in order ----
  for (int e = global_warp(); e < E; e += total_warps()) {
    const int dest = e / local, le = e % local;
    char* peer = comm_buffer_of(state, info->ordinals[dest]);
    const int64_t block = static_cast<int64_t>(le) * R + me;  // (local expert, source rank)
    char* slots = peer + L.recv_rows + block * T * L.slot_bytes;
    int32_t* slot_src = reinterpret_cast<int32_t*>(peer + L.recv_src) + block * T;
    int n = 0;
    for (int base = 0; base < T; base += 32) {
      const int t = base + lane;
      const int k = t < T ? slot_of_expert(topk_idx, t, K, e) : -1;
      const uint32_t picked = __ballot_sync(kFullMask, k >= 0);
      for (uint32_t m = picked; m != 0u; m &= m - 1u) {
        const int j = __ffs(m) - 1;
        const int64_t tj = base + j;
        const int i = n + __popc(picked & ((1u << j) - 1u));
        char* dst = slots + static_cast<int64_t>(i) * L.slot_bytes;
        const char* src = x + tj * x_row_bytes;
        if constexpr (kRow == kRowFP8 || (kXF32 && kRow == kRowBF16)) {
          warp_copy_convert<kXF32, kRow, 2>(src, H, 1u, dst,
                                            reinterpret_cast<float*>(dst + L.row_bytes), lane);
        } else {
          warp_copy_raw<4>(src, x_row_bytes, 1u, dst, lane);
        }
        const int kj = __shfl_sync(kFullMask, k, j);
        if (lane == 0) slot_src[i] = static_cast<int32_t>(tj * K + kj);
      }
      n += __popc(picked);
    }
    __syncwarp();
    if (lane == 0) {
      reinterpret_cast<int32_t*>(peer + L.recv_counts)[block] = n;
      __threadfence_system();
      store_release_sys(reinterpret_cast<uint64_t*>(peer + L.recv_flags) + block, expected);
    }
    __syncwarp();
  }

  // ---- receive: (local expert, source rank) pairs ----
  const int64_t out_row_bytes = static_cast<int64_t>(H) * (kRow == kRowFP8 ? 1 : 2);
  const int num_scales = kRow == kRowFP8 ? H / 128 : 0;
  for (int p = global_warp(); p < local * R; p += total_warps()) {
    const int le = p / R, s = p % R;
    if (lane == 0) {
      wait_flag_equal(reinterpret_cast<const uint64_t*>(own + L.recv_flags) + p, expected, state,
                      kOpLLDispatch, me, s, info->ordinals[s]);
    }
    __syncwarp();
    const int n = __ldcg(reinterpret_cast<const int32_t*>(own + L.recv_counts) + p);
    const char* slots = own + L.recv_rows + static_cast<int64_t>(p) * T * L.slot_bytes;
    const int32_t* slot_src = reinterpret_cast<const int32_t*>(own + L.recv_src) + int64_t{p} * T;
    const int64_t out_base = static_cast<int64_t>(le) * R * T + static_cast<int64_t>(s) * T;
    for (int i = 0; i < n; ++i) {
      const char* slot = slots + static_cast<int64_t>(i) * L.slot_bytes;
      warp_copy_raw<4>(slot, out_row_bytes, 1u, rows + (out_base + i) * out_row_bytes, lane);
      if constexpr (kRow == kRowFP8) {
        const float* from = reinterpret_cast<const float*>(slot + L.row_bytes);
        float* to = scales + (out_base + i) * num_scales;
        for (int c = lane; c < num_scales; c += 32) to[c] = __ldcg(from + c);
      }
    }
    for (int i = lane; i < T; i += 32) {
      src_slot[out_base + i] = i < n ? __ldcg(slot_src + i) : -1;
    }
    if (lane == 0) counts[static_cast<int64_t>(le) * R + s] = n;
  }
}

__global__ void __launch_bounds__(kLLThreads)
    ll_combine_kernel(DeviceState* state, LLLayout L, const char* y, const int32_t* src_slot,
                      const float* topk_weights, int T, int K, int E, int H, char* out) {
  const int lane = threadIdx.x & 31;
  char* own = own_comm_buffer(state);
  const OpInfo* info = reinterpret_cast<const OpInfo*>(own + L.base.op_info);
  const int me = info->rank, R = info->size;
  const uint64_t expected = info->expected;
  const int local = E / R;
  const int64_t row_bytes = static_cast<int64_t>(H) * 2;

  // ---- return: each filled slot's row to its source's (token, top-k) slot ----
  for (int p = global_warp(); p < local * R; p += total_warps()) {
    const int le = p / R, s = p % R;
    char* peer = comm_buffer_of(state, info->ordinals[s]);
    const int64_t base = static_cast<int64_t>(le) * R * T + static_cast<int64_t>(s) * T;
    for (int i0 = 0; i0 < T; i0 += 32) {
      const int i = i0 + lane;
      const int32_t src = i < T ? __ldg(src_slot + base + i) : -1;
      const uint32_t filled = __ballot_sync(kFullMask, src >= 0);
      for (uint32_t m = filled; m != 0u; m &= m - 1u) {
        const int j = __ffs(m) - 1;
        const int32_t tk = __shfl_sync(kFullMask, src, j);
        warp_copy_raw<4>(y + (base + i0 + j) * row_bytes, row_bytes, 1u,
                         peer + L.ret_rows + static_cast<int64_t>(tk) * L.ret_row_bytes, lane);
      }
      if (filled != kFullMask) break;  // slots are filled from the front
    }
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();
      store_release_sys(reinterpret_cast<uint64_t*>(peer + L.ret_flags) +
                            (static_cast<int64_t>(me) * local + le),
                        expected);
    }
    __syncwarp();
  }

  // ---- reduce: every (rank, expert) pair has returned its rows (the block waits for all of
  // them: the op ends with the last anyway), then per token the weighted rows in top-k order.
  // A top-k slot with weight 0 (unused ids have 0 in the handle) is skipped: its row may be
  // garbage, even NaN.
  for (int f = threadIdx.x; f < R * local; f += blockDim.x) {
    wait_flag_equal(reinterpret_cast<const uint64_t*>(own + L.ret_flags) + f, expected, state,
                    kOpLLCombine, me, f / local, info->ordinals[f / local]);
  }
  __syncthreads();
  const char* returned = own + L.ret_rows;
  for (int64_t t = global_warp(); t < T; t += total_warps()) {
    const float weight = lane < K ? __ldg(topk_weights + t * K + lane) : 0.f;
    const uint32_t used_mask = __ballot_sync(kFullMask, weight != 0.f);
    for (int step = 0; step < (H + 255) / 256; ++step) {  // warp-uniform: the shuffles need it
      const int e0 = step * 256 + lane * 8;
      const bool in = e0 < H;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int k = 0; k < K; ++k) {
        const float w = __shfl_sync(kFullMask, weight, k);
        if (!in || !((used_mask >> k) & 1u)) continue;
        float v[8];
        load8<false>(returned + (t * K + k) * static_cast<int64_t>(L.ret_row_bytes), e0, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, v[i]));
      }
      if (in) store8<false>(out + t * row_bytes, e0, acc);
    }
  }
}

// Enough warps for one expert (dispatch) / token (combine) each, within the configured blocks.
int ll_blocks(const GroupLaunch& g, int work) {
  const int wanted = (work + kLLWarps - 1) / kLLWarps;
  return wanted < 1 ? 1 : wanted < g.num_blocks ? wanted : g.num_blocks;
}

bool ll_ok(const GroupLaunch& g, int E, int H) {
  return group_launch_ok(g) && E >= g.num_ranks && E % g.num_ranks == 0 && H >= 8 && H % 8 == 0;
}

}  // namespace

cudaError_t launch_ll_dispatch(const LLDispatchLaunch& p, cudaStream_t stream) {
  const bool fp8 = p.row_kind == kRowFP8;
  if (!ll_ok(p.g, p.num_experts, p.hidden) || (fp8 && p.hidden % 128 != 0) ||
      (p.x_kind != kRowBF16 && p.x_kind != kRowF32) ||
      !(p.row_kind == kRowFP8 || p.row_kind == kRowBF16)) {
    return cudaErrorInvalidValue;
  }
  if (cudaError_t status = launch_start(p.g, kOpLLDispatch, stream); status != cudaSuccess) {
    return status;
  }
  const bool x_f32 = p.x_kind == kRowF32;
  auto launch = [&](auto kernel) -> cudaError_t {
    JAX_EP_LAUNCH(kernel, ll_blocks(p.g, p.num_experts), kLLThreads, 0, stream)(
        p.g.state, p.L, static_cast<const char*>(p.x), p.topk_idx, p.g.num_tokens, p.g.num_topk,
        p.num_experts, p.hidden, static_cast<char*>(p.rows), p.scales, p.counts, p.src_slot);
    JAX_EP_CHECK_LAUNCH();
    return cudaSuccess;
  };
  if (fp8) {
    return x_f32 ? launch(ll_dispatch_kernel<true, kRowFP8>)
                 : launch(ll_dispatch_kernel<false, kRowFP8>);
  }
  return x_f32 ? launch(ll_dispatch_kernel<true, kRowBF16>)
               : launch(ll_dispatch_kernel<false, kRowBF16>);
}

cudaError_t launch_ll_combine(const LLCombineLaunch& p, cudaStream_t stream) {
  if (!ll_ok(p.g, p.num_experts, p.hidden) || p.g.num_topk > 32) return cudaErrorInvalidValue;
  if (cudaError_t status = launch_start(p.g, kOpLLCombine, stream); status != cudaSuccess) {
    return status;
  }
  const int work = p.num_experts > p.g.num_tokens ? p.num_experts : p.g.num_tokens;
  JAX_EP_LAUNCH(ll_combine_kernel, ll_blocks(p.g, work), kLLThreads, 0, stream)(
      p.g.state, p.L, static_cast<const char*>(p.y), p.src_slot, p.topk_weights,
      p.g.num_tokens, p.g.num_topk, p.num_experts, p.hidden, static_cast<char*>(p.out));
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace jax_ep
