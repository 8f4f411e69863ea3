// jax_ep_peer_smoke (process model 1: peer loads and stores) and jax_ep_remote_smoke (process
// model 2: NVSHMEM device puts and signals): the transports' own tests (cuda/peer_smoke.h,
// cuda/remote.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/peer_smoke.h"
#include "cuda/remote.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/handler_util.h"
#include "xla_ffi/handlers.h"
#include "xla_ffi/runtime.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

// `mesh_slots` is the mesh's device slots (cuda/device_state.h) with the EP axis last, flattened:
// rows of `group_size` slots, one row per EP group. The calling device finds its own row (its
// group) and column (its rank): static information, so a CUDA graph may bake it.
ffi::Error ResolveGroup(int32_t device_ordinal, const OpState& state, const char* op,
                        PeerGroup* group) {
  const std::vector<int64_t>& mesh_slots = state.mesh_slots;
  const int64_t group_size = state.attrs.num_ranks;
  const int64_t total = static_cast<int64_t>(mesh_slots.size());
  const int my_slot = state.runtime->Slot(device_ordinal);
  if (my_slot < 0) {
    return ffi::Error::Internal(std::string(op) + ": GPU " + std::to_string(device_ordinal) +
                                " is not managed by the jax_ep runtime");
  }
  int64_t position = -1;
  for (int64_t i = 0; i < total; ++i) {
    if (mesh_slots[i] == my_slot) {
      if (position >= 0) {
        return Invalid(op, "slot " + std::to_string(my_slot) + " appears twice in mesh_slots");
      }
      position = i;
    }
  }
  if (position < 0) {
    return Invalid(op, "GPU " + std::to_string(device_ordinal) + " (slot " +
                           std::to_string(my_slot) + ") is not in the mesh this op was traced for");
  }
  const int64_t row = position / group_size;
  group->size = static_cast<int32_t>(group_size);
  group->my_rank = static_cast<int32_t>(position % group_size);
  for (int64_t rank = 0; rank < group_size; ++rank) {
    const int64_t slot = mesh_slots[row * group_size + rank];
    if (!state.runtime->SlotReachable(static_cast<int>(slot))) {
      return ffi::Error::Internal(std::string(op) + ": the GPU of slot " + std::to_string(slot) +
                                  " (rank " + std::to_string(rank) +
                                  ") is not reachable through the jax_ep runtime");
    }
    group->ordinals[rank] = static_cast<int32_t>(slot);
  }
  return ffi::Error::Success();
}

// The op's kernel puts to symmetric addresses, which exist only on NVSHMEM's heap.
ffi::Error RequireProcessPerGpu(const char* op, const Runtime& runtime) {
  if (runtime.Model() != ProcessModel::kProcessPerGpu) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(op) + ": remote_smoke needs process model 2 (NVSHMEM): one "
                      "process per GPU under jax.distributed; this process drives its GPUs in "
                      "process model 1 (local peers), which has no symmetric heap");
  }
  return ffi::Error::Success();
}

// A smoke op's call site (both transports): the mesh's slots in rows of group_size (one row per EP
// group, ResolveGroup) and n words per peer; `comm_bytes(group_size, n)` sizes its buffer. Puts
// (`symmetric_heap`) need process model 2.
ffi::ErrorOr<std::unique_ptr<OpState>> SmokeInstantiate(const char* op,
                                                        ffi::Span<const int64_t> mesh_slots,
                                                        int64_t group_size, int64_t n,
                                                        uint64_t (*comm_bytes)(int64_t, int64_t),
                                                        bool symmetric_heap) {
  const int64_t total = static_cast<int64_t>(mesh_slots.size());
  if (group_size < 1 || group_size > kMaxGroupRanks || total % group_size != 0 || n < 0) {
    return ffi::Unexpected(Invalid(op, "group_size=" + std::to_string(group_size) +
                                           " must be in [1, " + std::to_string(kMaxGroupRanks) +
                                           "] and divide the " + std::to_string(total) +
                                           " mesh slots; n=" + std::to_string(n)));
  }
  if (symmetric_heap) {
    if (ffi::Error error = RequireProcessPerGpu(op, Runtime::Get()); !error.success()) {
      return ffi::Unexpected(error);
    }
  }
  EPAttrs attrs{};
  attrs.num_ranks = group_size;
  attrs.num_tokens = n;
  CommLayout layout{};
  layout.total = comm_bytes(group_size, n);
  return MakeState(op, attrs, layout, std::vector<int64_t>(mesh_slots.begin(), mesh_slots.end()));
}

ffi::ErrorOr<std::unique_ptr<OpState>> PeerSmokeInstantiate(ffi::Span<const int64_t> mesh_slots,
                                                            int64_t group_size, int64_t n) {
  return SmokeInstantiate(kPeerSmokeTarget, mesh_slots, group_size, n, peer_smoke_comm_bytes,
                          /*symmetric_heap=*/false);
}

ffi::Error PeerSmokeImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                         ffi::Buffer<ffi::S32> tag, ffi::ResultBuffer<ffi::U32> received,
                         ffi::ResultBuffer<ffi::U32> epochs) {
  constexpr const char* kOp = kPeerSmokeTarget;
  JAX_EP_RETURN_IF_ERROR(CountCall(peer_smoke_counters, stream, kOp));
  const int64_t R = state->attrs.num_ranks, n = state->attrs.num_tokens;
  if (tag.element_count() != 1 || !IsShape(received->dimensions(), {R, n}) ||
      !IsShape(epochs->dimensions(), {R})) {
    return Invalid(kOp, "tag, received, epochs must be [], [R, n], [R] with R=" +
                            std::to_string(R) + ", n=" + std::to_string(n) + "; got received " +
                            DimsToString(received->dimensions()));
  }
  PeerGroup group{};
  JAX_EP_RETURN_IF_ERROR(ResolveGroup(device_ordinal, *state, kOp, &group));
  JAX_EP_RETURN_IF_ERROR(CheckBuffer(kOp, *state));
  const Runtime& runtime = *state->runtime;
  const cudaError_t status =
      launch_peer_smoke(runtime.State(device_ordinal), group, tag.typed_data(), n,
                        received->typed_data(), epochs->typed_data(), stream);
  if (status != cudaSuccess) return CudaError(status, "peer_smoke kernel launch");
  return ffi::Error::Success();
}


ffi::ErrorOr<std::unique_ptr<OpState>> RemoteSmokeInstantiate(ffi::Span<const int64_t> mesh_slots,
                                                              int64_t group_size, int64_t n) {
  return SmokeInstantiate(kRemoteSmokeTarget, mesh_slots, group_size, n, remote_smoke_comm_bytes,
                          /*symmetric_heap=*/true);
}

ffi::Error RemoteSmokeImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                           ffi::Buffer<ffi::S32> tag, ffi::ResultBuffer<ffi::U32> received) {
  constexpr const char* kOp = kRemoteSmokeTarget;
  JAX_EP_RETURN_IF_ERROR(CountCall(remote_smoke_counters, stream, kOp));
  const Runtime& runtime = *state->runtime;
  JAX_EP_RETURN_IF_ERROR(RequireProcessPerGpu(kOp, runtime));
  const int64_t R = state->attrs.num_ranks, n = state->attrs.num_tokens;
  if (tag.element_count() != 1 || !IsShape(received->dimensions(), {R, n})) {
    return Invalid(kOp, "tag, received must be [], [R, n] with R=" + std::to_string(R) + ", n=" +
                            std::to_string(n) + "; got received " +
                            DimsToString(received->dimensions()));
  }
  PeerGroup group{};
  JAX_EP_RETURN_IF_ERROR(ResolveGroup(device_ordinal, *state, kOp, &group));
  JAX_EP_RETURN_IF_ERROR(CheckBuffer(kOp, *state));
  const cudaError_t status = launch_remote_smoke(runtime.State(device_ordinal), group,
                                                 tag.typed_data(), n, received->typed_data(),
                                                 stream);
  if (status != cudaSuccess) return CudaError(status, "remote_smoke kernel launch");
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpPeerSmokeInstantiate, jax_ep::PeerSmokeInstantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Attr<ffi::Span<const int64_t>>("mesh_slots")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("n"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpPeerSmoke, jax_ep::PeerSmokeImpl,
                              jax_ep::BindPeerOp()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpRemoteSmokeInstantiate, jax_ep::RemoteSmokeInstantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Attr<ffi::Span<const int64_t>>("mesh_slots")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("n"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpRemoteSmoke, jax_ep::RemoteSmokeImpl,
                              jax_ep::BindPeerOp()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>(),
                              {ffi::Traits::kCmdBufferCompatible});
