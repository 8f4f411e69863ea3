// jax_ep_dispatch_layout: tokens per rank and per expert, token -> rank membership
// (cuda/layout.h). Stateless: no communication.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/layout.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/handler_util.h"
#include "xla_ffi/handlers.h"
#include "xla_ffi/runtime.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

ffi::Error DispatchLayoutImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_idx,
                              ffi::ResultBuffer<ffi::S32> tokens_per_rank,
                              ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                              ffi::ResultBuffer<ffi::PRED> is_token_in_rank, int64_t num_experts,
                              int64_t num_ranks) {
  JAX_EP_RETURN_IF_ERROR(CountCall(dispatch_layout_counters, stream, kDispatchLayoutTarget));
  const auto topk_dims = topk_idx.dimensions();
  if (topk_dims.size() != 2) {
    return ffi::Error::InvalidArgument("jax_ep_dispatch_layout: topk_idx must be [T, K], got " +
                                       DimsToString(topk_dims));
  }
  if (num_ranks < 1 || num_experts < 1 || num_experts % num_ranks != 0) {
    return ffi::Error::InvalidArgument(
        "jax_ep_dispatch_layout: num_experts=" + std::to_string(num_experts) +
        " must be a positive multiple of num_ranks=" + std::to_string(num_ranks));
  }
  const int64_t num_tokens = topk_dims[0];
  const int64_t num_topk = topk_dims[1];
  if (num_topk > dispatch_layout_max_topk()) {
    return ffi::Error::InvalidArgument(
        "jax_ep_dispatch_layout: num_topk=" + std::to_string(num_topk) + " exceeds the " +
        std::to_string(dispatch_layout_max_topk()) + " the CUDA kernel supports");
  }
  const auto rank_dims = tokens_per_rank->dimensions();
  const auto expert_dims = tokens_per_expert->dimensions();
  const auto in_rank_dims = is_token_in_rank->dimensions();
  if (rank_dims.size() != 1 || rank_dims[0] != num_ranks || expert_dims.size() != 1 ||
      expert_dims[0] != num_experts || in_rank_dims.size() != 2 || in_rank_dims[0] != num_tokens ||
      in_rank_dims[1] != num_ranks) {
    return ffi::Error::InvalidArgument(
        "jax_ep_dispatch_layout: output shapes " + DimsToString(rank_dims) + ", " +
        DimsToString(expert_dims) + ", " + DimsToString(in_rank_dims) + " do not match [R=" +
        std::to_string(num_ranks) + "], [E=" + std::to_string(num_experts) + "], [T=" +
        std::to_string(num_tokens) + ", R]");
  }
  const cudaError_t status = launch_dispatch_layout(
      topk_idx.typed_data(), num_tokens, num_topk, num_experts, num_ranks,
      tokens_per_rank->typed_data(), tokens_per_expert->typed_data(),
      is_token_in_rank->typed_data(), stream);
  if (status != cudaSuccess) return CudaError(status, "dispatch_layout kernel launch");
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatchLayout, jax_ep::DispatchLayoutImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks"),
                              {ffi::Traits::kCmdBufferCompatible});
