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
//
// rank_major (combine_rank_major): g.num_topk = 1, row_weights null, token_rows the slot -> row
// table of the handle (launch_rank_major_rows): each rank returns its one row of (source, t) as it
// is and the source sums them over ranks in rank order (float32), as
// jax_ep.reference.combine_rank_major; a timeout names combine_rank_major.
cudaError_t launch_combine(const GroupLaunch& g, const void* y, const float* row_weights,
                           const int32_t* token_rows, const bool* is_token_in_rank, int32_t hidden,
                           int32_t y_kind, bool rank_major, void* out, cudaStream_t stream);

// The slot -> row table of a rank-major handle: slot_rows[n] = the row i with src_index[i] = n
// (n = source rank * T + token), -1 where no row holds slot n; num_rows = R * T. This is what
// combine_rank_major and broadcast_rank_major take as token_rows with K = 1: then they are the
// expert-major combine (unweighted, rows as they are) and broadcast. Rank-local (memset + kernel).
cudaError_t launch_rank_major_rows(const int32_t* src_index, int32_t num_rows, int32_t num_blocks,
                                   int32_t* slot_rows, cudaStream_t stream);

}  // namespace jax_ep
