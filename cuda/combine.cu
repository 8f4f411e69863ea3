// Throughput combine over NVLink, plus broadcast and slot_values (backward passes).
//
// combine: a one-block start kernel (group discovery = the start barrier of the call), then one
// data kernel whose warps are either
//   reducers: for every token another rank s sent here, the float32 sum over its top-k slots (in
//     slot order) of w * y[row], rounded to y's dtype, written ONCE into rank s's staging
//     [me][t] over NVLink (16-byte stores); a release flag per (chunk, rank s);
//   finalisers: per chunk of this rank's tokens, wait for the flags of every other rank, then
//     out[t] = sum over ranks in rank order (float32) of the partial sums, this rank's own
//     partial computed in place from y (never staged), rounded to y's dtype.
// Exactly jax_ep.reference.combine's summation order.
//
// broadcast: start kernel, then senders copy g[t] once to every remote rank the token went to,
// receivers zero the rows whose src_index is -1 and copy each token (own tokens straight from g,
// remote ones when their chunk flag arrives) to each of its receive rows (token_rows).
//
// slot_values: one block: discovery, [T, K] values per rank into the source's staging, a group
// barrier, sum over ranks.
#include "cuda/combine.h"
#include "cuda/ep_device.cuh"

namespace jax_ep {
namespace {

constexpr int kStartThreads = 64;
constexpr int kSlotValuesThreads = 1024;
constexpr int kZeroRows = 256;  // broadcast: rows per zero-fill work item
static_assert(kStartThreads >= kMaxDevices && kStartThreads >= kMaxGroupRanks, "discovery");

__global__ void __launch_bounds__(kStartThreads)
    ep_start_kernel(DeviceState* state, CommLayout layout, const int32_t* rank_ptr,
                    const int32_t* group_ptr, int R, int axis_slot, int op_id) {
  __shared__ OpInfo info;
  discover_group(state, rank_ptr, group_ptr, R, axis_slot, op_id, layout.total, &info);
  if (threadIdx.x == 0) publish_op_info(state, layout, info, 0);
}

// ---- combine ---------------------------------------------------------------------------------
struct CombineArgs {
  CommLayout layout;
  const char* y;
  const float* row_weights;  // null: unweighted
  const int32_t* token_rows;
  const bool* is_token_in_rank;
  char* out;
  int32_t T, K, H;
  int32_t row_bytes;  // H * sizeof(y)
  int32_t reduce_warps;
};

// acc[u][i] = sum over the n rows of `rows` (this token's valid rows, in top-k slot order) of
// w * y[row][e0 + i], e0 = (s0 + u) * 256 + lane * 8, in float32. Slots without a row add nothing
// (the reference adds +0, which cannot change a sum that starts at +0). Each step is one fused
// multiply-add, as XLA compiles the reference's `partial + y * w`. The loads of four rows x U
// steps are in flight together.
template <bool kF32, int U>
__device__ __forceinline__ void accumulate(const char* y, int64_t row_bytes, const int32_t* rows,
                                           const float* weights, int n, bool weighted, int H,
                                           int s0, int lane, float acc[U][8]) {
  constexpr int kV = kF32 ? 2 : 1;  // 16-byte vectors per 8 elements
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
  }
  for (int k0 = 0; k0 < n; k0 += 4) {
    uint4 raw[4][U][kV];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const bool valid = k0 + kk < n;
      const int64_t row = valid ? rows[k0 + kk] : 0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t e0 = static_cast<int64_t>(s0 + u) * 256 + lane * 8;
        if (valid && e0 < H) {
          const uint4* p = reinterpret_cast<const uint4*>(y + row * row_bytes + e0 * (kF32 ? 4 : 2));
#pragma unroll
          for (int v = 0; v < kV; ++v) raw[kk][u][v] = __ldcg(p + v);
        } else {
#pragma unroll
          for (int v = 0; v < kV; ++v) raw[kk][u][v] = make_uint4(0, 0, 0, 0);
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if (k0 + kk >= n) break;
      const float w = weights[k0 + kk];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float f[8];
        if constexpr (kF32) {
          const uint4 a = raw[kk][u][0];
          const uint4 b = raw[kk][u][kV - 1];
          f[0] = __uint_as_float(a.x); f[1] = __uint_as_float(a.y);
          f[2] = __uint_as_float(a.z); f[3] = __uint_as_float(a.w);
          f[4] = __uint_as_float(b.x); f[5] = __uint_as_float(b.y);
          f[6] = __uint_as_float(b.z); f[7] = __uint_as_float(b.w);
        } else {
          unpack_bf16x8(raw[kk][u][0], f);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          acc[u][i] = weighted ? __fmaf_rn(f[i], w, acc[u][i]) : __fadd_rn(acc[u][i], f[i]);
        }
      }
    }
  }
}

// Compacts this token's valid rows (row >= 0), in slot order, into the warp's shared lists; returns
// how many there are. Every lane calls it.
__device__ __forceinline__ int compact_rows(int32_t row, const float* row_weights, int32_t* rows,
                                            float* weights, int lane) {
  const bool valid = row >= 0;
  const uint32_t mask = __ballot_sync(kFullMask, valid);
  if (valid) {
    const int at = __popc(mask & lanemask_lt());
    rows[at] = row;
    weights[at] = row_weights != nullptr ? __ldg(row_weights + row) : 1.f;
  }
  __syncwarp();
  return __popc(mask);
}

template <bool kF32>
__global__ void __launch_bounds__(kDataThreads, 1)
    combine_main_kernel(DeviceState* state, CombineArgs a) {
  constexpr int U = kF32 ? 1 : 3;
  __shared__ int32_t s_rows[kDataWarps][32];
  __shared__ float s_weights[kDataWarps][32];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const CommLayout& L = a.layout;
  char* own = own_comm_buffer(state);
  OpInfo* info = reinterpret_cast<OpInfo*>(own + L.op_info);
  const int me = info->rank;
  const int R = info->size;
  const uint64_t expected = info->expected;
  const int64_t T = a.T;
  const bool weighted = a.row_weights != nullptr;
  const int steps = (a.H + 255) / 256;
  char* lane_peer = lane < R ? comm_buffer_of(state, info->ordinals[lane]) : nullptr;
  int32_t* my_rows = s_rows[warp];
  float* my_weights = s_weights[warp];

  if (warp < a.reduce_warps) {
    // ---- reducers: tokens of rank s != me received here ----
    const int n_items = L.num_chunks * (R - 1);
    for (;;) {
      const int item = next_item(&info->work[0]);
      if (item >= n_items) break;
      const int c = item / (R - 1);
      const int other = item % (R - 1);
      const int s = other < me ? other : other + 1;
      char* peer = reinterpret_cast<char*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(lane_peer), s));
      const int64_t t0 = static_cast<int64_t>(c) * kChunkTokens;
      const int64_t t1 = t0 + kChunkTokens < T ? t0 + kChunkTokens : T;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t slot = static_cast<int64_t>(s) * T + t;
        const int32_t row = lane < a.K ? __ldg(a.token_rows + slot * a.K + lane) : -1;
        if (!__any_sync(kFullMask, row != -1)) continue;  // not sent here: rank s never reads it
        const int n = compact_rows(row, a.row_weights, my_rows, my_weights, lane);
        char* dst = peer + L.stage_data + (static_cast<int64_t>(me) * T + t) * L.data_row_bytes;
        for (int s0 = 0; s0 < steps; s0 += U) {
          float acc[U][8];
          accumulate<kF32, U>(a.y, a.row_bytes, my_rows, my_weights, n, weighted, a.H, s0, lane,
                              acc);
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int64_t e0 = static_cast<int64_t>(s0 + u) * 256 + lane * 8;
            if (e0 < a.H) store8<kF32>(dst, e0, acc[u]);  // rounds to y's dtype
          }
        }
        __syncwarp();  // my_rows is rewritten by the next token
      }
      __syncwarp();
      if (lane == 0) {
        store_release_sys(reinterpret_cast<uint64_t*>(peer + L.chunk_flags) +
                              (static_cast<int64_t>(me) * L.num_chunks + c),
                          expected);
      }
    }
    return;
  }

  // ---- finalisers: this rank's tokens ----
  for (;;) {
    const int c = next_item(&info->work[1]);
    if (c >= L.num_chunks) break;
    if (lane < R && lane != me) {
      wait_flag_equal(reinterpret_cast<const uint64_t*>(own + L.chunk_flags) +
                          (static_cast<int64_t>(lane) * L.num_chunks + c),
                      expected, state, kOpCombine, me, lane, info->ordinals[lane]);
    }
    __syncwarp();
    const int64_t t0 = static_cast<int64_t>(c) * kChunkTokens;
    const int64_t t1 = t0 + kChunkTokens < T ? t0 + kChunkTokens : T;
    for (int64_t t = t0; t < t1; ++t) {
      const bool in_rank = lane < R && a.is_token_in_rank[t * R + lane];
      const uint32_t in_mask = __ballot_sync(kFullMask, in_rank);
      const bool self_in = ((in_mask >> me) & 1u) != 0u;
      const int32_t row =
          self_in && lane < a.K ? __ldg(a.token_rows + (static_cast<int64_t>(me) * T + t) * a.K + lane)
                                : -1;
      const int n = compact_rows(row, a.row_weights, my_rows, my_weights, lane);
      char* out_row = a.out + t * a.row_bytes;
      for (int s0 = 0; s0 < steps; s0 += U) {
        float own_partial[U][8];
        accumulate<kF32, U>(a.y, a.row_bytes, my_rows, my_weights, n, weighted, a.H, s0, lane,
                            own_partial);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t e0 = static_cast<int64_t>(s0 + u) * 256 + lane * 8;
          if (e0 >= a.H) continue;
          if constexpr (!kF32) {  // the own partial is rounded to y's dtype, as if it had travelled
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              own_partial[u][i] = __bfloat162float(__float2bfloat16_rn(own_partial[u][i]));
            }
          }
          float total[8];
          for (int r = 0; r < R; ++r) {
            float v[8];
            if (r == me) {
#pragma unroll
              for (int i = 0; i < 8; ++i) v[i] = own_partial[u][i];
            } else if ((in_mask >> r) & 1u) {
              load8<kF32>(own + L.stage_data + (static_cast<int64_t>(r) * T + t) * L.data_row_bytes,
                          e0, v);
            } else {
#pragma unroll
              for (int i = 0; i < 8; ++i) v[i] = 0.f;
            }
            if (r == 0) {
#pragma unroll
              for (int i = 0; i < 8; ++i) total[i] = v[i];
            } else {
#pragma unroll
              for (int i = 0; i < 8; ++i) total[i] = __fadd_rn(total[i], v[i]);
            }
          }
          store8<kF32>(out_row, e0, total);
        }
      }
      __syncwarp();
    }
  }
}

// ---- broadcast -------------------------------------------------------------------------------
struct BroadcastArgs {
  CommLayout layout;
  const char* g;
  const int32_t* token_rows;
  const bool* is_token_in_rank;
  const int32_t* src_index;
  char* out;
  int32_t T, K, C;
  int32_t row_bytes;
  int32_t send_warps;
};

template <bool kTma>
__global__ void __launch_bounds__(kDataThreads, 1)
    broadcast_main_kernel(DeviceState* state, BroadcastArgs a) {
  JAX_EP_DYNAMIC_SHARED(uint4, dynamic_shared);  // TMA: per-warp barriers and buffers
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  TmaWarp tma{};
  if constexpr (kTma) tma = tma_warp_setup(reinterpret_cast<char*>(dynamic_shared), warp, lane);
  auto copy_raw = [&](const char* src, uint32_t dst_mask, char* my_dst) {
    if constexpr (kTma) {
      warp_copy_tma(tma, src, a.row_bytes, dst_mask, my_dst, lane);
    } else {
      warp_copy_raw<8>(src, a.row_bytes, dst_mask, my_dst, lane);
    }
  };
  const CommLayout& L = a.layout;
  char* own = own_comm_buffer(state);
  OpInfo* info = reinterpret_cast<OpInfo*>(own + L.op_info);
  const int me = info->rank;
  const int R = info->size;
  const uint64_t expected = info->expected;
  const int64_t T = a.T;
  char* lane_peer = lane < R ? comm_buffer_of(state, info->ordinals[lane]) : nullptr;

  if (warp < a.send_warps) {
    for (;;) {
      const int c = next_item(&info->work[0]);
      if (c >= L.num_chunks) break;
      const int64_t t0 = static_cast<int64_t>(c) * kChunkTokens;
      const int64_t t1 = t0 + kChunkTokens < T ? t0 + kChunkTokens : T;
      for (int64_t t = t0; t < t1; ++t) {
        const bool to_peer = lane < R && lane != me && a.is_token_in_rank[t * R + lane];
        const uint32_t remote = __ballot_sync(kFullMask, to_peer);
        if (remote == 0u) continue;
        char* my_dst = to_peer ? lane_peer + L.stage_data +
                                     (static_cast<int64_t>(me) * T + t) * L.data_row_bytes
                               : nullptr;
        copy_raw(a.g + t * a.row_bytes, remote, my_dst);
      }
      if constexpr (kTma) {
        if (lane == 0) {  // the bulk stores are complete before the flags
          tma_store_wait_all();
          fence_proxy_async_global();
          __threadfence_system();
        }
      }
      __syncwarp();
      if (lane < R && lane != me) {
        store_release_sys(reinterpret_cast<uint64_t*>(lane_peer + L.chunk_flags) +
                              (static_cast<int64_t>(me) * L.num_chunks + c),
                          expected);
      }
    }
    if constexpr (kTma) {
      if (lane == 0) tma_store_wait_all();
    }
    return;
  }

  const int n_zero = (a.C + kZeroRows - 1) / kZeroRows;
  const int n_self = L.num_chunks;
  const int n_remote = L.num_chunks * (R - 1);
  for (;;) {
    int item = next_item(&info->work[1]);
    if (item >= n_zero + n_self + n_remote) break;
    if (item < n_zero) {  // rows no token landed on are zero
      const int64_t lo = static_cast<int64_t>(item) * kZeroRows;
      const int64_t hi = lo + kZeroRows < a.C ? lo + kZeroRows : a.C;
      for (int64_t row0 = lo; row0 < hi; row0 += 32) {
        const int64_t row = row0 + lane;
        const bool empty = row < hi && __ldg(a.src_index + row) < 0;
        for (uint32_t m = __ballot_sync(kFullMask, empty); m != 0u; m &= m - 1u) {
          warp_zero(a.out + (row0 + __ffs(m) - 1) * a.row_bytes, a.row_bytes, lane);
        }
      }
      continue;
    }
    item -= n_zero;
    int s, c;
    if (item < n_self) {
      s = me;
      c = item;
    } else {
      item -= n_self;
      c = item / (R - 1);
      const int other = item % (R - 1);
      s = other < me ? other : other + 1;
      if (lane == 0) {
        wait_flag_equal(reinterpret_cast<const uint64_t*>(own + L.chunk_flags) +
                            (static_cast<int64_t>(s) * L.num_chunks + c),
                        expected, state, kOpBroadcast, me, s, info->ordinals[s]);
        if constexpr (kTma) fence_proxy_async_global();  // bulk loads after the acquire
      }
      __syncwarp();
    }
    const int64_t t0 = static_cast<int64_t>(c) * kChunkTokens;
    const int64_t t1 = t0 + kChunkTokens < T ? t0 + kChunkTokens : T;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t slot = static_cast<int64_t>(s) * T + t;
      const int32_t row = lane < a.K ? __ldg(a.token_rows + slot * a.K + lane) : -1;
      const uint32_t kept = __ballot_sync(kFullMask, row >= 0);
      if (kept == 0u) continue;
      char* my_dst = row >= 0 ? a.out + static_cast<int64_t>(row) * a.row_bytes : nullptr;
      const char* src = s == me ? a.g + t * a.row_bytes : own + L.stage_data + slot * L.data_row_bytes;
      copy_raw(src, kept, my_dst);
    }
  }
  if constexpr (kTma) {
    if (lane == 0) tma_store_wait_all();
  }
}

// ---- slot_values -----------------------------------------------------------------------------
__global__ void __launch_bounds__(kSlotValuesThreads)
    slot_values_kernel(DeviceState* state, CommLayout layout, const int32_t* rank_ptr,
                       const int32_t* group_ptr, int R, int axis_slot, const float* values,
                       const int32_t* token_rows, int T, int K, float* out) {
  __shared__ OpInfo info;
  __shared__ PeerGroup group;
  discover_group(state, rank_ptr, group_ptr, R, axis_slot, kOpSlotValues, layout.total, &info);
  const int me = info.rank;
  if (threadIdx.x == 0) {
    group.size = R;
    group.my_rank = me;
    for (int r = 0; r < kMaxGroupRanks; ++r) group.ordinals[r] = r < R ? info.ordinals[r] : -1;
  }
  const int64_t per_rank = static_cast<int64_t>(T) * K;
  // token_rows is [R * T, K]: element i belongs to source rank i / (T * K).
  for (int64_t i = threadIdx.x; i < R * per_rank; i += blockDim.x) {
    const int s = static_cast<int>(i / per_rank);
    const int32_t row = __ldg(token_rows + i);
    const float value = row >= 0 ? __ldg(values + row) : 0.f;
    char* peer = comm_buffer_of(state, info.ordinals[s]);
    reinterpret_cast<float*>(peer + layout.meta_w)[me * per_rank + (i - s * per_rank)] = value;
  }
  __threadfence_system();
  group_barrier_block(state, group, kOpSlotValues);  // starts with __syncthreads
  const float* staged = reinterpret_cast<const float*>(own_comm_buffer(state) + layout.meta_w);
  for (int64_t j = threadIdx.x; j < per_rank; j += blockDim.x) {
    float acc = 0.f;  // jnp.sum over ranks: 0 + v_0 + v_1 + ...
    for (int r = 0; r < R; ++r) acc = __fadd_rn(acc, __ldcg(staged + r * per_rank + j));
    out[j] = acc;
  }
}

bool group_launch_ok(const GroupLaunch& g) {
  return g.state != nullptr && g.num_ranks >= 1 && g.num_ranks <= kMaxGroupRanks &&
         g.num_tokens >= 0 && g.num_topk >= 1 && g.num_topk <= kMaxTopk && g.axis_slot >= 0 &&
         g.axis_slot < kDirectoryAxes && g.num_blocks >= 1 && g.send_warps >= 1 &&
         g.send_warps < kDataWarps;
}

cudaError_t launch_start(const GroupLaunch& g, int op_id, cudaStream_t stream) {
  JAX_EP_LAUNCH(ep_start_kernel, 1, kStartThreads, 0, stream)(g.state, g.layout, g.rank, g.group,
                                                    g.num_ranks, g.axis_slot, op_id);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_combine(const GroupLaunch& g, const void* y, const float* row_weights,
                           const int32_t* token_rows, const bool* is_token_in_rank, int32_t hidden,
                           int32_t y_kind, void* out, cudaStream_t stream) {
  if (!group_launch_ok(g) || hidden < 8 || hidden % 8 != 0 ||
      (y_kind != kRowBF16 && y_kind != kRowF32)) {
    return cudaErrorInvalidValue;
  }
  JAX_EP_CUDA_RETURN(launch_start(g, kOpCombine, stream));
  CombineArgs a;
  a.layout = g.layout;
  a.y = static_cast<const char*>(y);
  a.row_weights = row_weights;
  a.token_rows = token_rows;
  a.is_token_in_rank = is_token_in_rank;
  a.out = static_cast<char*>(out);
  a.T = g.num_tokens;
  a.K = g.num_topk;
  a.H = hidden;
  a.row_bytes = hidden * (y_kind == kRowF32 ? 4 : 2);
  a.reduce_warps = g.send_warps;
  if (y_kind == kRowF32) {
    JAX_EP_LAUNCH(combine_main_kernel<true>, g.num_blocks, kDataThreads, 0, stream)(g.state, a);
  } else {
    JAX_EP_LAUNCH(combine_main_kernel<false>, g.num_blocks, kDataThreads, 0, stream)(g.state, a);
  }
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

cudaError_t launch_broadcast(const GroupLaunch& g, const void* grad, const int32_t* token_rows,
                             const bool* is_token_in_rank, const int32_t* src_index,
                             int32_t capacity, int32_t hidden, int32_t g_kind, bool use_tma,
                             void* out, cudaStream_t stream) {
  if (!group_launch_ok(g) || hidden < 8 || hidden % 8 != 0 || capacity < 1 ||
      (g_kind != kRowBF16 && g_kind != kRowF32)) {
    return cudaErrorInvalidValue;
  }
  JAX_EP_CUDA_RETURN(launch_start(g, kOpBroadcast, stream));
  BroadcastArgs a;
  a.layout = g.layout;
  a.g = static_cast<const char*>(grad);
  a.token_rows = token_rows;
  a.is_token_in_rank = is_token_in_rank;
  a.src_index = src_index;
  a.out = static_cast<char*>(out);
  a.T = g.num_tokens;
  a.K = g.num_topk;
  a.C = capacity;
  a.row_bytes = hidden * (g_kind == kRowF32 ? 4 : 2);
  a.send_warps = g.send_warps;
  if (use_tma) {
    JAX_EP_CUDA_RETURN(cudaFuncSetAttribute(broadcast_main_kernel<true>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            kTmaSharedBytes));
    JAX_EP_LAUNCH(broadcast_main_kernel<true>, g.num_blocks, kDataThreads, kTmaSharedBytes,
                  stream)(g.state, a);
  } else {
    JAX_EP_LAUNCH(broadcast_main_kernel<false>, g.num_blocks, kDataThreads, 0, stream)(g.state, a);
  }
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

cudaError_t launch_slot_values(const GroupLaunch& g, const float* values,
                               const int32_t* token_rows, float* out, cudaStream_t stream) {
  if (!group_launch_ok(g)) return cudaErrorInvalidValue;
  JAX_EP_LAUNCH(slot_values_kernel, 1, kSlotValuesThreads, 0, stream)(g.state, g.layout, g.rank, g.group,
                                                            g.num_ranks, g.axis_slot, values,
                                                            token_rows, g.num_tokens, g.num_topk,
                                                            out);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace jax_ep
