// Throughput combine over NVLink: host-side launcher (kernel in combine.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/group.h"

namespace jax_ep {

// out[t] = sum over ranks r (in rank order, float32) of partial_r(t) rounded to y's dtype, where
// partial_r(t) = sum over slots k (in order, float32) of w[row] * y[row] on rank r, row =
// token_rows[(me * T + t), k] there (rows >= 0 only; w = 1 when row_weights is null).
// y: [C, H] bf16 or f32 (y_kind); out: [T, H] same dtype.
cudaError_t launch_combine(const GroupLaunch& g, const void* y, const float* row_weights,
                           const int32_t* token_rows, const bool* is_token_in_rank, int32_t hidden,
                           int32_t y_kind, void* out, cudaStream_t stream);

}  // namespace jax_ep
