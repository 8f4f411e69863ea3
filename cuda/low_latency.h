// Low-latency (decode) dispatch / combine over NVLink: fixed receive slots per (local expert,
// source rank), no layout pass and no counts exchange before the data. Host-side launchers and the
// buffer layout; kernels in low_latency.cu. Semantics: jax_ep.reference.ll_dispatch / ll_combine.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_state.h"
#include "cuda/ep_layout.h"
#include "cuda/group.h"

namespace jax_ep {

// Offsets in the communication buffer. `base` is what the start kernel and the runtime need (the
// call's OpInfo at base.op_info, base.total bytes in all).
struct LLLayout {
  CommLayout base;
  uint64_t recv_flags;   // uint64 [E_local][R]: "rank r's tokens for local expert e are written"
  uint64_t recv_counts;  // int32 [E_local][R]: how many
  uint64_t recv_src;     // int32 [E_local][R][T]: t * K + k of each slot's source (token, top-k)
  uint64_t recv_rows;    // [E_local][R][T][slot_bytes]: row, then FP8 scales
  uint64_t ret_flags;    // uint64 [R][E_local]: "rank r's outputs of its expert e are returned"
  uint64_t ret_rows;     // [T][K][ret_row_bytes]: the expert output of each (token, top-k)
  uint64_t row_bytes;    // dispatched row (bf16 or fp8)
  uint64_t scale_bytes;  // FP8 scales of a row (0 for bf16)
  uint64_t slot_bytes;   // row_bytes + scale_bytes, 16-byte aligned
  uint64_t ret_row_bytes;  // combine's bf16 row
};

JAX_EP_HOST_DEVICE inline LLLayout make_ll_layout(int64_t num_ranks, int64_t num_tokens,
                                                  int64_t num_topk, int64_t num_experts,
                                                  int64_t hidden, uint64_t row_bytes,
                                                  uint64_t scale_bytes) {
  const uint64_t R = static_cast<uint64_t>(num_ranks);
  const uint64_t T = static_cast<uint64_t>(num_tokens);
  const uint64_t K = static_cast<uint64_t>(num_topk);
  const uint64_t local = num_ranks > 0 ? static_cast<uint64_t>(num_experts) / R : 0;
  const uint64_t kAlign = 256;
  LLLayout L{};
  L.row_bytes = row_bytes;
  L.scale_bytes = scale_bytes;
  L.slot_bytes = align_up_u64(row_bytes + scale_bytes, 16);
  L.ret_row_bytes = align_up_u64(static_cast<uint64_t>(hidden) * 2, 16);
  uint64_t at = 0;
  L.base.op_info = at;  at = align_up_u64(at + sizeof(OpInfo), kAlign);
  L.recv_flags = at;    at = align_up_u64(at + local * R * 8, kAlign);
  L.recv_counts = at;   at = align_up_u64(at + local * R * 4, kAlign);
  L.recv_src = at;      at = align_up_u64(at + local * R * T * 4, kAlign);
  L.recv_rows = at;     at = align_up_u64(at + local * R * T * L.slot_bytes, kAlign);
  L.ret_flags = at;     at = align_up_u64(at + R * local * 8, kAlign);
  L.ret_rows = at;      at = align_up_u64(at + T * K * L.ret_row_bytes, kAlign);
  L.base.total = at;
  return L;
}

// ll_dispatch: x [T, H] (x_kind: bf16 or f32) -> rows [E_local, R * T, H] (row_kind: bf16 or
// fp8), scales [E_local, R * T, H / 128] (fp8), counts [E_local, R], src_slot [E_local, R * T].
struct LLDispatchLaunch {
  GroupLaunch g;  // g.layout: the start kernel's view (LLLayout::base)
  LLLayout L;
  const void* x;
  const int32_t* topk_idx;  // [T, K]
  void* rows;
  float* scales;
  int32_t* counts;
  int32_t* src_slot;
  int32_t num_experts;
  int32_t hidden;
  int32_t x_kind;
  int32_t row_kind;
};
cudaError_t launch_ll_dispatch(const LLDispatchLaunch& p, cudaStream_t stream);

// ll_combine: y [E_local, R * T, H] bf16, src_slot [E_local, R * T], topk_weights [T, K] (0 =
// skipped) -> out [T, H] bf16.
struct LLCombineLaunch {
  GroupLaunch g;
  LLLayout L;
  const void* y;
  const int32_t* src_slot;
  const float* topk_weights;
  void* out;
  int32_t num_experts;
  int32_t hidden;
};
cudaError_t launch_ll_combine(const LLCombineLaunch& p, cudaStream_t stream);

}  // namespace jax_ep
