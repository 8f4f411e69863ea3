// Routing layout (DeepEP's get_dispatch_layout): host-side launcher.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_ep {

// From topk_idx [num_tokens, num_topk] (this rank's routing) computes, fully overwriting the
// outputs (XLA output buffers are uninitialised):
//   tokens_per_rank [num_ranks]:               tokens with >= 1 valid expert on rank r
//   tokens_per_expert [num_experts]:           tokens that picked expert e (once per token)
//   is_token_in_rank [num_tokens, num_ranks]:  token t has >= 1 valid expert on rank r
// An id < 0 or >= num_experts is an unused slot; a slot repeating an expert named by an earlier
// slot of the same token is ignored. Expert e lives on rank e / (num_experts / num_ranks).
// Requires num_experts % num_ranks == 0 and num_topk <= dispatch_layout_max_topk(). Enqueues two
// memsets and one kernel on `stream` only (graph-capturable).
cudaError_t launch_dispatch_layout(const int32_t* topk_idx, int64_t num_tokens, int64_t num_topk,
                                   int64_t num_experts, int64_t num_ranks,
                                   int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                                   bool* is_token_in_rank, cudaStream_t stream);

// Largest num_topk the kernel supports (a token's ids are kept in registers).
int64_t dispatch_layout_max_topk();

}  // namespace jax_ep
