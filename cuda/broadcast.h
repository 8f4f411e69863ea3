// Broadcast (combine's backward): a dispatch through a known handle, without weights. Host-side
// launcher; kernel in broadcast.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/group.h"

namespace jax_ep {

// out[row] = g of token (s, t) on every receive row of it (token_rows), zero where src_index is -1.
// g: [T, H] bf16 or f32 (g_kind); out: [C, H] same dtype. use_tma: bulk (TMA) row copies.
// rank_major (broadcast_rank_major): g.num_topk = 1, token_rows the slot -> row table of the
// handle (launch_rank_major_rows in combine.h), capacity = R * T (may be 0); a timeout names
// broadcast_rank_major.
cudaError_t launch_broadcast(const GroupLaunch& g, const void* grad, const int32_t* token_rows,
                             const bool* is_token_in_rank, const int32_t* src_index,
                             int32_t capacity, int32_t hidden, int32_t g_kind, bool use_tma,
                             bool rank_major, void* out, cudaStream_t stream);

}  // namespace jax_ep
