// XLA FFI handlers, one per op. All are declared command-buffer compatible and keep it true: at
// execute time they only validate static shapes/attributes on the host, read lock-free runtime
// bookkeeping, and enqueue kernels on XLA's stream (no host sync, no allocation, no stream query,
// no host read of device data).
#include "xla_ffi/handlers.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/layout.h"
#include "cuda/peer_smoke.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/runtime.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

ffi::Error CudaError(cudaError_t status, const std::string& op) {
  return ffi::Error::Internal("jax_ep: " + op + ": " + cudaGetErrorName(status) + " (" +
                              cudaGetErrorString(status) + ")");
}

struct CallCounters {
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> captured_calls{0};
};
CallCounters layout_counters;
CallCounters peer_smoke_counters;

// Counts the call, and whether `stream` is being captured into a CUDA graph right now
// (cudaStreamIsCapturing is legal during capture; it does not query execution status).
ffi::Error CountCall(CallCounters& counters, cudaStream_t stream, const char* op) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t status = cudaStreamIsCapturing(stream, &capture);
  if (status != cudaSuccess) return CudaError(status, std::string(op) + ": cudaStreamIsCapturing");
  counters.calls.fetch_add(1, std::memory_order_relaxed);
  if (capture == cudaStreamCaptureStatusActive) {
    counters.captured_calls.fetch_add(1, std::memory_order_relaxed);
  }
  return ffi::Error::Success();
}

std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

// ---------------------------------------------------------------------------------------------
// jax_ep_dispatch_layout
// ---------------------------------------------------------------------------------------------

ffi::Error DispatchLayoutImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_idx,
                              ffi::ResultBuffer<ffi::S32> tokens_per_rank,
                              ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                              ffi::ResultBuffer<ffi::PRED> is_token_in_rank, int64_t num_experts,
                              int64_t num_ranks) {
  if (ffi::Error error = CountCall(layout_counters, stream, kDispatchLayoutTarget);
      !error.success()) {
    return error;
  }
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

// ---------------------------------------------------------------------------------------------
// jax_ep_peer_smoke
// ---------------------------------------------------------------------------------------------

// `mesh_ordinals` is the mesh's device ordinals with the EP axis last, flattened: rows of
// `group_size` ordinals, one row per EP group. The calling device finds its own row (its group)
// and column (its rank): static information, so a CUDA graph may bake it.
ffi::Error ResolveGroup(int32_t device_ordinal, ffi::Span<const int64_t> mesh_ordinals,
                        int64_t group_size, const char* op, PeerGroup* group) {
  const int64_t total = static_cast<int64_t>(mesh_ordinals.size());
  if (group_size < 1 || group_size > kMaxGroupRanks || total % group_size != 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": group_size=" +
                                       std::to_string(group_size) + " must be in [1, " +
                                       std::to_string(kMaxGroupRanks) + "] and divide the " +
                                       std::to_string(total) + " mesh ordinals");
  }
  int64_t position = -1;
  for (int64_t i = 0; i < total; ++i) {
    if (mesh_ordinals[i] == device_ordinal) {
      if (position >= 0) {
        return ffi::Error::InvalidArgument(std::string(op) + ": device ordinal " +
                                           std::to_string(device_ordinal) +
                                           " appears twice in mesh_ordinals");
      }
      position = i;
    }
  }
  if (position < 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": device ordinal " +
                                       std::to_string(device_ordinal) +
                                       " is not in the mesh this op was traced for");
  }
  const int64_t row = position / group_size;
  group->size = static_cast<int32_t>(group_size);
  group->my_rank = static_cast<int32_t>(position % group_size);
  Runtime& runtime = Runtime::Get();
  for (int64_t rank = 0; rank < group_size; ++rank) {
    const int64_t ordinal = mesh_ordinals[row * group_size + rank];
    if (runtime.State(static_cast<int>(ordinal)) == nullptr) {
      return ffi::Error::Internal(std::string(op) + ": GPU " + std::to_string(ordinal) +
                                  " (rank " + std::to_string(rank) +
                                  ") is not managed by the jax_ep runtime; call "
                                  "jax_ep.runtime.ensure_initialized() before tracing");
    }
    group->ordinals[rank] = static_cast<int32_t>(ordinal);
  }
  return ffi::Error::Success();
}

ffi::Error PeerSmokeImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> tag,
                         ffi::ResultBuffer<ffi::U32> received, ffi::ResultBuffer<ffi::U32> epochs,
                         ffi::Span<const int64_t> mesh_ordinals, int64_t group_size) {
  constexpr const char* kOp = kPeerSmokeTarget;
  if (ffi::Error error = CountCall(peer_smoke_counters, stream, kOp); !error.success()) {
    return error;
  }
  if (tag.element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": tag must be a scalar");
  }
  PeerGroup group{};
  if (ffi::Error error = ResolveGroup(device_ordinal, mesh_ordinals, group_size, kOp, &group);
      !error.success()) {
    return error;
  }
  const auto received_dims = received->dimensions();
  const auto epochs_dims = epochs->dimensions();
  if (received_dims.size() != 2 || received_dims[0] != group_size || epochs_dims.size() != 1 ||
      epochs_dims[0] != group_size) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": outputs " +
                                       DimsToString(received_dims) + ", " +
                                       DimsToString(epochs_dims) + " must be [R, n], [R] with R=" +
                                       std::to_string(group_size));
  }
  const int64_t n = received_dims[1];
  Runtime& runtime = Runtime::Get();
  const uint64_t needed = peer_smoke_comm_bytes(group_size, n);
  if (needed > runtime.CommBytes()) {
    return ffi::Error::InvalidArgument(
        std::string(kOp) + ": needs " + std::to_string(needed) + " bytes of communication "
        "buffer, the runtime has " + std::to_string(runtime.CommBytes()) +
        "; call jax_ep.runtime.ensure_initialized() with a larger buffer_bytes");
  }
  const cudaError_t status =
      launch_peer_smoke(runtime.State(device_ordinal), group, tag.typed_data(), n,
                        received->typed_data(), epochs->typed_data(), stream);
  if (status != cudaSuccess) return CudaError(status, "peer_smoke kernel launch");
  return ffi::Error::Success();
}

}  // namespace

std::vector<HandlerStats> GetHandlerStats() {
  std::vector<HandlerStats> stats;
  for (const auto& [target, counters] :
       {std::pair<const char*, CallCounters*>{kDispatchLayoutTarget, &layout_counters},
        std::pair<const char*, CallCounters*>{kPeerSmokeTarget, &peer_smoke_counters}}) {
    stats.push_back({target, counters->calls.load(std::memory_order_relaxed),
                     counters->captured_calls.load(std::memory_order_relaxed)});
  }
  return stats;
}

}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatchLayout, jax_ep::DispatchLayoutImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()       // topk_idx [T, K]
                                  .Ret<ffi::Buffer<ffi::S32>>()       // tokens_per_rank [R]
                                  .Ret<ffi::Buffer<ffi::S32>>()       // tokens_per_expert [E]
                                  .Ret<ffi::Buffer<ffi::PRED>>()      // is_token_in_rank [T, R]
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpPeerSmoke, jax_ep::PeerSmokeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()       // tag []
                                  .Ret<ffi::Buffer<ffi::U32>>()       // received [R, n]
                                  .Ret<ffi::Buffer<ffi::U32>>()       // epochs [R]
                                  .Attr<ffi::Span<const int64_t>>("mesh_ordinals")
                                  .Attr<int64_t>("group_size"),
                              {ffi::Traits::kCmdBufferCompatible});
