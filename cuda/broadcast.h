// Broadcast (combine's backward): a dispatch through a known handle, without weights; and
// combine_bwd, the broadcast fused with the rest of combine's backward. Host-side launchers;
// kernel in broadcast.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/group.h"

namespace jax_ep {

// out[row] = g of token (s, t) on every receive row of it (token_rows); zero where src_index is -1
// or names a source the call does not link (rank masking).
// g: [T, H] bf16 or f32 (g_kind); out: [C, H] same dtype. use_tma: bulk (TMA) row copies.
// rank_major (broadcast_rank_major): g.num_topk = 1, token_rows the slot -> row table of the
// handle (launch_rank_major_rows in combine.h), capacity = R * T (may be 0); a timeout names
// broadcast_rank_major.
// keep_empty_rows (not with rank_major): out already holds the caller's rows (a buffer aliased in,
// as combine_bwd's in place): the rows with src_index -1 keep them instead of being zeroed, so only
// the token rows (and a masked source's) are written: an unweighted combine's backward in place.
cudaError_t launch_broadcast(const GroupLaunch& g, const void* grad, const int32_t* token_rows,
                             const bool* is_token_in_rank, const int32_t* src_index,
                             int32_t capacity, int32_t hidden, int32_t g_kind, bool use_tma,
                             bool rank_major, bool keep_empty_rows, void* out, cudaStream_t stream);

// combine's backward in one kernel (jax_ep.reference.combine_bwd): for every row of a token (s, t)
// as broadcast places it, with g = the token's cotangent row (moved as the broadcast moves it):
// dy[row] = row_weights[row] * g (float32 product, rounded to the row dtype) and d_row_weights[row]
// = the float32 dot product of y[row] and g in the order of jax_ep.reference.row_dot (products
// rounded, no FMA); both zero for the rows broadcast zeroes, whose y is never read. grad [T, H], y
// and dy [C, H], all of `kind` (kRowBF16 or kRowF32); row_weights, d_row_weights [C] float32.
// use_tma: the senders' copies of g are bulk copies. dy == y (one buffer: the caller aliased them):
// in place, the rows that hold no token (src_index -1: padding, past the groups) keep y's values
// instead of being zeroed (d_row_weights there are still zeroed): the caller knows y is zero there,
// so only the token rows are written (at the worst-case capacity most of C holds no token). A
// timeout names combine_bwd.
cudaError_t launch_combine_bwd(const GroupLaunch& g, const void* grad, const void* y,
                               const float* row_weights, const int32_t* token_rows,
                               const bool* is_token_in_rank, const int32_t* src_index,
                               int32_t capacity, int32_t hidden, int32_t kind, bool use_tma,
                               void* dy, float* d_row_weights, cudaStream_t stream);

}  // namespace jax_ep
