// Broadcast (combine's backward; see broadcast.h): the start kernel (group.cu), then one data
// kernel whose warps are either
//   senders: copy g[t] once to every remote rank the token went to (its staging [me][t]), then a
//     release flag per (chunk, rank);
//   receivers: zero the rows whose src_index is -1 and copy each token (own tokens straight from
//     g, remote ones when their chunk flag arrives) to each of its receive rows (token_rows).
// broadcast_rank_major is this kernel with K = 1 (token_rows = the handle's slot -> row table).
#include "cuda/broadcast.h"
#include "cuda/ep_device.cuh"

namespace jax_ep {
namespace {

constexpr int kZeroRows = 256;  // rows per zero-fill work item

struct BroadcastArgs : DataArgs {
  const char* g;
  const int32_t* token_rows;
  const bool* is_token_in_rank;
  const int32_t* src_index;
  char* out;
  int32_t C;
  int32_t op_id;  // kOpBroadcast, or kOpBroadcastRankMajor (named in a timeout)
};

template <bool kTma>
__device__ __forceinline__ void broadcast_send(const BroadcastArgs& a, const DataWarp& d,
                                               TmaWarp& tma) {
  const CommLayout& L = a.layout;
  send_chunks<kTma>(L, d, a.T, [&](int64_t t) {
    const bool to_peer = d.lane_peer != nullptr && d.lane != d.me &&  // (null: masked)
                         a.is_token_in_rank[t * d.R + d.lane];
    const uint32_t remote = __ballot_sync(kFullMask, to_peer);
    if (remote == 0u) return;
    char* my_dst = to_peer ? d.lane_peer + L.stage_data +
                                 (static_cast<int64_t>(d.me) * a.T + t) * L.data_row_bytes
                           : nullptr;
    warp_copy_row<kTma>(tma, a.g + t * a.row_bytes, a.row_bytes, remote, my_dst, d.lane);
  });
}

// Zero-fill work item `item`: rows no token landed on (src_index -1) are zero.
__device__ __forceinline__ void broadcast_zero_rows(const BroadcastArgs& a, int item, int lane) {
  const int64_t lo = static_cast<int64_t>(item) * kZeroRows;
  const int64_t hi = lo + kZeroRows < a.C ? lo + kZeroRows : a.C;
  for (int64_t row0 = lo; row0 < hi; row0 += 32) {
    const int64_t row = row0 + lane;
    const bool empty = row < hi && __ldg(a.src_index + row) < 0;
    for (uint32_t m = __ballot_sync(kFullMask, empty); m != 0u; m &= m - 1u) {
      warp_zero(a.out + (row0 + __ffs(m) - 1) * a.row_bytes, a.row_bytes, lane);
    }
  }
}

template <bool kTma>
__device__ __forceinline__ void broadcast_receive(const BroadcastArgs& a, const DataWarp& d,
                                                  TmaWarp& tma) {
  const CommLayout& L = a.layout;
  const int64_t T = a.T;
  const int lane = d.lane;
  const int n_zero = (a.C + kZeroRows - 1) / kZeroRows;
  const int n_chunk_items = L.num_chunks * d.R;  // own chunks, then (chunk, other rank) pairs
  for (;;) {
    int item = next_item(&d.info->work[1]);
    if (item >= n_zero + n_chunk_items) break;
    if (item < n_zero) {
      broadcast_zero_rows(a, item, lane);
      continue;
    }
    item -= n_zero;
    int s, c;
    // a masked source's tokens have no rows here (the masked dispatch's handle): skip it
    if (!receive_chunk_item<kTma>(item, d.state, L, d.info, d.own, a.op_id, lane, &s, &c)) continue;
    for (int64_t t = chunk_begin(L, c); t < chunk_end(L, c, T); ++t) {
      const int64_t slot = static_cast<int64_t>(s) * T + t;
      const int32_t row = lane < a.K ? __ldg(a.token_rows + slot * a.K + lane) : -1;
      const uint32_t kept = __ballot_sync(kFullMask, row >= 0);
      if (kept == 0u) continue;
      char* my_dst = row >= 0 ? a.out + static_cast<int64_t>(row) * a.row_bytes : nullptr;
      const char* src =
          s == d.me ? a.g + t * a.row_bytes : d.own + L.stage_data + slot * L.data_row_bytes;
      warp_copy_row<kTma>(tma, src, a.row_bytes, kept, my_dst, lane);
    }
  }
}

template <bool kTma>
__global__ void __launch_bounds__(kDataThreads, 1)
    broadcast_main_kernel(DeviceState* state, BroadcastArgs a) {
  run_data_warps<kTma>(
      state, a.layout, a.send_warps,
      [&](const DataWarp& d, TmaWarp& tma) { broadcast_send<kTma>(a, d, tma); },
      [&](const DataWarp& d, TmaWarp& tma) { broadcast_receive<kTma>(a, d, tma); });
}

}  // namespace

cudaError_t launch_broadcast(const GroupLaunch& g, const void* grad, const int32_t* token_rows,
                             const bool* is_token_in_rank, const int32_t* src_index,
                             int32_t capacity, int32_t hidden, int32_t g_kind, bool use_tma,
                             bool rank_major, void* out, cudaStream_t stream) {
  const int32_t row_bytes = float_row_bytes(hidden, g_kind);
  if (!group_launch_ok(g) || row_bytes == 0 || (rank_major ? g.num_topk != 1 : capacity < 1)) {
    return cudaErrorInvalidValue;
  }
  const int32_t op_id = rank_major ? kOpBroadcastRankMajor : kOpBroadcast;
  JAX_EP_CUDA_RETURN(launch_start(g, group_fingerprint(g, op_id, hidden, g_kind), stream));
  const BroadcastArgs a{data_args(g, row_bytes), static_cast<const char*>(grad), token_rows,
                        is_token_in_rank, src_index, static_cast<char*>(out), capacity, op_id};
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

}  // namespace jax_ep
