// XLA FFI handlers, one per op. All are declared command-buffer compatible and keep it true: at
// execute time they only check buffer shapes against the attributes on the host, read lock-free
// runtime bookkeeping, and enqueue kernels on XLA's stream (no host sync, no allocation, no stream
// query, no host read of device data).
//
// The communicating ops (peer_smoke, remote_smoke, dispatch, combine, broadcast, combine_bwd,
// slot_values) have an
// instantiate stage: when XLA instantiates an executable, each call site decodes its attributes
// once (EPAttrs), computes its communication-buffer layout from them (make_comm_layout, the one
// layout function), reserves that much buffer in the runtime and keeps an OpState holding the
// runtime; the execute stage reads the OpState. Who checks what: user errors in Python (jax_ep),
// buffer shapes against attributes here, internal invariants in the launchers/kernels.
#include "xla_ffi/handlers.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda/broadcast.h"
#include "cuda/combine.h"
#include "cuda/dispatch.h"
#include "cuda/ep_layout.h"
#include "cuda/group.h"
#include "cuda/layout.h"
#include "cuda/low_latency.h"
#include "cuda/peer_smoke.h"
#include "cuda/remote.h"
#include "cuda/remote_rank_major.h"
#include "cuda/slot_values.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/device_memory.h"
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
// name_counters per target (JAX_EP_TARGETS)
#define JAX_EP_COUNTERS(Name, name) CallCounters name##_counters;
JAX_EP_TARGETS(JAX_EP_COUNTERS)
#undef JAX_EP_COUNTERS

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
  if (ffi::Error error = CountCall(dispatch_layout_counters, stream, kDispatchLayoutTarget);
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

bool IsShape(ffi::Span<const int64_t> dims, std::initializer_list<int64_t> want) {
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (dims[i++] != w) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// State of a communicating call site (instantiate stage)
// ---------------------------------------------------------------------------------------------

ffi::Error Invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// Reserves the call site's buffer and builds its state; runtime errors become FFI errors.
ffi::ErrorOr<std::unique_ptr<OpState>> MakeState(const char* op, const EPAttrs& attrs,
                                                 const CommLayout& layout,
                                                 std::vector<int64_t> mesh_slots = {}) {
  auto state = std::make_unique<OpState>();
  try {
    state->runtime = Runtime::Shared();
    state->runtime->Reserve(layout.total);
  } catch (const DeviceMemoryError& error) {  // XLA reports it as RESOURCE_EXHAUSTED, like its own
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kResourceExhausted,
                                      std::string(op) + ": " + error.what()));
  } catch (const std::exception& error) {
    return ffi::Unexpected(ffi::Error::Internal(std::string(op) + ": " + error.what()));
  }
  state->attrs = attrs;
  state->layout = layout;
  state->mesh_slots = std::move(mesh_slots);
  return state;
}

// Attribute ranges of the data ops. Python builds them (jax_ep.cuda_backend._attrs) after checking
// the user's config, so a failure here is a bug, reported before anything runs.
ffi::Error CheckAttrs(const char* op, const EPAttrs& a) {
  if (a.num_ranks < 1 || a.num_ranks > kMaxGroupRanks || a.num_topk < 1 || a.num_topk > kMaxTopk ||
      a.num_tokens < 0 || a.num_ranks * a.num_tokens >= (int64_t{1} << 31) || a.axis_slot < 0 ||
      a.axis_slot >= kDirectoryAxes || a.num_sms < 1 || a.send_warps < 1 ||
      a.send_warps >= kBlockWarps || a.num_experts < 0 || a.num_experts > kMaxExperts ||
      a.hidden < 0 || a.hidden % kRowAlignment != 0 || a.hidden >= (int64_t{1} << 28) ||
      a.capacity < 0 || a.capacity >= (int64_t{1} << 31) || a.row_bytes < 0 || a.scale_bytes < 0) {
    return Invalid(op, "attributes out of range: R=" + std::to_string(a.num_ranks) + " T=" +
                           std::to_string(a.num_tokens) + " K=" + std::to_string(a.num_topk) +
                           " E=" + std::to_string(a.num_experts) + " H=" +
                           std::to_string(a.hidden) + " C=" + std::to_string(a.capacity) +
                           " axis_slot=" + std::to_string(a.axis_slot) + " num_sms=" +
                           std::to_string(a.num_sms) + " send_warps=" +
                           std::to_string(a.send_warps));
  }
  return ffi::Error::Success();
}

// The put transport (cuda/remote_rank_major.h) exists for the rank-major ops only, and needs the
// symmetric heap of process model 2. Python picks it (cuda_backend._transport) and refuses the other
// cases at trace time; this is the check behind it.
ffi::Error CheckTransport(const char* op, const EPAttrs& a, const Runtime& runtime) {
  if (a.transport == kTransportLoadStore) return ffi::Error::Success();
  const std::string name(op);
  const bool rank_major = name == kDispatchRankMajorTarget || name == kCombineRankMajorTarget ||
                          name == kBroadcastRankMajorTarget;
  if (a.transport != kTransportPut || !rank_major) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      name + ": transport=" + std::to_string(a.transport) + ": only the rank-major "
                      "ops (dispatch_rank_major, combine_rank_major, broadcast_rank_major) have the "
                      "NVSHMEM put transport (1)");
  }
  if (runtime.Model() != ProcessModel::kProcessPerGpu) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      name + ": the NVSHMEM put transport needs process model 2 (one process per "
                      "GPU under jax.distributed, the symmetric heap); this process drives its GPUs "
                      "in process model 1");
  }
  return ffi::Error::Success();
}

template <const char* kOp>
ffi::ErrorOr<std::unique_ptr<OpState>> DataOpInstantiate(EPAttrs attrs) {
  if (ffi::Error error = CheckAttrs(kOp, attrs); !error.success()) return ffi::Unexpected(error);
  CommLayout layout =
      make_comm_layout(attrs.num_ranks, attrs.num_tokens, attrs.num_topk, attrs.num_experts,
                       static_cast<uint64_t>(attrs.row_bytes), static_cast<uint64_t>(attrs.scale_bytes));
  PutLayout put{};
  if (attrs.transport != kTransportLoadStore) {
    if (ffi::Error error = CheckTransport(kOp, attrs, Runtime::Get()); !error.success()) {
      return ffi::Unexpected(error);
    }
    const bool dispatch = std::string(kOp) == kDispatchRankMajorTarget;
    put = make_put_layout(attrs.num_ranks, attrs.num_tokens, dispatch ? attrs.num_topk : 0,
                          static_cast<uint64_t>(attrs.row_bytes),
                          static_cast<uint64_t>(attrs.scale_bytes), dispatch);
    layout.total = put.total;  // what the call site reserves and CheckBuffer checks
  }
  auto state = MakeState(kOp, attrs, layout);
  if (state.has_value()) (*state)->put_layout = put;
  return state;
}

// The PutLaunch of a rank-major call site with the put transport, from its group launch fields.
PutLaunch PutLaunchOf(const OpState& state, DeviceState* device_state, const int32_t* rank,
                      const int32_t* group, int32_t num_blocks, int32_t row_kind) {
  const EPAttrs& a = state.attrs;
  PutLaunch p{};
  p.state = device_state;
  p.layout = state.put_layout;
  p.rank = rank;
  p.group = group;
  p.num_ranks = static_cast<int32_t>(a.num_ranks);
  p.num_tokens = static_cast<int32_t>(a.num_tokens);
  p.num_topk = static_cast<int32_t>(a.num_topk);
  p.num_experts = static_cast<int32_t>(a.num_experts);
  p.hidden = static_cast<int32_t>(a.hidden);
  p.axis_slot = static_cast<int32_t>(a.axis_slot);
  p.num_blocks = num_blocks;
  p.row_kind = row_kind;
  return p;
}

// The buffer the call site reserved at instantiation is still there (a shutdown in between frees it;
// then the runtime reports 0 bytes).
ffi::Error CheckBuffer(const char* op, const OpState& state) {
  const uint64_t have = state.runtime->CommBytes();
  if (state.layout.total > have) {
    return ffi::Error::Internal(std::string(op) + ": needs " + std::to_string(state.layout.total) +
                                " bytes of communication buffer, the runtime has " +
                                std::to_string(have));
  }
  return ffi::Error::Success();
}

// The launch fields every data op shares, from its state and the device it runs on.
ffi::Error PrepareGroup(const char* op, int32_t device_ordinal, const OpState& state,
                        ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                        GroupLaunch* launch) {
  if (rank.element_count() != 1 || group.element_count() != 1) {
    return Invalid(op, "rank and group must be int32 scalars");
  }
  const Runtime& runtime = *state.runtime;
  DeviceState* device_state = runtime.State(device_ordinal);
  if (device_state == nullptr) {
    return ffi::Error::Internal(std::string(op) + ": GPU " + std::to_string(device_ordinal) +
                                " is not managed by the jax_ep runtime (it was shut down, or JAX "
                                "runs this executable on a GPU it was not given)");
  }
  if (ffi::Error error = CheckBuffer(op, state); !error.success()) return error;
  const int sms = runtime.SmCount(device_ordinal);
  if (sms < 2) {
    return ffi::Error::Internal(std::string(op) + ": unknown SM count of GPU " +
                                std::to_string(device_ordinal));
  }
  const EPAttrs& a = state.attrs;
  launch->state = device_state;
  launch->layout = state.layout;
  launch->rank = rank.typed_data();
  launch->group = group.typed_data();
  launch->num_ranks = static_cast<int32_t>(a.num_ranks);
  launch->num_tokens = static_cast<int32_t>(a.num_tokens);
  launch->num_topk = static_cast<int32_t>(a.num_topk);
  launch->axis_slot = static_cast<int32_t>(a.axis_slot);
  launch->num_blocks = static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(a.num_sms, sms - 1)));
  launch->send_warps = static_cast<int32_t>(a.send_warps);
  launch->shrink = a.shrink != 0 ? 1 : 0;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// jax_ep_peer_smoke
// ---------------------------------------------------------------------------------------------

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

ffi::ErrorOr<std::unique_ptr<OpState>> PeerSmokeInstantiate(ffi::Span<const int64_t> mesh_slots,
                                                            int64_t group_size, int64_t n) {
  constexpr const char* kOp = kPeerSmokeTarget;
  const int64_t total = static_cast<int64_t>(mesh_slots.size());
  if (group_size < 1 || group_size > kMaxGroupRanks || total % group_size != 0 || n < 0) {
    return ffi::Unexpected(Invalid(kOp, "group_size=" + std::to_string(group_size) +
                                            " must be in [1, " + std::to_string(kMaxGroupRanks) +
                                            "] and divide the " + std::to_string(total) +
                                            " mesh slots; n=" + std::to_string(n)));
  }
  EPAttrs attrs{};
  attrs.num_ranks = group_size;
  attrs.num_tokens = n;
  CommLayout layout{};
  layout.total = peer_smoke_comm_bytes(group_size, n);
  return MakeState(kOp, attrs, layout,
                   std::vector<int64_t>(mesh_slots.begin(), mesh_slots.end()));
}

ffi::Error PeerSmokeImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                         ffi::Buffer<ffi::S32> tag, ffi::ResultBuffer<ffi::U32> received,
                         ffi::ResultBuffer<ffi::U32> epochs) {
  constexpr const char* kOp = kPeerSmokeTarget;
  if (ffi::Error error = CountCall(peer_smoke_counters, stream, kOp); !error.success()) {
    return error;
  }
  const int64_t R = state->attrs.num_ranks, n = state->attrs.num_tokens;
  if (tag.element_count() != 1 || !IsShape(received->dimensions(), {R, n}) ||
      !IsShape(epochs->dimensions(), {R})) {
    return Invalid(kOp, "tag, received, epochs must be [], [R, n], [R] with R=" +
                            std::to_string(R) + ", n=" + std::to_string(n) + "; got received " +
                            DimsToString(received->dimensions()));
  }
  PeerGroup group{};
  if (ffi::Error error = ResolveGroup(device_ordinal, *state, kOp, &group); !error.success()) {
    return error;
  }
  if (ffi::Error error = CheckBuffer(kOp, *state); !error.success()) return error;
  const Runtime& runtime = *state->runtime;
  const cudaError_t status =
      launch_peer_smoke(runtime.State(device_ordinal), group, tag.typed_data(), n,
                        received->typed_data(), epochs->typed_data(), stream);
  if (status != cudaSuccess) return CudaError(status, "peer_smoke kernel launch");
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// jax_ep_remote_smoke (process model 2: NVSHMEM device puts + signals)
// ---------------------------------------------------------------------------------------------

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

ffi::ErrorOr<std::unique_ptr<OpState>> RemoteSmokeInstantiate(ffi::Span<const int64_t> mesh_slots,
                                                              int64_t group_size, int64_t n) {
  constexpr const char* kOp = kRemoteSmokeTarget;
  const int64_t total = static_cast<int64_t>(mesh_slots.size());
  if (group_size < 1 || group_size > kMaxGroupRanks || total % group_size != 0 || n < 0) {
    return ffi::Unexpected(Invalid(kOp, "group_size=" + std::to_string(group_size) +
                                            " must be in [1, " + std::to_string(kMaxGroupRanks) +
                                            "] and divide the " + std::to_string(total) +
                                            " mesh slots; n=" + std::to_string(n)));
  }
  if (ffi::Error error = RequireProcessPerGpu(kOp, Runtime::Get()); !error.success()) {
    return ffi::Unexpected(error);
  }
  EPAttrs attrs{};
  attrs.num_ranks = group_size;
  attrs.num_tokens = n;
  CommLayout layout{};
  layout.total = remote_smoke_comm_bytes(group_size, n);
  return MakeState(kOp, attrs, layout,
                   std::vector<int64_t>(mesh_slots.begin(), mesh_slots.end()));
}

ffi::Error RemoteSmokeImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                           ffi::Buffer<ffi::S32> tag, ffi::ResultBuffer<ffi::U32> received) {
  constexpr const char* kOp = kRemoteSmokeTarget;
  if (ffi::Error error = CountCall(remote_smoke_counters, stream, kOp); !error.success()) {
    return error;
  }
  const Runtime& runtime = *state->runtime;
  if (ffi::Error error = RequireProcessPerGpu(kOp, runtime); !error.success()) return error;
  const int64_t R = state->attrs.num_ranks, n = state->attrs.num_tokens;
  if (tag.element_count() != 1 || !IsShape(received->dimensions(), {R, n})) {
    return Invalid(kOp, "tag, received must be [], [R, n] with R=" + std::to_string(R) + ", n=" +
                            std::to_string(n) + "; got received " +
                            DimsToString(received->dimensions()));
  }
  PeerGroup group{};
  if (ffi::Error error = ResolveGroup(device_ordinal, *state, kOp, &group); !error.success()) {
    return error;
  }
  if (ffi::Error error = CheckBuffer(kOp, *state); !error.success()) return error;
  const cudaError_t status = launch_remote_smoke(runtime.State(device_ordinal), group,
                                                 tag.typed_data(), n, received->typed_data(),
                                                 stream);
  if (status != cudaSuccess) return CudaError(status, "remote_smoke kernel launch");
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// EP data ops: jax_ep_dispatch, jax_ep_combine, jax_ep_broadcast, jax_ep_combine_bwd,
// jax_ep_slot_values
// ---------------------------------------------------------------------------------------------
// Common to all four: the rank and the EP group arrive as int32 device scalars (lax.axis_index;
// never read on the host): the kernels discover the group's devices themselves.

bool RowKindOf(ffi::DataType dtype, int32_t* kind) {
  switch (dtype) {
    case ffi::DataType::BF16:
      *kind = kRowBF16;
      return true;
    case ffi::DataType::F32:
      *kind = kRowF32;
      return true;
    case ffi::DataType::F8E4M3FN:
      *kind = kRowFP8;
      return true;
    default:
      return false;
  }
}

int64_t RowKindBytes(int32_t kind) { return kind == kRowF32 ? 4 : kind == kRowBF16 ? 2 : 1; }

// The rows staged through the buffer must be what the layout was sized for.
ffi::Error CheckRowBytes(const char* op, const EPAttrs& a, int32_t kind) {
  if (a.row_bytes != a.hidden * RowKindBytes(kind)) {
    return Invalid(op, "row_bytes=" + std::to_string(a.row_bytes) + " does not match hidden=" +
                           std::to_string(a.hidden) + " rows of " +
                           std::to_string(RowKindBytes(kind)) + "-byte elements");
  }
  return ffi::Error::Success();
}

// The start of combine / broadcast and their rank-major forms: the call counted (CountCall), then
// their rows (`name`: y or g): bfloat16 or float32, the output of the same dtype, and rows of the
// size the layout was made for.
ffi::Error BeginRowsOp(const char* op, CallCounters& counters, cudaStream_t stream,
                       const EPAttrs& a, const char* name, ffi::AnyBuffer data,
                       ffi::DataType out_type, int32_t* kind) {
  if (ffi::Error error = CountCall(counters, stream, op); !error.success()) return error;
  if (!RowKindOf(data.element_type(), kind) || *kind == kRowFP8 ||
      out_type != data.element_type()) {
    return Invalid(op, std::string(name) + " must be bfloat16 or float32, and the output of the "
                                           "same dtype");
  }
  return CheckRowBytes(op, a, *kind);
}

// The rank mask operand of the throughput ops, expert- and rank-major (int32 [R], nonzero =
// active; traced, so a new mask reuses the executable): the kernels read it on the device.
ffi::Error RankMaskOf(const char* op, const OpState& state, ffi::Buffer<ffi::S32> rank_mask,
                      const int32_t** out) {
  if (!IsShape(rank_mask.dimensions(), {state.attrs.num_ranks})) {
    return Invalid(op, "rank_mask " + DimsToString(rank_mask.dimensions()) + " must be [R], R=" +
                           std::to_string(state.attrs.num_ranks));
  }
  *out = rank_mask.typed_data();
  return ffi::Error::Success();
}

// PrepareGroup, and the rank mask operand into the launch (combine, broadcast, slot_values).
ffi::Error PrepareMaskedGroup(const char* op, int32_t device_ordinal, const OpState& state,
                              ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                              ffi::Buffer<ffi::S32> group, GroupLaunch* launch) {
  if (ffi::Error error = PrepareGroup(op, device_ordinal, state, rank, group, launch);
      !error.success()) {
    return error;
  }
  return RankMaskOf(op, state, rank_mask, &launch->rank_mask);
}

// What dispatch and dispatch_rank_major share: x / rows dtypes, the attributes, the input shapes,
// and the launch fields they both fill. `rows_count` is C (expert-major) or R * T (rank-major).
ffi::Error PrepareDispatch(const char* op, int32_t device_ordinal, const OpState& state,
                           ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                           ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> rank,
                           ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer>& rows,
                           ffi::ResultBuffer<ffi::F32>& scales, int64_t rows_count,
                           ffi::ResultBuffer<ffi::PRED>& is_token_in_rank, DispatchLaunch* launch) {
  const EPAttrs& a = state.attrs;
  const int64_t T = a.num_tokens, H = a.hidden, K = a.num_topk, R = a.num_ranks, E = a.num_experts;
  int32_t x_kind, row_kind;
  if (!RowKindOf(x.element_type(), &x_kind) || x_kind == kRowFP8 ||
      !RowKindOf(rows->element_type(), &row_kind) ||
      !(row_kind == x_kind || row_kind == kRowFP8 || (x_kind == kRowF32 && row_kind == kRowBF16))) {
    return Invalid(op, "x must be bfloat16 or float32, rows x's dtype, bfloat16 or float8_e4m3fn");
  }
  const bool fp8 = row_kind == kRowFP8;
  const int64_t num_scales = fp8 ? H / kFp8Block : 0;
  if (ffi::Error error = CheckRowBytes(op, a, row_kind); !error.success()) return error;
  if (E < R || E % R != 0 || (fp8 && H % kFp8Block != 0) || a.scale_bytes != num_scales * 4) {
    return Invalid(op, "attributes E=" + std::to_string(E) + " R=" + std::to_string(R) +
                           " scale_bytes=" + std::to_string(a.scale_bytes) + " inconsistent");
  }
  if (!IsShape(x.dimensions(), {T, H}) || !IsShape(topk_idx.dimensions(), {T, K}) ||
      !IsShape(topk_weights.dimensions(), {T, K}) || !IsShape(rows->dimensions(), {rows_count, H}) ||
      (fp8 ? !IsShape(scales->dimensions(), {rows_count, num_scales})
           : scales->element_count() != 0) ||
      !IsShape(is_token_in_rank->dimensions(), {T, R})) {
    return Invalid(op, "x " + DimsToString(x.dimensions()) + ", topk_idx " +
                           DimsToString(topk_idx.dimensions()) + ", rows " +
                           DimsToString(rows->dimensions()) + " do not match T=" +
                           std::to_string(T) + ", H=" + std::to_string(H) + ", K=" +
                           std::to_string(K) + ", R=" + std::to_string(R) + ", rows " +
                           std::to_string(rows_count));
  }
  GroupLaunch group_launch{};
  if (ffi::Error error = PrepareGroup(op, device_ordinal, state, rank, group, &group_launch);
      !error.success()) {
    return error;
  }
  launch->state = group_launch.state;
  launch->layout = state.layout;
  launch->x = x.untyped_data();
  launch->topk_idx = topk_idx.typed_data();
  launch->topk_weights = topk_weights.typed_data();
  launch->rank = rank.typed_data();
  launch->group = group.typed_data();
  launch->rows = rows->untyped_data();
  launch->scales = fp8 ? scales->typed_data() : nullptr;
  launch->is_token_in_rank = is_token_in_rank->typed_data();
  launch->num_tokens = static_cast<int32_t>(T);
  launch->num_topk = static_cast<int32_t>(K);
  launch->num_experts = static_cast<int32_t>(E);
  launch->num_ranks = static_cast<int32_t>(R);
  launch->hidden = static_cast<int32_t>(H);
  launch->capacity = static_cast<int32_t>(rows_count);
  launch->x_kind = x_kind;
  launch->row_kind = row_kind;
  launch->num_blocks = group_launch.num_blocks;
  launch->send_warps = group_launch.send_warps;
  launch->axis_slot = group_launch.axis_slot;
  launch->use_tma = a.bulk_copy != 0;
  launch->shrink = group_launch.shrink;
  return ffi::Error::Success();
}

ffi::Error DispatchImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                        ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                        ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> rank_mask,
                        ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                        ffi::Result<ffi::AnyBuffer> rows, ffi::ResultBuffer<ffi::F32> scales,
                        ffi::ResultBuffer<ffi::S32> group_sizes,
                        ffi::ResultBuffer<ffi::S32> expert_counts,
                        ffi::ResultBuffer<ffi::S32> num_dropped,
                        ffi::ResultBuffer<ffi::S32> src_index,
                        ffi::ResultBuffer<ffi::S32> token_rows,
                        ffi::ResultBuffer<ffi::PRED> is_token_in_rank,
                        ffi::ResultBuffer<ffi::F32> row_weights,
                        ffi::ResultBuffer<ffi::S32> active) {
  constexpr const char* kOp = kDispatchTarget;
  if (ffi::Error error = CountCall(dispatch_counters, stream, kOp); !error.success()) return error;
  const EPAttrs& a = state->attrs;
  const int64_t T = a.num_tokens, K = a.num_topk, R = a.num_ranks, C = a.capacity;
  if (a.alignment < 1 || C < 1 || C % a.alignment != 0) {
    return Invalid(kOp, "attributes C=" + std::to_string(C) + " alignment=" +
                            std::to_string(a.alignment) + " inconsistent");
  }
  DispatchLaunch launch{};
  if (ffi::Error error = PrepareDispatch(kOp, device_ordinal, *state, x, topk_idx, topk_weights,
                                         rank, group, rows, scales, C, is_token_in_rank, &launch);
      !error.success()) {
    return error;
  }
  const int64_t local = a.num_experts / R;
  if (!IsShape(group_sizes->dimensions(), {local}) ||
      !IsShape(expert_counts->dimensions(), {local}) || num_dropped->element_count() != 1 ||
      !IsShape(src_index->dimensions(), {C}) || !IsShape(token_rows->dimensions(), {R * T, K}) ||
      !IsShape(row_weights->dimensions(), {C}) || !IsShape(active->dimensions(), {R})) {
    return Invalid(kOp, "handle / count / rank_mask shapes do not match T=" + std::to_string(T) + ", K=" +
                            std::to_string(K) + ", R=" + std::to_string(R) + ", E=" +
                            std::to_string(a.num_experts) + ", C=" + std::to_string(C));
  }
  launch.group_sizes = group_sizes->typed_data();
  launch.expert_counts = expert_counts->typed_data();
  launch.row_weights = row_weights->typed_data();
  launch.num_dropped = num_dropped->typed_data();
  launch.active = active->typed_data();
  if (ffi::Error error = RankMaskOf(kOp, *state, rank_mask, &launch.rank_mask); !error.success()) {
    return error;
  }
  launch.src_index = src_index->typed_data();
  launch.token_rows = token_rows->typed_data();
  launch.alignment = static_cast<int32_t>(a.alignment);
  const cudaError_t status = launch_dispatch(launch, stream);
  if (status != cudaSuccess) return CudaError(status, "dispatch kernel launch");
  return ffi::Error::Success();
}

// dispatch_rank_major: the dispatch kernels in their rank-major mode (cuda/dispatch.h), R * T rows.
ffi::Error DispatchRankMajorImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                                 ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                                 ffi::Buffer<ffi::F32> topk_weights,
                                 ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                                 ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer> rows,
                                 ffi::ResultBuffer<ffi::F32> scales,
                                 ffi::ResultBuffer<ffi::S32> row_ids,
                                 ffi::ResultBuffer<ffi::F32> row_topk_weights,
                                 ffi::ResultBuffer<ffi::S32> tokens_per_rank,
                                 ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                                 ffi::ResultBuffer<ffi::S32> src_index,
                                 ffi::ResultBuffer<ffi::PRED> is_token_in_rank) {
  constexpr const char* kOp = kDispatchRankMajorTarget;
  if (ffi::Error error = CountCall(dispatch_rank_major_counters, stream, kOp); !error.success()) {
    return error;
  }
  const EPAttrs& a = state->attrs;
  const int64_t T = a.num_tokens, K = a.num_topk, R = a.num_ranks, N = R * T;
  if (a.capacity != N) {
    return Invalid(kOp, "capacity=" + std::to_string(a.capacity) + " must be R * T = " +
                            std::to_string(N));
  }
  DispatchLaunch launch{};
  if (ffi::Error error = PrepareDispatch(kOp, device_ordinal, *state, x, topk_idx, topk_weights,
                                         rank, group, rows, scales, N, is_token_in_rank, &launch);
      !error.success()) {
    return error;
  }
  const int64_t local = a.num_experts / R;
  if (!IsShape(row_ids->dimensions(), {N, K}) || !IsShape(row_topk_weights->dimensions(), {N, K}) ||
      !IsShape(tokens_per_rank->dimensions(), {R}) ||
      !IsShape(tokens_per_expert->dimensions(), {local}) || !IsShape(src_index->dimensions(), {N})) {
    return Invalid(kOp, "topk_idx / topk_weights / count / src_index shapes do not match T=" +
                            std::to_string(T) + ", K=" + std::to_string(K) + ", R=" +
                            std::to_string(R) + ", E=" + std::to_string(a.num_experts));
  }
  launch.row_ids = row_ids->typed_data();
  launch.row_topk_weights = row_topk_weights->typed_data();
  launch.tokens_per_rank = tokens_per_rank->typed_data();
  launch.expert_counts = tokens_per_expert->typed_data();
  launch.src_index = src_index->typed_data();
  launch.alignment = 1;
  launch.rank_major = true;
  if (ffi::Error error = RankMaskOf(kOp, *state, rank_mask, &launch.rank_mask); !error.success()) {
    return error;
  }
  if (a.transport == kTransportPut) {
    PutLaunch p = PutLaunchOf(*state, launch.state, launch.rank, launch.group, launch.num_blocks,
                              launch.row_kind);
    p.x_kind = launch.x_kind;
    const cudaError_t status = launch_put_dispatch_rank_major(
        p, launch.x, launch.topk_idx, launch.topk_weights, launch.rows, launch.scales,
        launch.row_ids, launch.row_topk_weights, launch.tokens_per_rank, launch.expert_counts,
        launch.src_index, launch.is_token_in_rank, stream);
    if (status != cudaSuccess) return CudaError(status, "dispatch_rank_major (put) kernel launch");
    return ffi::Error::Success();
  }
  const cudaError_t status = launch_dispatch(launch, stream);
  if (status != cudaSuccess) return CudaError(status, "dispatch_rank_major kernel launch");
  return ffi::Error::Success();
}

ffi::Error CombineImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                       ffi::AnyBuffer y, ffi::Buffer<ffi::F32> row_weights,
                       ffi::Buffer<ffi::S32> token_rows, ffi::Buffer<ffi::PRED> is_token_in_rank,
                       ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                       ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kOp = kCombineTarget;
  const EPAttrs& a = state->attrs;
  const int64_t T = a.num_tokens, H = a.hidden, K = a.num_topk, R = a.num_ranks;
  int32_t y_kind;
  if (ffi::Error error = BeginRowsOp(kOp, combine_counters, stream, a, "y", y,
                                     out->element_type(), &y_kind);
      !error.success()) {
    return error;
  }
  const auto y_dims = y.dimensions();
  const int64_t C = y_dims.size() == 2 ? y_dims[0] : -1;
  if (!IsShape(y_dims, {C, H}) || !IsShape(row_weights.dimensions(), {C}) ||
      !IsShape(token_rows.dimensions(), {R * T, K}) ||
      !IsShape(is_token_in_rank.dimensions(), {T, R}) || !IsShape(out->dimensions(), {T, H})) {
    return Invalid(kOp, "y " + DimsToString(y_dims) + ", token_rows " +
                            DimsToString(token_rows.dimensions()) + ", out " +
                            DimsToString(out->dimensions()) + " do not match T=" +
                            std::to_string(T) + ", H=" + std::to_string(H) + ", K=" +
                            std::to_string(K) + ", R=" + std::to_string(R));
  }
  GroupLaunch launch{};
  if (ffi::Error error =
          PrepareMaskedGroup(kOp, device_ordinal, *state, rank_mask, rank, group, &launch);
      !error.success()) {
    return error;
  }
  const cudaError_t status = launch_combine(
      launch, y.untyped_data(), row_weights.typed_data(), token_rows.typed_data(),
      is_token_in_rank.typed_data(), static_cast<int32_t>(H), y_kind, /*rank_major=*/false,
      out->untyped_data(), stream);
  if (status != cudaSuccess) return CudaError(status, "combine kernel launch");
  return ffi::Error::Success();
}

// What broadcast and combine_bwd share: the call count, g's dtype (the rows' kind), the
// attributes, the handle's shapes, and the group launch with the rank mask. `out` is broadcast's
// rows / combine_bwd's d y.
ffi::Error PrepareBroadcast(const char* op, CallCounters& counters, cudaStream_t stream,
                            int32_t device_ordinal, const OpState& state, ffi::AnyBuffer g,
                            ffi::Buffer<ffi::S32> token_rows,
                            ffi::Buffer<ffi::PRED> is_token_in_rank,
                            ffi::Buffer<ffi::S32> src_index, ffi::Buffer<ffi::S32> rank_mask,
                            ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                            ffi::Result<ffi::AnyBuffer>& out, GroupLaunch* launch,
                            int32_t* g_kind) {
  const EPAttrs& a = state.attrs;
  const int64_t T = a.num_tokens, H = a.hidden, K = a.num_topk, R = a.num_ranks, C = a.capacity;
  if (ffi::Error error = BeginRowsOp(op, counters, stream, a, "g", g, out->element_type(), g_kind);
      !error.success()) {
    return error;
  }
  if (C < 1 || !IsShape(g.dimensions(), {T, H}) || !IsShape(token_rows.dimensions(), {R * T, K}) ||
      !IsShape(is_token_in_rank.dimensions(), {T, R}) || !IsShape(src_index.dimensions(), {C}) ||
      !IsShape(out->dimensions(), {C, H})) {
    return Invalid(op, "g " + DimsToString(g.dimensions()) + ", out " +
                           DimsToString(out->dimensions()) + " do not match T=" +
                           std::to_string(T) + ", H=" + std::to_string(H) + ", K=" +
                           std::to_string(K) + ", R=" + std::to_string(R) + ", C=" +
                           std::to_string(C));
  }
  return PrepareMaskedGroup(op, device_ordinal, state, rank_mask, rank, group, launch);
}

ffi::Error BroadcastImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                         ffi::AnyBuffer g, ffi::Buffer<ffi::S32> token_rows,
                         ffi::Buffer<ffi::PRED> is_token_in_rank, ffi::Buffer<ffi::S32> src_index,
                         ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                         ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kOp = kBroadcastTarget;
  const EPAttrs& a = state->attrs;
  GroupLaunch launch{};
  int32_t g_kind;
  if (ffi::Error error = PrepareBroadcast(kOp, broadcast_counters, stream, device_ordinal, *state, g,
                                          token_rows, is_token_in_rank, src_index, rank_mask, rank,
                                          group, out, &launch, &g_kind);
      !error.success()) {
    return error;
  }
  const cudaError_t status = launch_broadcast(
      launch, g.untyped_data(), token_rows.typed_data(), is_token_in_rank.typed_data(),
      src_index.typed_data(), static_cast<int32_t>(a.capacity), static_cast<int32_t>(a.hidden),
      g_kind, a.bulk_copy != 0, /*rank_major=*/false, out->untyped_data(), stream);
  if (status != cudaSuccess) return CudaError(status, "broadcast kernel launch");
  return ffi::Error::Success();
}

// combine_bwd: the broadcast of g fused with the rest of combine's backward (cuda/broadcast.h).
ffi::Error CombineBwdImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                          ffi::AnyBuffer g, ffi::AnyBuffer y, ffi::Buffer<ffi::F32> row_weights,
                          ffi::Buffer<ffi::S32> token_rows, ffi::Buffer<ffi::PRED> is_token_in_rank,
                          ffi::Buffer<ffi::S32> src_index, ffi::Buffer<ffi::S32> rank_mask,
                          ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                          ffi::Result<ffi::AnyBuffer> dy,
                          ffi::ResultBuffer<ffi::F32> d_row_weights) {
  constexpr const char* kOp = kCombineBwdTarget;
  const EPAttrs& a = state->attrs;
  const int64_t C = a.capacity;
  GroupLaunch launch{};
  int32_t kind;
  if (ffi::Error error = PrepareBroadcast(kOp, combine_bwd_counters, stream, device_ordinal, *state,
                                          g, token_rows, is_token_in_rank, src_index, rank_mask, rank,
                                          group, dy, &launch, &kind);
      !error.success()) {
    return error;
  }
  if (y.element_type() != g.element_type() || !IsShape(y.dimensions(), {C, a.hidden}) ||
      !IsShape(row_weights.dimensions(), {C}) || !IsShape(d_row_weights->dimensions(), {C})) {
    return Invalid(kOp, "y " + DimsToString(y.dimensions()) + " must be [C, H] of g's dtype and "
                            "row_weights, d_row_weights [C], C=" + std::to_string(C) + ", H=" +
                            std::to_string(a.hidden));
  }
  const cudaError_t status = launch_combine_bwd(
      launch, g.untyped_data(), y.untyped_data(), row_weights.typed_data(),
      token_rows.typed_data(), is_token_in_rank.typed_data(), src_index.typed_data(),
      static_cast<int32_t>(C), static_cast<int32_t>(a.hidden), kind, a.bulk_copy != 0,
      dy->untyped_data(), d_row_weights->typed_data(), stream);
  if (status != cudaSuccess) return CudaError(status, "combine_bwd kernel launch");
  return ffi::Error::Success();
}

// combine_rank_major / broadcast_rank_major: the handle (src_index [R * T], is_token_in_rank
// [T, R]) and the op's second result, the [R * T] scratch for its slot -> row table; K = 1.
ffi::Error CheckRankMajorHandle(const char* op, const OpState& state,
                                ffi::Buffer<ffi::S32> src_index,
                                ffi::Buffer<ffi::PRED> is_token_in_rank,
                                ffi::ResultBuffer<ffi::S32>& slot_rows) {
  const EPAttrs& a = state.attrs;
  const int64_t T = a.num_tokens, R = a.num_ranks;
  if (a.num_topk != 1 || !IsShape(src_index.dimensions(), {R * T}) ||
      !IsShape(slot_rows->dimensions(), {R * T}) ||
      !IsShape(is_token_in_rank.dimensions(), {T, R})) {
    return Invalid(op, "src_index " + DimsToString(src_index.dimensions()) + ", is_token_in_rank " +
                           DimsToString(is_token_in_rank.dimensions()) + " do not match T=" +
                           std::to_string(T) + ", R=" + std::to_string(R) + " (num_topk=" +
                           std::to_string(a.num_topk) + ", must be 1)");
  }
  return ffi::Error::Success();
}

// The NVLink path: the handle's slot -> row table first (into the scratch), then the expert-major
// kernels with K = 1.
ffi::Error RankMajorTable(const char* op, const OpState& state, ffi::Buffer<ffi::S32> src_index,
                          ffi::ResultBuffer<ffi::S32>& slot_rows, const GroupLaunch& launch,
                          cudaStream_t stream) {
  const int64_t T = state.attrs.num_tokens, R = state.attrs.num_ranks;
  const cudaError_t status = launch_rank_major_rows(src_index.typed_data(),
                                                    static_cast<int32_t>(R * T), launch.num_blocks,
                                                    slot_rows->typed_data(), stream);
  if (status != cudaSuccess) return CudaError(status, std::string(op) + " slot table");
  return ffi::Error::Success();
}

// combine_rank_major / broadcast_rank_major with the put transport (cuda/remote_rank_major.h). The
// slot -> row table is not needed: its scratch result is filled with -1 (every output written).
ffi::Error PutRowsOp(const char* op, const OpState& state, const GroupLaunch& launch,
                     const void* data, ffi::Buffer<ffi::S32> src_index,
                     ffi::Buffer<ffi::PRED> is_token_in_rank,
                     void* out, ffi::ResultBuffer<ffi::S32>& slot_rows, int32_t kind,
                     cudaStream_t stream) {
  const int64_t T = state.attrs.num_tokens, R = state.attrs.num_ranks;
  cudaError_t status = cudaMemsetAsync(slot_rows->typed_data(), 0xFF,
                                       static_cast<size_t>(R * T) * sizeof(int32_t), stream);
  if (status != cudaSuccess) return CudaError(status, std::string(op) + " (put) scratch");
  const PutLaunch p =
      PutLaunchOf(state, launch.state, launch.rank, launch.group, launch.num_blocks, kind);
  status = std::string(op) == kCombineRankMajorTarget
               ? launch_put_combine_rank_major(p, data, src_index.typed_data(),
                                               is_token_in_rank.typed_data(), out, stream)
               : launch_put_broadcast_rank_major(p, data, src_index.typed_data(),
                                                 is_token_in_rank.typed_data(), out, stream);
  if (status != cudaSuccess) return CudaError(status, std::string(op) + " (put) kernel launch");
  return ffi::Error::Success();
}

// What combine_rank_major and broadcast_rank_major share once their shapes are checked: the group
// launch, then the put transport, or the slot -> row table, the rank mask and the NVLink kernel
// (kernel(launch, table) launches it; `what` names that launch in an error).
template <class Kernel>
ffi::Error RunRankMajorRows(const char* op, cudaStream_t stream, int32_t device_ordinal,
                            const OpState& state, const void* data, int32_t kind,
                            ffi::Buffer<ffi::S32> src_index,
                            ffi::Buffer<ffi::PRED> is_token_in_rank,
                            ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                            ffi::Buffer<ffi::S32> group, void* out,
                            ffi::ResultBuffer<ffi::S32>& slot_rows, const char* what,
                            Kernel kernel) {
  GroupLaunch launch{};
  if (ffi::Error error = PrepareGroup(op, device_ordinal, state, rank, group, &launch);
      !error.success()) {
    return error;
  }
  if (ffi::Error error = CheckRankMajorHandle(op, state, src_index, is_token_in_rank, slot_rows);
      !error.success()) {
    return error;
  }
  if (state.attrs.transport == kTransportPut) {
    return PutRowsOp(op, state, launch, data, src_index, is_token_in_rank, out, slot_rows, kind,
                     stream);
  }
  if (ffi::Error error = RankMajorTable(op, state, src_index, slot_rows, launch, stream);
      !error.success()) {
    return error;
  }
  if (ffi::Error error = RankMaskOf(op, state, rank_mask, &launch.rank_mask); !error.success()) {
    return error;
  }
  const cudaError_t status = kernel(launch, slot_rows->typed_data());
  if (status != cudaSuccess) return CudaError(status, what);
  return ffi::Error::Success();
}

ffi::Error CombineRankMajorImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                                ffi::AnyBuffer y, ffi::Buffer<ffi::S32> src_index,
                                ffi::Buffer<ffi::PRED> is_token_in_rank,
                                ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                                ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer> out,
                                ffi::ResultBuffer<ffi::S32> slot_rows) {
  constexpr const char* kOp = kCombineRankMajorTarget;
  const EPAttrs& a = state->attrs;
  const int64_t T = a.num_tokens, H = a.hidden, R = a.num_ranks;
  int32_t y_kind;
  if (ffi::Error error = BeginRowsOp(kOp, combine_rank_major_counters, stream, a, "y", y,
                                     out->element_type(), &y_kind);
      !error.success()) {
    return error;
  }
  if (!IsShape(y.dimensions(), {R * T, H}) || !IsShape(out->dimensions(), {T, H})) {
    return Invalid(kOp, "y " + DimsToString(y.dimensions()) + ", out " +
                            DimsToString(out->dimensions()) + " do not match [R * T, H], [T, H] " +
                            "with T=" + std::to_string(T) + ", H=" + std::to_string(H) + ", R=" +
                            std::to_string(R));
  }
  return RunRankMajorRows(
      kOp, stream, device_ordinal, *state, y.untyped_data(), y_kind, src_index, is_token_in_rank,
      rank_mask, rank, group, out->untyped_data(), slot_rows, "combine_rank_major kernel launch",
      [&](const GroupLaunch& launch, const int32_t* table) {
        return launch_combine(launch, y.untyped_data(), /*row_weights=*/nullptr, table,
                              is_token_in_rank.typed_data(), static_cast<int32_t>(H), y_kind,
                              /*rank_major=*/true, out->untyped_data(), stream);
      });
}

ffi::Error BroadcastRankMajorImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                                  ffi::AnyBuffer g, ffi::Buffer<ffi::S32> src_index,
                                  ffi::Buffer<ffi::PRED> is_token_in_rank,
                                  ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                                  ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::ResultBuffer<ffi::S32> slot_rows) {
  constexpr const char* kOp = kBroadcastRankMajorTarget;
  const EPAttrs& a = state->attrs;
  const int64_t T = a.num_tokens, H = a.hidden, R = a.num_ranks;
  int32_t g_kind;
  if (ffi::Error error = BeginRowsOp(kOp, broadcast_rank_major_counters, stream, a, "g", g,
                                     out->element_type(), &g_kind);
      !error.success()) {
    return error;
  }
  if (a.capacity != R * T || !IsShape(g.dimensions(), {T, H}) ||
      !IsShape(out->dimensions(), {R * T, H})) {
    return Invalid(kOp, "g " + DimsToString(g.dimensions()) + ", out " +
                            DimsToString(out->dimensions()) + " do not match [T, H], [R * T, H] " +
                            "with T=" + std::to_string(T) + ", H=" + std::to_string(H) + ", R=" +
                            std::to_string(R) + " (capacity " + std::to_string(a.capacity) + ")");
  }
  return RunRankMajorRows(
      kOp, stream, device_ordinal, *state, g.untyped_data(), g_kind, src_index, is_token_in_rank,
      rank_mask, rank, group, out->untyped_data(), slot_rows, "broadcast_rank_major kernel launch",
      [&](const GroupLaunch& launch, const int32_t* table) {
        return launch_broadcast(launch, g.untyped_data(), table, is_token_in_rank.typed_data(),
                                src_index.typed_data(), static_cast<int32_t>(R * T),
                                static_cast<int32_t>(H), g_kind, a.bulk_copy != 0,
                                /*rank_major=*/true, out->untyped_data(), stream);
      });
}

ffi::Error SlotValuesImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                          ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> token_rows,
                          ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                          ffi::Buffer<ffi::S32> group, ffi::ResultBuffer<ffi::F32> out) {
  constexpr const char* kOp = kSlotValuesTarget;
  if (ffi::Error error = CountCall(slot_values_counters, stream, kOp); !error.success()) {
    return error;
  }
  const EPAttrs& a = state->attrs;
  const int64_t T = a.num_tokens, K = a.num_topk, R = a.num_ranks;
  if (values.dimensions().size() != 1 || !IsShape(token_rows.dimensions(), {R * T, K}) ||
      !IsShape(out->dimensions(), {T, K})) {
    return Invalid(kOp, "values " + DimsToString(values.dimensions()) + ", token_rows " +
                            DimsToString(token_rows.dimensions()) + ", out " +
                            DimsToString(out->dimensions()) + " must be [C], [R * T, K], [T, K]");
  }
  GroupLaunch launch{};
  if (ffi::Error error =
          PrepareMaskedGroup(kOp, device_ordinal, *state, rank_mask, rank, group, &launch);
      !error.success()) {
    return error;
  }
  const cudaError_t status = launch_slot_values(launch, values.typed_data(),
                                                token_rows.typed_data(), out->typed_data(), stream);
  if (status != cudaSuccess) return CudaError(status, "slot_values kernel launch");
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// jax_ep_ll_dispatch / jax_ep_ll_combine (low-latency mode: fixed slots per (expert, source rank)),
// fused or in two phases (_send returns a handle, _recv takes it)
// ---------------------------------------------------------------------------------------------

LLLayout LLLayoutOf(const EPAttrs& a) {
  return make_ll_layout(a.num_ranks, a.num_tokens, a.num_topk, a.num_experts, a.hidden,
                        static_cast<uint64_t>(a.row_bytes), static_cast<uint64_t>(a.scale_bytes));
}

template <const char* kOp, bool kDispatch>
ffi::ErrorOr<std::unique_ptr<OpState>> LLInstantiate(EPAttrs attrs) {
  if (ffi::Error error = CheckAttrs(kOp, attrs); !error.success()) return ffi::Unexpected(error);
  if (attrs.num_experts < attrs.num_ranks || attrs.num_experts % attrs.num_ranks != 0) {
    return ffi::Unexpected(Invalid(kOp, "num_experts=" + std::to_string(attrs.num_experts) +
                                            " must be a positive multiple of R=" +
                                            std::to_string(attrs.num_ranks)));
  }
  const uint64_t shared =
      ll_shared_bytes(kDispatch, attrs.num_ranks, attrs.num_tokens, attrs.num_experts);
  if (attrs.num_tokens > kLLMaxTokens || shared == 0 || shared > kLLMaxSharedBytes) {
    return ffi::Unexpected(Invalid(
        kOp, "T=" + std::to_string(attrs.num_tokens) + " tokens and E=" +
                 std::to_string(attrs.num_experts) + " experts are beyond the low-latency kernels "
                 "(T <= " + std::to_string(kLLMaxTokens) + "; a routing table of E * ceil(T / 32) "
                 "words in " + std::to_string(kLLMaxSharedBytes) + " bytes of shared memory: " +
                 std::to_string(shared) + " needed); use dispatch / combine"));
  }
  return MakeState(kOp, attrs, LLLayoutOf(attrs).base);
}

// The launch fields of both LL ops, from the state and the device.
ffi::Error PrepareLL(const char* op, int32_t device_ordinal, const OpState& state,
                     ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group, int32_t mode,
                     uint32_t* handle, LLCommon* c) {
  GroupLaunch g{};
  if (ffi::Error error = PrepareGroup(op, device_ordinal, state, rank, group, &g);
      !error.success()) {
    return error;
  }
  const EPAttrs& a = state.attrs;
  c->state = g.state;
  c->L = LLLayoutOf(a);
  c->rank = g.rank;
  c->group = g.group;
  c->handle = handle;
  c->mode = mode;
  c->num_ranks = g.num_ranks;
  c->num_tokens = g.num_tokens;
  c->num_topk = g.num_topk;
  c->num_experts = static_cast<int32_t>(a.num_experts);
  c->hidden = static_cast<int32_t>(a.hidden);
  c->axis_slot = g.axis_slot;
  c->num_blocks = g.num_blocks;
  c->shrink = a.shrink != 0 ? 1 : 0;
  return ffi::Error::Success();
}

// rank_mask int32 [R] of a sending LL kernel (nonzero = the rank takes part).
ffi::Error CheckLLRankMask(const char* op, const EPAttrs& a, ffi::Buffer<ffi::S32> rank_mask) {
  if (!IsShape(rank_mask.dimensions(), {a.num_ranks})) {
    return Invalid(op, "rank_mask " + DimsToString(rank_mask.dimensions()) + " must be [R], R=" +
                           std::to_string(a.num_ranks));
  }
  return ffi::Error::Success();
}

// active int32 [R] of ll_dispatch / ll_dispatch_recv: the ranks that took part in the call.
ffi::Error CheckLLActive(const char* op, const EPAttrs& a, ffi::ResultBuffer<ffi::S32>& active) {
  if (!IsShape(active->dimensions(), {a.num_ranks})) {
    return Invalid(op, "the rank_mask output " + DimsToString(active->dimensions()) +
                           " must be [R], R=" + std::to_string(a.num_ranks));
  }
  return ffi::Error::Success();
}

// dest_rank int32 [T, K] of a receiving ll_combine kernel.
ffi::Error CheckLLDestRank(const char* op, const EPAttrs& a, ffi::Buffer<ffi::S32> dest_rank) {
  if (!IsShape(dest_rank.dimensions(), {a.num_tokens, a.num_topk})) {
    return Invalid(op, "dest_rank " + DimsToString(dest_rank.dimensions()) + " must be [T, K], T=" +
                           std::to_string(a.num_tokens) + ", K=" + std::to_string(a.num_topk));
  }
  return ffi::Error::Success();
}

// An ll_dispatch call's [T, K] routing operand or handle slot array (`what` names it).
ffi::Error CheckLLPairs(const char* op, const EPAttrs& a, const char* what,
                        ffi::Span<const int64_t> dims) {
  if (!IsShape(dims, {a.num_tokens, a.num_topk})) {
    return Invalid(op, std::string(what) + " " + DimsToString(dims) + " must be [T, K], T=" +
                           std::to_string(a.num_tokens) + ", K=" + std::to_string(a.num_topk));
  }
  return ffi::Error::Success();
}

// The handle slots every ll_dispatch kernel writes: weights f32 [T, K], dest_rank s32 [T, K],
// num_dropped s32 [].
ffi::Error SetLLHandleSlots(const char* op, const EPAttrs& a, LLDispatchLaunch* launch,
                            ffi::ResultBuffer<ffi::F32>& weights,
                            ffi::ResultBuffer<ffi::S32>& dest_rank,
                            ffi::ResultBuffer<ffi::S32>& num_dropped) {
  if (ffi::Error error = CheckLLPairs(op, a, "the topk_weights output", weights->dimensions());
      !error.success()) {
    return error;
  }
  if (ffi::Error error = CheckLLPairs(op, a, "the dest_rank output", dest_rank->dimensions());
      !error.success()) {
    return error;
  }
  if (num_dropped->element_count() != 1) return Invalid(op, "num_dropped must be a scalar");
  launch->weights = weights->typed_data();
  launch->dest_rank = dest_rank->typed_data();
  launch->num_dropped = num_dropped->typed_data();
  return ffi::Error::Success();
}

// The handle between a _send and its _recv: uint32 [4] (epoch, call; low then high words).
ffi::Error CheckLLHandle(const char* op, ffi::Span<const int64_t> dims) {
  if (!IsShape(dims, {4})) return Invalid(op, "the handle must be uint32[4], got " + DimsToString(dims));
  return ffi::Error::Success();
}

// ll_dispatch's inputs x [T, H] (bf16 / f32), topk_idx [T, K] and topk_weights f32 [T, K]; sets
// their launch fields.
ffi::Error CheckLLDispatchInputs(const char* op, const EPAttrs& a, ffi::AnyBuffer x,
                                 ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                                 LLDispatchLaunch* launch) {
  if (ffi::Error error = CheckLLPairs(op, a, "topk_weights", topk_weights.dimensions());
      !error.success()) {
    return error;
  }
  launch->x = x.untyped_data();
  launch->topk_idx = topk_idx.typed_data();
  launch->topk_weights = topk_weights.typed_data();
  int32_t* x_kind = &launch->x_kind;
  if (!RowKindOf(x.element_type(), x_kind) || *x_kind == kRowFP8) {
    return Invalid(op, "x must be bfloat16 or float32");
  }
  if (!IsShape(x.dimensions(), {a.num_tokens, a.hidden}) ||
      !IsShape(topk_idx.dimensions(), {a.num_tokens, a.num_topk})) {
    return Invalid(op, "x " + DimsToString(x.dimensions()) + ", topk_idx " +
                           DimsToString(topk_idx.dimensions()) + " do not match T=" +
                           std::to_string(a.num_tokens) + ", H=" + std::to_string(a.hidden) +
                           ", K=" + std::to_string(a.num_topk));
  }
  return ffi::Error::Success();
}

// The wire row kind the attributes were sized for (fp8: H bytes + H / 128 scales; bf16: 2H).
ffi::Error LLRowKindOfAttrs(const char* op, const EPAttrs& a, int32_t* row_kind) {
  *row_kind = a.row_bytes == a.hidden ? kRowFP8 : kRowBF16;
  if (ffi::Error error = CheckRowBytes(op, a, *row_kind); !error.success()) return error;
  const bool fp8 = *row_kind == kRowFP8;
  if ((fp8 && a.hidden % kFp8Block != 0) || a.scale_bytes != (fp8 ? a.hidden / kFp8Block * 4 : 0)) {
    return Invalid(op, "scale_bytes=" + std::to_string(a.scale_bytes) + " does not match H=" +
                           std::to_string(a.hidden) + (fp8 ? " (fp8)" : " (bf16)"));
  }
  return ffi::Error::Success();
}

// ll_dispatch's outputs rows [E_local, R * T, H], scales [E_local, R * T, H / 128] (fp8; else
// empty), counts [E_local, R], src_slot [E_local, R * T]; sets the row kind.
ffi::Error CheckLLDispatchOutputs(const char* op, const EPAttrs& a,
                                  ffi::Result<ffi::AnyBuffer>& rows,
                                  ffi::ResultBuffer<ffi::F32>& scales,
                                  ffi::ResultBuffer<ffi::S32>& counts,
                                  ffi::ResultBuffer<ffi::S32>& src_slot, int32_t* row_kind) {
  if (!RowKindOf(rows->element_type(), row_kind) ||
      !(*row_kind == kRowBF16 || *row_kind == kRowFP8)) {
    return Invalid(op, "rows must be bfloat16 or float8_e4m3fn");
  }
  int32_t attr_kind;
  if (ffi::Error error = LLRowKindOfAttrs(op, a, &attr_kind); !error.success()) return error;
  if (attr_kind != *row_kind) return Invalid(op, "rows dtype does not match row_bytes");
  const int64_t T = a.num_tokens, H = a.hidden, R = a.num_ranks, local = a.num_experts / R;
  const bool fp8 = *row_kind == kRowFP8;
  if (!IsShape(rows->dimensions(), {local, R * T, H}) ||
      (fp8 ? !IsShape(scales->dimensions(), {local, R * T, H / kFp8Block})
           : scales->element_count() != 0) ||
      !IsShape(counts->dimensions(), {local, R}) ||
      !IsShape(src_slot->dimensions(), {local, R * T})) {
    return Invalid(op, "output shapes do not match T=" + std::to_string(T) + ", H=" +
                           std::to_string(H) + ", R=" + std::to_string(R) + ", E=" +
                           std::to_string(a.num_experts) + " (rows " +
                           DimsToString(rows->dimensions()) + ")");
  }
  return ffi::Error::Success();
}

void SetLLDispatchOutputs(LLDispatchLaunch* launch, bool fp8, ffi::Result<ffi::AnyBuffer>& rows,
                          ffi::ResultBuffer<ffi::F32>& scales, ffi::ResultBuffer<ffi::S32>& counts,
                          ffi::ResultBuffer<ffi::S32>& src_slot) {
  launch->rows = rows->untyped_data();
  launch->scales = fp8 ? scales->typed_data() : nullptr;
  launch->counts = counts->typed_data();
  launch->src_slot = src_slot->typed_data();
}

// Which part of a low-latency op a handler runs: fused, or a phase with the handle between the
// _send and its _recv (the send writes it, the receive reads it).
struct LLPhase {
  int32_t mode;
  uint32_t* handle;                       // nullptr when fused
  ffi::Span<const int64_t> handle_dims;  // checked for a phase
};
LLPhase FusedPhase() { return {kLLFused, nullptr, {}}; }
LLPhase SendPhase(ffi::ResultBuffer<ffi::U32>& handle) {
  return {kLLSend, handle->typed_data(), handle->dimensions()};
}
LLPhase RecvPhase(ffi::Buffer<ffi::U32>& handle) {
  return {kLLRecv, const_cast<uint32_t*>(handle.typed_data()), handle.dimensions()};
}

cudaError_t LaunchLLKernel(const LLDispatchLaunch& launch, cudaStream_t stream) {
  return launch_ll_dispatch(launch, stream);
}
cudaError_t LaunchLLKernel(const LLCombineLaunch& launch, cudaStream_t stream) {
  return launch_ll_combine(launch, stream);
}

// The steps every low-latency handler shares, in this order: count the call; the op's own checks
// (`own`: its buffers against the attributes; it also fills its own fields of `launch`); for a
// phase, the handle's shape; the common launch fields (PrepareLL); the launch. `what` names the
// kernel in a launch error ("ll_dispatch_send").
template <typename Launch, typename Own>
ffi::Error RunLL(const char* op, const char* what, CallCounters& counters, cudaStream_t stream,
                 int32_t device_ordinal, const OpState& state, ffi::Buffer<ffi::S32> rank,
                 ffi::Buffer<ffi::S32> group, const LLPhase& phase, Launch& launch, Own own) {
  if (ffi::Error error = CountCall(counters, stream, op); !error.success()) return error;
  if (ffi::Error error = own(state.attrs); !error.success()) return error;
  if (phase.mode != kLLFused) {
    if (ffi::Error error = CheckLLHandle(op, phase.handle_dims); !error.success()) return error;
  }
  if (ffi::Error error = PrepareLL(op, device_ordinal, state, rank, group, phase.mode,
                                   phase.handle, &launch.c);
      !error.success()) {
    return error;
  }
  const cudaError_t status = LaunchLLKernel(launch, stream);
  if (status != cudaSuccess) return CudaError(status, std::string(what) + " kernel launch");
  return ffi::Error::Success();
}

ffi::Error LLDispatchImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                          ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                          ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> rank_mask,
                          ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                          ffi::Result<ffi::AnyBuffer> rows, ffi::ResultBuffer<ffi::F32> scales,
                          ffi::ResultBuffer<ffi::S32> counts, ffi::ResultBuffer<ffi::S32> src_slot,
                          ffi::ResultBuffer<ffi::S32> active, ffi::ResultBuffer<ffi::F32> weights,
                          ffi::ResultBuffer<ffi::S32> dest_rank,
                          ffi::ResultBuffer<ffi::S32> num_dropped) {
  constexpr const char* kOp = kLLDispatchTarget;
  LLDispatchLaunch launch{};
  auto own = [&](const EPAttrs& a) -> ffi::Error {
    if (ffi::Error error = CheckLLDispatchInputs(kOp, a, x, topk_idx, topk_weights, &launch);
        !error.success()) {
      return error;
    }
    if (ffi::Error error = SetLLHandleSlots(kOp, a, &launch, weights, dest_rank, num_dropped);
        !error.success()) {
      return error;
    }
    if (ffi::Error error =
            CheckLLDispatchOutputs(kOp, a, rows, scales, counts, src_slot, &launch.row_kind);
        !error.success()) {
      return error;
    }
    if (ffi::Error error = CheckLLRankMask(kOp, a, rank_mask); !error.success()) return error;
    if (ffi::Error error = CheckLLActive(kOp, a, active); !error.success()) return error;
    SetLLDispatchOutputs(&launch, launch.row_kind == kRowFP8, rows, scales, counts, src_slot);
    launch.active = active->typed_data();
    return ffi::Error::Success();
  };
  launch.c.rank_mask = rank_mask.typed_data();
  return RunLL(kOp, "ll_dispatch", ll_dispatch_counters, stream, device_ordinal, *state, rank,
               group, FusedPhase(), launch, own);
}

ffi::Error LLDispatchSendImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                              ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                              ffi::Buffer<ffi::F32> topk_weights,
                              ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                              ffi::Buffer<ffi::S32> group, ffi::ResultBuffer<ffi::U32> handle,
                              ffi::ResultBuffer<ffi::F32> weights,
                              ffi::ResultBuffer<ffi::S32> dest_rank,
                              ffi::ResultBuffer<ffi::S32> num_dropped) {
  constexpr const char* kOp = kLLDispatchSendTarget;
  LLDispatchLaunch launch{};
  auto own = [&](const EPAttrs& a) -> ffi::Error {
    if (ffi::Error error = CheckLLDispatchInputs(kOp, a, x, topk_idx, topk_weights, &launch);
        !error.success()) {
      return error;
    }
    if (ffi::Error error = SetLLHandleSlots(kOp, a, &launch, weights, dest_rank, num_dropped);
        !error.success()) {
      return error;
    }
    if (ffi::Error error = LLRowKindOfAttrs(kOp, a, &launch.row_kind); !error.success()) {
      return error;
    }
    if (ffi::Error error = CheckLLRankMask(kOp, a, rank_mask); !error.success()) return error;
    return ffi::Error::Success();
  };
  launch.c.rank_mask = rank_mask.typed_data();
  return RunLL(kOp, "ll_dispatch_send", ll_dispatch_send_counters, stream, device_ordinal, *state,
               rank, group, SendPhase(handle), launch, own);
}

ffi::Error LLDispatchRecvImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                              ffi::Buffer<ffi::U32> handle, ffi::Buffer<ffi::F32> sent_weights,
                              ffi::Buffer<ffi::S32> sent_dest, ffi::Buffer<ffi::S32> sent_dropped,
                              ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                              ffi::Result<ffi::AnyBuffer> rows,
                              ffi::ResultBuffer<ffi::F32> scales,
                              ffi::ResultBuffer<ffi::S32> counts,
                              ffi::ResultBuffer<ffi::S32> src_slot,
                              ffi::ResultBuffer<ffi::S32> active,
                              ffi::ResultBuffer<ffi::F32> weights,
                              ffi::ResultBuffer<ffi::S32> dest_rank,
                              ffi::ResultBuffer<ffi::S32> num_dropped) {
  constexpr const char* kOp = kLLDispatchRecvTarget;
  LLDispatchLaunch launch{};
  launch.x_kind = kRowBF16;  // x is the send's
  auto own = [&](const EPAttrs& a) -> ffi::Error {
    if (ffi::Error error = CheckLLPairs(kOp, a, "the send's topk_weights", sent_weights.dimensions());
        !error.success()) {
      return error;
    }
    if (ffi::Error error = CheckLLPairs(kOp, a, "the send's dest_rank", sent_dest.dimensions());
        !error.success()) {
      return error;
    }
    if (sent_dropped.element_count() != 1) return Invalid(kOp, "the send's num_dropped must be a scalar");
    launch.sent_weights = sent_weights.typed_data();
    launch.sent_dest = sent_dest.typed_data();
    launch.sent_dropped = sent_dropped.typed_data();
    if (ffi::Error error = SetLLHandleSlots(kOp, a, &launch, weights, dest_rank, num_dropped);
        !error.success()) {
      return error;
    }
    if (ffi::Error error =
            CheckLLDispatchOutputs(kOp, a, rows, scales, counts, src_slot, &launch.row_kind);
        !error.success()) {
      return error;
    }
    if (ffi::Error error = CheckLLActive(kOp, a, active); !error.success()) return error;
    SetLLDispatchOutputs(&launch, launch.row_kind == kRowFP8, rows, scales, counts, src_slot);
    launch.active = active->typed_data();
    return ffi::Error::Success();
  };
  return RunLL(kOp, "ll_dispatch_recv", ll_dispatch_recv_counters, stream, device_ordinal, *state,
               rank, group, RecvPhase(handle), launch, own);
}

// ll_combine's y [E_local, R * T, H] bf16 (every phase: the receive reads its own rank's rows).
ffi::Error CheckLLCombineY(const char* op, const EPAttrs& a, ffi::AnyBuffer y) {
  const int64_t T = a.num_tokens, H = a.hidden, R = a.num_ranks, local = a.num_experts / R;
  if (y.element_type() != ffi::DataType::BF16) return Invalid(op, "y must be bfloat16");
  if (ffi::Error error = CheckRowBytes(op, a, kRowBF16); !error.success()) return error;
  if (!IsShape(y.dimensions(), {local, R * T, H})) {
    return Invalid(op, "y " + DimsToString(y.dimensions()) + " does not match [E_local, R*T, H] = [" +
                           std::to_string(local) + ", " + std::to_string(R * T) + ", " +
                           std::to_string(H) + "]");
  }
  return ffi::Error::Success();
}

// ll_combine's y and src_slot [E_local, R * T].
ffi::Error CheckLLCombineSendInputs(const char* op, const EPAttrs& a, ffi::AnyBuffer y,
                                    ffi::Buffer<ffi::S32> src_slot) {
  const int64_t T = a.num_tokens, H = a.hidden, R = a.num_ranks, local = a.num_experts / R;
  if (ffi::Error error = CheckLLCombineY(op, a, y); !error.success()) return error;
  if (!IsShape(src_slot.dimensions(), {local, R * T})) {
    return Invalid(op, "y " + DimsToString(y.dimensions()) + ", src_slot " +
                           DimsToString(src_slot.dimensions()) + " do not match T=" +
                           std::to_string(T) + ", H=" + std::to_string(H) + ", R=" +
                           std::to_string(R) + ", E=" + std::to_string(a.num_experts));
  }
  return ffi::Error::Success();
}

// ll_combine's topk_weights [T, K] (K <= kMaxTopk) and out [T, H] bf16.
ffi::Error CheckLLCombineRecvArgs(const char* op, const EPAttrs& a,
                                  ffi::Buffer<ffi::F32> topk_weights,
                                  ffi::Result<ffi::AnyBuffer>& out) {
  const int64_t T = a.num_tokens, H = a.hidden, K = a.num_topk;
  if (out->element_type() != ffi::DataType::BF16) return Invalid(op, "the output must be bfloat16");
  if (ffi::Error error = CheckRowBytes(op, a, kRowBF16); !error.success()) return error;
  if (K > kMaxTopk || !IsShape(topk_weights.dimensions(), {T, K}) ||
      !IsShape(out->dimensions(), {T, H})) {
    return Invalid(op, "topk_weights " + DimsToString(topk_weights.dimensions()) + ", out " +
                           DimsToString(out->dimensions()) + " do not match T=" +
                           std::to_string(T) + ", H=" + std::to_string(H) + ", K=" +
                           std::to_string(K) + " (<= 32)");
  }
  return ffi::Error::Success();
}

ffi::Error LLCombineImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                         ffi::AnyBuffer y, ffi::Buffer<ffi::S32> src_slot,
                         ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> dest_rank,
                         ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                         ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kOp = kLLCombineTarget;
  LLCombineLaunch launch{};
  auto own = [&](const EPAttrs& a) -> ffi::Error {
    if (ffi::Error error = CheckLLCombineSendInputs(kOp, a, y, src_slot); !error.success()) {
      return error;
    }
    if (ffi::Error error = CheckLLCombineRecvArgs(kOp, a, topk_weights, out); !error.success()) {
      return error;
    }
    if (ffi::Error error = CheckLLDestRank(kOp, a, dest_rank); !error.success()) return error;
    if (ffi::Error error = CheckLLRankMask(kOp, a, rank_mask); !error.success()) return error;
    launch.y = y.untyped_data();
    launch.src_slot = src_slot.typed_data();
    launch.topk_weights = topk_weights.typed_data();
    launch.dest_rank = dest_rank.typed_data();
    launch.out = out->untyped_data();
    return ffi::Error::Success();
  };
  launch.c.rank_mask = rank_mask.typed_data();
  return RunLL(kOp, "ll_combine", ll_combine_counters, stream, device_ordinal, *state, rank,
               group, FusedPhase(), launch, own);
}

ffi::Error LLCombineSendImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                             ffi::AnyBuffer y, ffi::Buffer<ffi::S32> src_slot,
                             ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                             ffi::Buffer<ffi::S32> group, ffi::ResultBuffer<ffi::U32> handle) {
  constexpr const char* kOp = kLLCombineSendTarget;
  LLCombineLaunch launch{};
  auto own = [&](const EPAttrs& a) -> ffi::Error {
    if (ffi::Error error = CheckLLCombineSendInputs(kOp, a, y, src_slot); !error.success()) {
      return error;
    }
    if (ffi::Error error = CheckLLRankMask(kOp, a, rank_mask); !error.success()) return error;
    launch.y = y.untyped_data();
    launch.src_slot = src_slot.typed_data();
    return ffi::Error::Success();
  };
  launch.c.rank_mask = rank_mask.typed_data();
  return RunLL(kOp, "ll_combine_send", ll_combine_send_counters, stream, device_ordinal, *state,
               rank, group, SendPhase(handle), launch, own);
}

ffi::Error LLCombineRecvImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                             ffi::Buffer<ffi::U32> handle, ffi::AnyBuffer y,
                             ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> dest_rank,
                             ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                             ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kOp = kLLCombineRecvTarget;
  LLCombineLaunch launch{};
  auto own = [&](const EPAttrs& a) -> ffi::Error {
    if (ffi::Error error = CheckLLCombineY(kOp, a, y); !error.success()) return error;
    if (ffi::Error error = CheckLLCombineRecvArgs(kOp, a, topk_weights, out); !error.success()) {
      return error;
    }
    if (ffi::Error error = CheckLLDestRank(kOp, a, dest_rank); !error.success()) return error;
    launch.y = y.untyped_data();
    launch.topk_weights = topk_weights.typed_data();
    launch.dest_rank = dest_rank.typed_data();
    launch.out = out->untyped_data();
    return ffi::Error::Success();
  };
  return RunLL(kOp, "ll_combine_recv", ll_combine_recv_counters, stream, device_ordinal, *state,
               rank, group, RecvPhase(handle), launch, own);
}

// Appends .Arg<T>() for each of T, Ts... to the FFI binding `binding`. A Binding can only be
// passed on as a temporary (its copy is deleted, its move private): no named intermediate.
template <typename T, typename... Ts, typename B>
auto WithArgs(B binding) {
  if constexpr (sizeof...(Ts) == 0) {
    return std::move(binding).template Arg<T>();
  } else {
    return WithArgs<Ts...>(std::move(binding).template Arg<T>());
  }
}

// The execute-stage context every communicating op takes first: XLA's stream, the device ordinal
// and the OpState its instantiate stage made.
auto BindPeerOp() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::State<OpState>>();
}

// The execute-stage binding of a data op (dispatch, combine, broadcast, slot_values): the context,
// the op's own inputs, then the rank and group buffers every data op takes last (PrepareGroup).
// The handler definition adds the results with .Ret<>().
template <typename... Inputs>
auto BindDataOp() {
  return WithArgs<Inputs..., ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>>(BindPeerOp());
}

}  // namespace

ffi::TypeId OpState::id = {};

std::vector<HandlerStats> GetHandlerStats() {
  std::vector<HandlerStats> stats;
#define JAX_EP_STATS_ENTRY(Name, name) {k##Name##Target, &name##_counters},
  const std::pair<const char*, CallCounters*> entries[] = {JAX_EP_TARGETS(JAX_EP_STATS_ENTRY)};
#undef JAX_EP_STATS_ENTRY
  for (const auto& [target, counters] : entries) {
    stats.push_back({target, counters->calls.load(std::memory_order_relaxed),
                     counters->captured_calls.load(std::memory_order_relaxed)});
  }
  return stats;
}

}  // namespace jax_ep

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_ep::EPAttrs, xla::ffi::StructMember<int64_t>("alignment"),
    xla::ffi::StructMember<int64_t>("axis_slot"), xla::ffi::StructMember<int64_t>("bulk_copy"),
    xla::ffi::StructMember<int64_t>("capacity"), xla::ffi::StructMember<int64_t>("hidden"),
    xla::ffi::StructMember<int64_t>("num_experts"), xla::ffi::StructMember<int64_t>("num_ranks"),
    xla::ffi::StructMember<int64_t>("num_sms"), xla::ffi::StructMember<int64_t>("num_tokens"),
    xla::ffi::StructMember<int64_t>("num_topk"), xla::ffi::StructMember<int64_t>("row_bytes"),
    xla::ffi::StructMember<int64_t>("scale_bytes"), xla::ffi::StructMember<int64_t>("send_warps"),
    xla::ffi::StructMember<int64_t>("shrink"),
    xla::ffi::StructMember<int64_t>("transport"));

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

#define JAX_EP_DATA_OP_INSTANTIATE(SYMBOL, TARGET)                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYMBOL, jax_ep::DataOpInstantiate<jax_ep::TARGET>,     \
                                ffi::Ffi::BindInstantiate().Attrs<jax_ep::EPAttrs>())
JAX_EP_DATA_OP_INSTANTIATE(JaxEpDispatchInstantiate, kDispatchTarget);
JAX_EP_DATA_OP_INSTANTIATE(JaxEpCombineInstantiate, kCombineTarget);
JAX_EP_DATA_OP_INSTANTIATE(JaxEpBroadcastInstantiate, kBroadcastTarget);
JAX_EP_DATA_OP_INSTANTIATE(JaxEpCombineBwdInstantiate, kCombineBwdTarget);
JAX_EP_DATA_OP_INSTANTIATE(JaxEpSlotValuesInstantiate, kSlotValuesTarget);
JAX_EP_DATA_OP_INSTANTIATE(JaxEpDispatchRankMajorInstantiate, kDispatchRankMajorTarget);
JAX_EP_DATA_OP_INSTANTIATE(JaxEpCombineRankMajorInstantiate, kCombineRankMajorTarget);
JAX_EP_DATA_OP_INSTANTIATE(JaxEpBroadcastRankMajorInstantiate, kBroadcastRankMajorTarget);
#undef JAX_EP_DATA_OP_INSTANTIATE

// The data ops' bindings are parenthesised: the commas between their template arguments would
// otherwise split the macro's arguments.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatch, jax_ep::DispatchImpl,
                              (jax_ep::BindDataOp<ffi::AnyBuffer,            // x
                                                  ffi::Buffer<ffi::S32>,     // topk_idx
                                                  ffi::Buffer<ffi::F32>,     // topk_weights
                                                  ffi::Buffer<ffi::S32>>()   // rank_mask
                                   .Ret<ffi::AnyBuffer>()                    // rows
                                   .Ret<ffi::Buffer<ffi::F32>>()             // scales
                                   .Ret<ffi::Buffer<ffi::S32>>()             // group_sizes
                                   .Ret<ffi::Buffer<ffi::S32>>()             // expert_counts
                                   .Ret<ffi::Buffer<ffi::S32>>()             // num_dropped
                                   .Ret<ffi::Buffer<ffi::S32>>()             // src_index
                                   .Ret<ffi::Buffer<ffi::S32>>()             // token_rows
                                   .Ret<ffi::Buffer<ffi::PRED>>()            // is_token_in_rank
                                   .Ret<ffi::Buffer<ffi::F32>>()             // row_weights
                                   .Ret<ffi::Buffer<ffi::S32>>()),           // rank_mask (active)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombine, jax_ep::CombineImpl,
                              (jax_ep::BindDataOp<ffi::AnyBuffer,             // y
                                                  ffi::Buffer<ffi::F32>,      // row_weights
                                                  ffi::Buffer<ffi::S32>,      // token_rows
                                                  ffi::Buffer<ffi::PRED>,     // is_token_in_rank
                                                  ffi::Buffer<ffi::S32>>()    // rank_mask
                                   .Ret<ffi::AnyBuffer>()),                   // out
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpBroadcast, jax_ep::BroadcastImpl,
                              (jax_ep::BindDataOp<ffi::AnyBuffer,             // g
                                                  ffi::Buffer<ffi::S32>,      // token_rows
                                                  ffi::Buffer<ffi::PRED>,     // is_token_in_rank
                                                  ffi::Buffer<ffi::S32>,      // src_index
                                                  ffi::Buffer<ffi::S32>>()    // rank_mask
                                   .Ret<ffi::AnyBuffer>()),                   // out
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombineBwd, jax_ep::CombineBwdImpl,
                              (jax_ep::BindDataOp<ffi::AnyBuffer,             // g
                                                  ffi::AnyBuffer,             // y
                                                  ffi::Buffer<ffi::F32>,      // row_weights
                                                  ffi::Buffer<ffi::S32>,      // token_rows
                                                  ffi::Buffer<ffi::PRED>,     // is_token_in_rank
                                                  ffi::Buffer<ffi::S32>,      // src_index
                                                  ffi::Buffer<ffi::S32>>()    // rank_mask
                                   .Ret<ffi::AnyBuffer>()                     // d y
                                   .Ret<ffi::Buffer<ffi::F32>>()),            // d row_weights
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpSlotValues, jax_ep::SlotValuesImpl,
                              (jax_ep::BindDataOp<ffi::Buffer<ffi::F32>,      // values
                                                  ffi::Buffer<ffi::S32>,      // token_rows
                                                  ffi::Buffer<ffi::S32>>()    // rank_mask
                                   .Ret<ffi::Buffer<ffi::F32>>()),            // out
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatchRankMajor, jax_ep::DispatchRankMajorImpl,
                              (jax_ep::BindDataOp<ffi::AnyBuffer,            // x
                                                  ffi::Buffer<ffi::S32>,     // topk_idx
                                                  ffi::Buffer<ffi::F32>,     // topk_weights
                                                  ffi::Buffer<ffi::S32>>()   // rank_mask
                                   .Ret<ffi::AnyBuffer>()                    // rows
                                   .Ret<ffi::Buffer<ffi::F32>>()             // scales
                                   .Ret<ffi::Buffer<ffi::S32>>()             // topk_idx (local ids)
                                   .Ret<ffi::Buffer<ffi::F32>>()             // topk_weights
                                   .Ret<ffi::Buffer<ffi::S32>>()             // num_tokens_per_rank
                                   .Ret<ffi::Buffer<ffi::S32>>()             // num_tokens_per_expert
                                   .Ret<ffi::Buffer<ffi::S32>>()             // src_index
                                   .Ret<ffi::Buffer<ffi::PRED>>()),          // is_token_in_rank
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombineRankMajor, jax_ep::CombineRankMajorImpl,
                              (jax_ep::BindDataOp<ffi::AnyBuffer,             // y
                                                  ffi::Buffer<ffi::S32>,      // src_index
                                                  ffi::Buffer<ffi::PRED>,     // is_token_in_rank
                                                  ffi::Buffer<ffi::S32>>()    // rank_mask
                                   .Ret<ffi::AnyBuffer>()                     // out
                                   .Ret<ffi::Buffer<ffi::S32>>()),            // slot_rows (scratch)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpBroadcastRankMajor, jax_ep::BroadcastRankMajorImpl,
                              (jax_ep::BindDataOp<ffi::AnyBuffer,             // g
                                                  ffi::Buffer<ffi::S32>,      // src_index
                                                  ffi::Buffer<ffi::PRED>,     // is_token_in_rank
                                                  ffi::Buffer<ffi::S32>>()    // rank_mask
                                   .Ret<ffi::AnyBuffer>()                     // out
                                   .Ret<ffi::Buffer<ffi::S32>>()),            // slot_rows (scratch)
                              {ffi::Traits::kCmdBufferCompatible});

#define JAX_EP_LL_INSTANTIATE(SYMBOL, TARGET, DISPATCH)                                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYMBOL, (jax_ep::LLInstantiate<jax_ep::TARGET, DISPATCH>),  \
                                ffi::Ffi::BindInstantiate().Attrs<jax_ep::EPAttrs>())
JAX_EP_LL_INSTANTIATE(JaxEpLLDispatchInstantiate, kLLDispatchTarget, true);
JAX_EP_LL_INSTANTIATE(JaxEpLLCombineInstantiate, kLLCombineTarget, false);
JAX_EP_LL_INSTANTIATE(JaxEpLLDispatchSendInstantiate, kLLDispatchSendTarget, true);
JAX_EP_LL_INSTANTIATE(JaxEpLLDispatchRecvInstantiate, kLLDispatchRecvTarget, true);
JAX_EP_LL_INSTANTIATE(JaxEpLLCombineSendInstantiate, kLLCombineSendTarget, false);
JAX_EP_LL_INSTANTIATE(JaxEpLLCombineRecvInstantiate, kLLCombineRecvTarget, false);
#undef JAX_EP_LL_INSTANTIATE

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLDispatch, jax_ep::LLDispatchImpl,
                              (jax_ep::BindDataOp<ffi::AnyBuffer,            // x
                                                  ffi::Buffer<ffi::S32>,     // topk_idx
                                                  ffi::Buffer<ffi::F32>,     // topk_weights
                                                  ffi::Buffer<ffi::S32>>()   // rank_mask
                                   .Ret<ffi::AnyBuffer>()                    // rows
                                   .Ret<ffi::Buffer<ffi::F32>>()             // scales
                                   .Ret<ffi::Buffer<ffi::S32>>()             // counts
                                   .Ret<ffi::Buffer<ffi::S32>>()             // src_slot
                                   .Ret<ffi::Buffer<ffi::S32>>()             // rank_mask (active)
                                   .Ret<ffi::Buffer<ffi::F32>>()             // topk_weights (handle)
                                   .Ret<ffi::Buffer<ffi::S32>>()             // dest_rank
                                   .Ret<ffi::Buffer<ffi::S32>>()),           // num_dropped
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLDispatchSend, jax_ep::LLDispatchSendImpl,
                              (jax_ep::BindDataOp<ffi::AnyBuffer,            // x
                                                  ffi::Buffer<ffi::S32>,     // topk_idx
                                                  ffi::Buffer<ffi::F32>,     // topk_weights
                                                  ffi::Buffer<ffi::S32>>()   // rank_mask
                                   .Ret<ffi::Buffer<ffi::U32>>()             // handle
                                   .Ret<ffi::Buffer<ffi::F32>>()             // topk_weights (sent)
                                   .Ret<ffi::Buffer<ffi::S32>>()             // dest_rank (sent)
                                   .Ret<ffi::Buffer<ffi::S32>>()),           // num_dropped (sent)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLDispatchRecv, jax_ep::LLDispatchRecvImpl,
                              (jax_ep::BindDataOp<ffi::Buffer<ffi::U32>,     // handle
                                                  ffi::Buffer<ffi::F32>,     // topk_weights (sent)
                                                  ffi::Buffer<ffi::S32>,     // dest_rank (sent)
                                                  ffi::Buffer<ffi::S32>>()   // num_dropped (sent)
                                   .Ret<ffi::AnyBuffer>()                    // rows
                                   .Ret<ffi::Buffer<ffi::F32>>()             // scales
                                   .Ret<ffi::Buffer<ffi::S32>>()             // counts
                                   .Ret<ffi::Buffer<ffi::S32>>()             // src_slot
                                   .Ret<ffi::Buffer<ffi::S32>>()             // rank_mask (active)
                                   .Ret<ffi::Buffer<ffi::F32>>()             // topk_weights
                                   .Ret<ffi::Buffer<ffi::S32>>()             // dest_rank
                                   .Ret<ffi::Buffer<ffi::S32>>()),           // num_dropped
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLCombine, jax_ep::LLCombineImpl,
                              (jax_ep::BindDataOp<ffi::AnyBuffer,             // y
                                                  ffi::Buffer<ffi::S32>,      // src_slot
                                                  ffi::Buffer<ffi::F32>,      // topk_weights
                                                  ffi::Buffer<ffi::S32>,      // dest_rank
                                                  ffi::Buffer<ffi::S32>>()    // rank_mask
                                   .Ret<ffi::AnyBuffer>()),                   // out
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLCombineSend, jax_ep::LLCombineSendImpl,
                              (jax_ep::BindDataOp<ffi::AnyBuffer,             // y
                                                  ffi::Buffer<ffi::S32>,      // src_slot
                                                  ffi::Buffer<ffi::S32>>()    // rank_mask
                                   .Ret<ffi::Buffer<ffi::U32>>()),            // handle
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLCombineRecv, jax_ep::LLCombineRecvImpl,
                              (jax_ep::BindDataOp<ffi::Buffer<ffi::U32>,      // handle
                                                  ffi::AnyBuffer,             // y
                                                  ffi::Buffer<ffi::F32>,      // topk_weights
                                                  ffi::Buffer<ffi::S32>>()    // dest_rank
                                   .Ret<ffi::AnyBuffer>()),                   // out
                              {ffi::Traits::kCmdBufferCompatible});
