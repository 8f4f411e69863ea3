// The put transport of the rank-major ops (dispatch_rank_major, combine_rank_major and
// broadcast_rank_major, combine_rank_major's backward): the same results as the NVLink kernels
// (dispatch.cu / combine.cu / broadcast.cu in rank-major mode), but every byte that crosses to a
// peer goes through an NVSHMEM put with a signal (nvshmemx_putmem_signal_nbi_block), never a peer
// load or store: a peer on another node has no load/store address. Process model 2 only (the
// communication buffer and DeviceState are on the symmetric heap). Host-side declarations and the
// buffer layout (plain C++); kernels in remote_rank_major.cu (relocatable device code, device-
// linked with NVSHMEM's device library).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_state.h"
#include "cuda/ep_layout.h"
#include "cuda/fingerprint.h"

namespace jax_ep {

// Bytes at the start of each send / receive region: int32 row count (then padding to 16).
inline constexpr uint64_t kPutHeaderBytes = 16;

// The put ops' communication buffer (offsets from its start; every rank computes the same layout,
// so a put into region `me` of a peer's receive area lands where that peer looks for it).
//
//   op_info    local OpInfo of the call (rank, R, the ranks' PEs, the signal value)
//   positions  local int32 [T][R]: token t's place among this rank's tokens going to (dispatch,
//              broadcast) / coming back from (combine) rank r, in token order; -1 none
//   counts     local int32 [R]: rows this rank sends to rank r; offsets [R]: combine's first row of
//              source r in y (rows are source-rank major)
//   send       [R][region]: region r = header + the records going to rank r, packed in token order
//              (the put sources: on the symmetric heap, as RDMA transports need)
//   recv       [R][region]: region s = what rank s put here (same layout)
//
// A record is one row: the row bytes, then (dispatch only) its FP8 scales, its K local expert ids
// (int32, -1 where the slot's expert is not on the destination), its K gate weights (f32) and its
// source slot src_rank * T + t (int32); 16-byte aligned.
struct PutLayout {
  uint64_t op_info;
  uint64_t positions;
  uint64_t counts;
  uint64_t offsets;
  uint64_t send;
  uint64_t recv;
  uint64_t total;         // bytes of the buffer this layout needs
  uint64_t region_bytes;  // one send / receive region: header + T records
  uint64_t record_bytes;
  uint64_t row_bytes;
  uint64_t scales_at;     // offsets inside a record (dispatch; 0 otherwise)
  uint64_t ids_at;
  uint64_t weights_at;
  uint64_t src_at;
};

// R ranks, T tokens per rank, K top-k slots (dispatch; 0 for combine / broadcast), row_bytes of one
// row on the wire, scale_bytes of its FP8 scales (0 without), meta: dispatch's ids / weights / src.
JAX_EP_HOST_DEVICE inline PutLayout make_put_layout(int64_t num_ranks, int64_t num_tokens,
                                                    int64_t num_topk, uint64_t row_bytes,
                                                    uint64_t scale_bytes, bool meta) {
  const uint64_t R = static_cast<uint64_t>(num_ranks);
  const uint64_t T = static_cast<uint64_t>(num_tokens);
  const uint64_t K = static_cast<uint64_t>(num_topk);
  PutLayout p{};
  uint64_t at = align_up_u64(row_bytes, 16);
  p.row_bytes = row_bytes;
  if (meta) {
    p.scales_at = at;   at = align_up_u64(at + scale_bytes, 16);
    p.ids_at = at;      at += K * 4;
    p.weights_at = at;  at += K * 4;
    p.src_at = at;      at += 4;
  }
  p.record_bytes = align_up_u64(at, 16);
  p.region_bytes = align_up_u64(kPutHeaderBytes + T * p.record_bytes, 256);
  const uint64_t kAlign = 256;
  at = 0;
  p.op_info = at;    at = align_up_u64(at + sizeof(OpInfo), kAlign);
  p.positions = at;  at = align_up_u64(at + T * R * 4, kAlign);
  p.counts = at;     at = align_up_u64(at + kMaxGroupRanks * 4, kAlign);
  p.offsets = at;    at = align_up_u64(at + kMaxGroupRanks * 4, kAlign);
  p.send = at;       at += R * p.region_bytes;
  p.recv = at;       at += R * p.region_bytes;
  p.total = at;
  return p;
}

// What every put op's launch needs. rank / group: device scalars (lax.axis_index), as for the
// NVLink ops; the group is discovered on the device through puts into every PE's directory.
struct PutLaunch {
  DeviceState* state;
  PutLayout layout;
  const int32_t* rank;
  const int32_t* group;
  int32_t num_ranks;    // R
  int32_t num_tokens;   // T
  int32_t num_topk;     // K (dispatch)
  int32_t num_experts;  // E (dispatch)
  int32_t hidden;       // H (elements of a row)
  int32_t axis_slot;
  int32_t num_blocks;   // blocks of the pack and receive kernels
  int32_t x_kind;       // dispatch: RowKind of x (bf16 / f32)
  int32_t row_kind;     // dispatch: RowKind of the rows; combine / broadcast: y's / g's
};

// dispatch_rank_major over puts: the outputs of launch_dispatch with rank_major (cuda/dispatch.h),
// bit-exact: rows [R*T, H] (empty tail zero), scales (FP8, else nullptr), row_ids / row_weights
// [R*T, K], tokens_per_rank [R], tokens_per_expert [E/R], src_index [R*T], is_token_in_rank [T, R].
cudaError_t launch_put_dispatch_rank_major(const PutLaunch& p, const void* x,
                                           const int32_t* topk_idx, const float* topk_weights,
                                           void* rows, float* scales, int32_t* row_ids,
                                           float* row_weights, int32_t* tokens_per_rank,
                                           int32_t* tokens_per_expert, int32_t* src_index,
                                           bool* is_token_in_rank, cudaStream_t stream);

// combine_rank_major over puts: y [R*T, H] (rows of a dispatch_rank_major handle), out [T, H]: per
// token the float32 sum in rank order of its rows (a rank it did not go to adds +0.0), rounded once.
cudaError_t launch_put_combine_rank_major(const PutLaunch& p, const void* y,
                                          const int32_t* src_index, const bool* is_token_in_rank,
                                          void* out, cudaStream_t stream);

// broadcast_rank_major over puts: g [T, H] -> out [R*T, H] (each token's row on each of its rows,
// empty rows zero).
cudaError_t launch_put_broadcast_rank_major(const PutLaunch& p, const void* g,
                                            const int32_t* src_index, const bool* is_token_in_rank,
                                            void* out, cudaStream_t stream);

}  // namespace jax_ep
