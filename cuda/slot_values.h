// slot_values (dispatch's gate-weight backward): per-row values back to their top-k slots through
// a known handle. Host-side launcher; kernel in slot_values.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/group.h"

namespace jax_ep {

// out[t, k] = sum over ranks r of (values[row] on rank r for row = token_rows[(me * T + t), k]
// there, 0 where row < 0). values: [C] f32; out: [T, K] f32.
cudaError_t launch_slot_values(const GroupLaunch& g, const float* values,
                               const int32_t* token_rows, float* out, cudaStream_t stream);

}  // namespace jax_ep
