// Throughput combine over NVLink, and the two ops the backward passes need with a known handle
// (broadcast: a dispatch without weights; slot_values: per-row values back to their top-k slots).
// Host-side launchers; kernels in combine.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_state.h"
#include "cuda/ep_layout.h"

namespace jax_ep {

// Fields common to the three ops: the group (device scalars), the layout and the grid.
struct GroupLaunch {
  DeviceState* state;
  CommLayout layout;
  const int32_t* rank;   // [] index along the EP axis
  const int32_t* group;  // [] EP group
  int32_t num_ranks;     // R (static)
  int32_t num_tokens;    // T
  int32_t num_topk;      // K
  int32_t axis_slot;
  int32_t num_blocks;
  int32_t send_warps;    // combine: reducer warps; broadcast: sender warps (per block, of 16)
};

// out[t] = sum over ranks r (in rank order, float32) of partial_r(t) rounded to y's dtype, where
// partial_r(t) = sum over slots k (in order, float32) of w[row] * y[row] on rank r, row =
// token_rows[(me * T + t), k] there (rows >= 0 only; w = 1 when row_weights is null).
// y: [C, H] bf16 or f32 (y_kind); out: [T, H] same dtype.
cudaError_t launch_combine(const GroupLaunch& g, const void* y, const float* row_weights,
                           const int32_t* token_rows, const bool* is_token_in_rank, int32_t hidden,
                           int32_t y_kind, void* out, cudaStream_t stream);

// out[row] = g of token (s, t) on every receive row of it (token_rows), zero where src_index is -1.
// g: [T, H] bf16 or f32 (g_kind); out: [C, H] same dtype. use_tma: bulk (TMA) row copies.
cudaError_t launch_broadcast(const GroupLaunch& g, const void* grad, const int32_t* token_rows,
                             const bool* is_token_in_rank, const int32_t* src_index,
                             int32_t capacity, int32_t hidden, int32_t g_kind, bool use_tma,
                             void* out, cudaStream_t stream);

// out[t, k] = sum over ranks r of (values[row] on rank r for row = token_rows[(me * T + t), k]
// there, 0 where row < 0). values: [C] f32; out: [T, K] f32.
cudaError_t launch_slot_values(const GroupLaunch& g, const float* values,
                               const int32_t* token_rows, float* out, cudaStream_t stream);

}  // namespace jax_ep
