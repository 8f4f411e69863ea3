// What the handler families share (xla_ffi/handler_util.h): call counters and statistics, errors,
// checks and the launch fields of the data ops.
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

#include "cuda/dispatch.h"
#include "cuda/ep_layout.h"
#include "cuda/group.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/device_memory.h"
#include "xla_ffi/handler_util.h"
#include "xla_ffi/handlers.h"
#include "xla_ffi/runtime.h"

namespace jax_ep {

#define JAX_EP_COUNTERS(Name, name) CallCounters name##_counters;
JAX_EP_TARGETS(JAX_EP_COUNTERS)
#undef JAX_EP_COUNTERS

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

ffi::Error CudaError(cudaError_t status, const std::string& op) {
  // after a kernel's trap every later CUDA call fails with the sticky error: name what the records say
  const std::string records = Runtime::Get().FaultMessages();
  return ffi::Error::Internal("jax_ep: " + op + ": " + cudaGetErrorName(status) + " (" +
                              cudaGetErrorString(status) + ")" +
                              (records.empty() ? "" : "; device fault records:" + records));
}

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

bool IsShape(ffi::Span<const int64_t> dims, std::initializer_list<int64_t> want) {
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (dims[i++] != w) return false;
  }
  return true;
}

ffi::Error Invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// Reserves the call site's buffer and builds its state; runtime errors become FFI errors.
ffi::ErrorOr<std::unique_ptr<OpState>> MakeState(const char* op, const EPAttrs& attrs,
                                                 const CommLayout& layout,
                                                 std::vector<int64_t> mesh_slots) {
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
      a.num_tokens < 0 || a.num_ranks * a.num_tokens > kMaxRows || a.axis_slot < 0 ||
      a.axis_slot >= kDirectoryAxes || a.num_sms < 1 || a.send_warps < 1 ||
      a.send_warps >= kBlockWarps || a.num_experts < 0 || a.num_experts > kMaxExperts ||
      a.hidden < 0 || a.hidden % kRowAlignment != 0 || a.hidden > kMaxHidden || a.capacity < 0 ||
      a.capacity > kMaxRows || a.row_bytes < 0 || a.scale_bytes < 0) {
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
// symmetric heap of process model 2; the pull form (kTransportPull) for dispatch and broadcast
// (either layout) only. Python picks them (cuda_backend._transport) and refuses the other cases at
// trace time; this is the check behind it.
ffi::Error CheckTransport(const char* op, const EPAttrs& a, const Runtime& runtime) {
  if (a.transport == kTransportLoadStore) return ffi::Error::Success();
  const std::string name(op);
  if (a.transport == kTransportPull) {  // cuda/dispatch.h, cuda/group.h: not in shrink mode
    if ((name == kDispatchTarget || name == kDispatchRankMajorTarget || name == kBroadcastTarget ||
         name == kBroadcastRankMajorTarget) && a.shrink == 0) {
      return ffi::Error::Success();
    }
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      name + ": transport=2 (KernelConfig.dispatch_pull / broadcast_pull): only "
                      "dispatch, broadcast and their rank-major forms pull their rows, and not in "
                      "shrink mode");
  }
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
  JAX_EP_RETURN_IF_ERROR(CheckBuffer(op, state));
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
  launch->pull = a.transport == kTransportPull;  // (CheckTransport: broadcast's only)
  return ffi::Error::Success();
}

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

namespace {
int64_t RowKindBytes(int32_t kind) { return kind == kRowF32 ? 4 : kind == kRowBF16 ? 2 : 1; }
}  // namespace

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
  JAX_EP_RETURN_IF_ERROR(CountCall(counters, stream, op));
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
  JAX_EP_RETURN_IF_ERROR(CheckRowBytes(op, a, row_kind));
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
  JAX_EP_RETURN_IF_ERROR(PrepareGroup(op, device_ordinal, state, rank, group, &group_launch));
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
  launch->pull = a.transport == kTransportPull;
  launch->shrink = group_launch.shrink;
  return ffi::Error::Success();
}

}  // namespace jax_ep
