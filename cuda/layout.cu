// Routing layout (DeepEP's get_dispatch_layout).
//
// Token-parallel: one thread per token keeps the token's K ids in registers, drops invalid ids and
// repeats (sanitized_expert), writes the token's row of is_token_in_rank, and counts into
// block-level histograms in shared memory, which each block adds to the outputs with one atomic
// per non-zero bin. The count outputs are zeroed first with cudaMemsetAsync on the same stream
// (XLA output buffers are uninitialised; memsets are stream-ordered and captured into CUDA graphs
// like kernels). Integer atomics make the result independent of the order. The grid is at most
// kMaxLayoutBlocks blocks, so XLA's own kernels keep most of the GPU.
#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/layout.h"

namespace jax_ep {
namespace {

constexpr int kLayoutThreads = 256;
constexpr int kMaxLayoutBlocks = 64;           // H100/H200 have 132 SMs
constexpr int kMaxSharedBins = 8192;           // E + R bins fit in 32 KiB of shared memory
constexpr int64_t kMaxSupportedTopk = 64;      // ids kept in registers (see the dispatch below)

// Sets is_token_in_rank[token, :] to false, with the widest stores the row alignment allows (XLA
// buffers are at least 16-byte aligned; the row starts at token * num_ranks bytes).
__device__ __forceinline__ void clear_row(bool* row, int num_ranks) {
  if ((num_ranks & 15) == 0) {
    uint4* wide = reinterpret_cast<uint4*>(row);
    for (int i = 0; i < num_ranks / 16; ++i) wide[i] = make_uint4(0, 0, 0, 0);
  } else if ((num_ranks & 3) == 0) {
    uint32_t* words = reinterpret_cast<uint32_t*>(row);
    for (int i = 0; i < num_ranks / 4; ++i) words[i] = 0;
  } else {
    for (int i = 0; i < num_ranks; ++i) row[i] = false;
  }
}

// kMaxTopk: register capacity for the token's ids (>= num_topk); unrolled loops keep them in
// registers. Bins: [0, E) experts, [E, E + R) ranks; in shared memory when they fit, else the
// kernel adds straight to the outputs.
template <int kMaxTopk>
__global__ void __launch_bounds__(kLayoutThreads)
    dispatch_layout_kernel(const int32_t* __restrict__ topk_idx, int64_t num_tokens, int num_topk,
                           int num_experts, int num_ranks, bool shared_bins,
                           int32_t* __restrict__ tokens_per_rank,
                           int32_t* __restrict__ tokens_per_expert,
                           bool* __restrict__ is_token_in_rank) {
  JAX_EP_DYNAMIC_SHARED(int32_t, bins);
  const int num_bins = num_experts + num_ranks;
  int32_t* expert_bins = shared_bins ? bins : tokens_per_expert;
  int32_t* rank_bins = shared_bins ? bins + num_experts : tokens_per_rank;
  if (shared_bins) {
    for (int i = threadIdx.x; i < num_bins; i += blockDim.x) bins[i] = 0;
    __syncthreads();
  }
  const int experts_per_rank = num_experts / num_ranks;
  for (int64_t token = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       token < num_tokens; token += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t* row = topk_idx + token * num_topk;
    int32_t ids[kMaxTopk];  // -1 past num_topk
    int32_t ranks[kMaxTopk];  // of each id in [0, E), else -1
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      ids[k] = k < num_topk ? __ldg(row + k) : -1;
      ranks[k] = ids[k] >= 0 && ids[k] < num_experts ? ids[k] / experts_per_rank : -1;
    }
    bool* in_rank_row = is_token_in_rank + token * num_ranks;
    clear_row(in_rank_row, num_ranks);
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      const int32_t expert = sanitized_expert(ids, k, num_experts);  // an expert counts once
      if (expert < 0) continue;
      bool first_of_rank = true;  // a token travels to a rank once
#pragma unroll
      for (int j = 0; j < kMaxTopk; ++j) {
        if (j < k) first_of_rank &= ranks[j] != ranks[k];
      }
      atomicAdd(&expert_bins[expert], 1);
      if (first_of_rank) {
        atomicAdd(&rank_bins[ranks[k]], 1);
        in_rank_row[ranks[k]] = true;  // after clear_row, by the same thread
      }
    }
  }
  if (shared_bins) {
    __syncthreads();
    for (int i = threadIdx.x; i < num_bins; i += blockDim.x) {
      const int32_t count = bins[i];
      if (count == 0) continue;
      if (i < num_experts) {
        atomicAdd(&tokens_per_expert[i], count);
      } else {
        atomicAdd(&tokens_per_rank[i - num_experts], count);
      }
    }
  }
}

template <int kMaxTopk>
cudaError_t launch(const int32_t* topk_idx, int64_t num_tokens, int num_topk, int num_experts,
                   int num_ranks, int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                   bool* is_token_in_rank, cudaStream_t stream) {
  const int64_t blocks_needed = (num_tokens + kLayoutThreads - 1) / kLayoutThreads;
  const int grid = static_cast<int>(std::min<int64_t>(blocks_needed, kMaxLayoutBlocks));
  const bool shared_bins = num_experts + num_ranks <= kMaxSharedBins;
  const size_t shared_bytes = shared_bins ? (num_experts + num_ranks) * sizeof(int32_t) : 0;
  JAX_EP_LAUNCH(dispatch_layout_kernel<kMaxTopk>, grid, kLayoutThreads, shared_bytes, stream)(
      topk_idx, num_tokens, num_topk, num_experts, num_ranks, shared_bins, tokens_per_rank,
      tokens_per_expert, is_token_in_rank);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace

int64_t dispatch_layout_max_topk() { return kMaxSupportedTopk; }

cudaError_t launch_dispatch_layout(const int32_t* topk_idx, int64_t num_tokens, int64_t num_topk,
                                   int64_t num_experts, int64_t num_ranks,
                                   int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                                   bool* is_token_in_rank, cudaStream_t stream) {
  // The FFI handler validates shapes; these guard the int arithmetic of the kernel.
  if (num_tokens < 0 || num_topk < 0 || num_topk > kMaxSupportedTopk || num_experts < 1 ||
      num_ranks < 1 || num_experts % num_ranks != 0 || num_experts > INT32_MAX / 2 ||
      num_ranks > INT32_MAX / 2) {
    return cudaErrorInvalidValue;
  }
  JAX_EP_CUDA_RETURN(
      cudaMemsetAsync(tokens_per_expert, 0, num_experts * sizeof(int32_t), stream));
  JAX_EP_CUDA_RETURN(cudaMemsetAsync(tokens_per_rank, 0, num_ranks * sizeof(int32_t), stream));
  if (num_tokens == 0) return cudaSuccess;  // counts are zero; is_token_in_rank is empty
  const int topk = static_cast<int>(num_topk);
  const int experts = static_cast<int>(num_experts);
  const int ranks = static_cast<int>(num_ranks);
  if (topk <= 8) {
    return launch<8>(topk_idx, num_tokens, topk, experts, ranks, tokens_per_rank,
                     tokens_per_expert, is_token_in_rank, stream);
  }
  if (topk <= 16) {
    return launch<16>(topk_idx, num_tokens, topk, experts, ranks, tokens_per_rank,
                      tokens_per_expert, is_token_in_rank, stream);
  }
  if (topk <= 32) {
    return launch<32>(topk_idx, num_tokens, topk, experts, ranks, tokens_per_rank,
                      tokens_per_expert, is_token_in_rank, stream);
  }
  return launch<64>(topk_idx, num_tokens, topk, experts, ranks, tokens_per_rank,
                    tokens_per_expert, is_token_in_rank, stream);
}

}  // namespace jax_ep
