// Throughput dispatch over NVLink: host-side launcher (kernels in dispatch.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_state.h"
#include "cuda/ep_layout.h"

namespace jax_ep {

// Everything one rank's dispatch needs. Shapes are static (validated by the FFI handler); rank and
// group are device scalars (lax.axis_index), resolved on the device by group discovery.
struct DispatchLaunch {
  DeviceState* state;
  CommLayout layout;  // make_comm_layout(R, T, K, E, row_bytes, num_scales * 4)
  // inputs
  const void* x;              // [T, H] bf16 or f32 (x_kind)
  const int32_t* topk_idx;    // [T, K]
  const float* topk_weights;  // [T, K]
  const int32_t* rank;        // [] this device's index along the EP axis
  const int32_t* group;       // [] its EP group (index over the other manual mesh axes)
  // outputs (every element written, except rows past sum(group_sizes), which stay unspecified)
  void* rows;                 // [C, H] row_kind
  float* scales;              // [C, H / 128] for FP8 rows, else unused
  int32_t* group_sizes;       // [E_local]
  int32_t* expert_counts;     // [E_local]
  float* row_weights;         // [C]
  int32_t* num_dropped;       // []
  int32_t* src_index;         // [C]
  int32_t* token_rows;        // [R * T, K]
  bool* is_token_in_rank;     // [T, R]
  // static sizes
  int32_t num_tokens;
  int32_t num_topk;
  int32_t num_experts;
  int32_t num_ranks;
  int32_t hidden;
  int32_t capacity;
  int32_t alignment;
  int32_t x_kind;     // RowKind: kRowBF16 or kRowF32
  int32_t row_kind;   // RowKind of rows: x_kind, kRowBF16 (from f32) or kRowFP8
  int32_t num_blocks;  // blocks of the data kernel (<= num_sms, < SMs of the device)
  int32_t send_warps;  // warps per block that send (the others receive), in [1, 15]
  int32_t axis_slot;   // directory slot of the EP axis, in [0, kDirectoryAxes)
  bool use_tma;        // raw row copies with bulk (TMA) copies through shared memory
};

// Bytes of a dispatched row for the row kind.
inline int64_t dispatch_row_bytes(int64_t hidden, int32_t row_kind) {
  return hidden * (row_kind == kRowF32 ? 4 : row_kind == kRowBF16 ? 2 : 1);
}

// Enqueues the dispatch kernels on `stream` (graph-capturable: kernels only).
cudaError_t launch_dispatch(const DispatchLaunch& args, cudaStream_t stream);

}  // namespace jax_ep
