// XLA FFI handlers, one per op. All are declared command-buffer compatible and keep it true: at
// execute time they only validate static shapes/attributes on the host, read lock-free runtime
// bookkeeping, and enqueue kernels on XLA's stream (no host sync, no allocation, no stream query,
// no host read of device data).
#include "xla_ffi/handlers.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/combine.h"
#include "cuda/dispatch.h"
#include "cuda/ep_layout.h"
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
CallCounters dispatch_counters;
CallCounters combine_counters;
CallCounters broadcast_counters;
CallCounters slot_values_counters;

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


// ---------------------------------------------------------------------------------------------
// EP data ops: jax_ep_dispatch, jax_ep_combine, jax_ep_broadcast, jax_ep_slot_values
// ---------------------------------------------------------------------------------------------
// Common to all four: the rank and the EP group arrive as int32 device scalars (lax.axis_index;
// never read on the host): the kernels discover the group's devices themselves. Static attributes:
// num_ranks (R), axis_slot (directory slot of the EP axis), and for the data kernels num_sms
// (blocks, clamped to [1, SMs - 1]) and send_warps (warps per block that send/reduce, of 16).

ffi::Error Invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
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

bool IsShape(ffi::Span<const int64_t> dims, std::initializer_list<int64_t> want) {
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (dims[i++] != w) return false;
  }
  return true;
}

// Validates the group attributes and fills the fields of GroupLaunch every op shares.
ffi::Error PrepareGroup(const char* op, int32_t device_ordinal, ffi::Buffer<ffi::S32> rank,
                        ffi::Buffer<ffi::S32> group, int64_t num_ranks, int64_t num_tokens,
                        int64_t num_topk, int64_t axis_slot, int64_t num_sms, int64_t send_warps,
                        const CommLayout& layout, GroupLaunch* launch) {
  if (rank.element_count() != 1 || group.element_count() != 1) {
    return Invalid(op, "rank and group must be int32 scalars");
  }
  if (num_ranks < 1 || num_ranks > kMaxGroupRanks) {
    return Invalid(op, "num_ranks=" + std::to_string(num_ranks) + " must be in [1, " +
                           std::to_string(kMaxGroupRanks) + "]");
  }
  if (num_topk < 1 || num_topk > kMaxTopk) {
    return Invalid(op, "num_topk=" + std::to_string(num_topk) + " must be in [1, " +
                           std::to_string(kMaxTopk) + "]");
  }
  if (num_tokens < 0 || num_ranks * num_tokens >= (int64_t{1} << 31)) {
    return Invalid(op, "R * T = " + std::to_string(num_ranks * num_tokens) +
                           " must fit in int32");
  }
  if (axis_slot < 0 || axis_slot >= kDirectoryAxes) {
    return Invalid(op, "axis_slot=" + std::to_string(axis_slot) + " out of range");
  }
  Runtime& runtime = Runtime::Get();
  DeviceState* state = runtime.State(device_ordinal);
  if (state == nullptr) {
    return ffi::Error::Internal(std::string(op) + ": GPU " + std::to_string(device_ordinal) +
                                " is not managed by the jax_ep runtime; call "
                                "jax_ep.runtime.ensure_initialized() before tracing");
  }
  if (layout.total > runtime.CommBytes()) {
    return Invalid(op, "needs " + std::to_string(layout.total) + " bytes of communication "
                       "buffer, the runtime has " + std::to_string(runtime.CommBytes()) +
                       "; call jax_ep.runtime.ensure_initialized() with a larger buffer_bytes");
  }
  const int sms = runtime.SmCount(device_ordinal);
  if (sms < 2) {
    return ffi::Error::Internal(std::string(op) + ": unknown SM count of GPU " +
                                std::to_string(device_ordinal));
  }
  launch->state = state;
  launch->layout = layout;
  launch->rank = rank.typed_data();
  launch->group = group.typed_data();
  launch->num_ranks = static_cast<int32_t>(num_ranks);
  launch->num_tokens = static_cast<int32_t>(num_tokens);
  launch->num_topk = static_cast<int32_t>(num_topk);
  launch->axis_slot = static_cast<int32_t>(axis_slot);
  launch->num_blocks = static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(num_sms, sms - 1)));
  launch->send_warps = static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(send_warps, 15)));
  return ffi::Error::Success();
}

ffi::Error DispatchImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                        ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                        ffi::Result<ffi::AnyBuffer> rows, ffi::ResultBuffer<ffi::F32> scales,
                        ffi::ResultBuffer<ffi::S32> group_sizes,
                        ffi::ResultBuffer<ffi::S32> expert_counts,
                        ffi::ResultBuffer<ffi::F32> row_weights,
                        ffi::ResultBuffer<ffi::S32> num_dropped,
                        ffi::ResultBuffer<ffi::S32> src_index,
                        ffi::ResultBuffer<ffi::S32> token_rows,
                        ffi::ResultBuffer<ffi::PRED> is_token_in_rank, int64_t num_experts,
                        int64_t num_ranks, int64_t capacity, int64_t alignment, int64_t num_sms,
                        int64_t send_warps, int64_t axis_slot, int64_t tma) {
  constexpr const char* kOp = kDispatchTarget;
  if (ffi::Error error = CountCall(dispatch_counters, stream, kOp); !error.success()) return error;
  const auto x_dims = x.dimensions();
  const auto idx_dims = topk_idx.dimensions();
  if (x_dims.size() != 2 || idx_dims.size() != 2 || idx_dims[0] != x_dims[0] ||
      !IsShape(topk_weights.dimensions(), {idx_dims[0], idx_dims[1]})) {
    return Invalid(kOp, "x " + DimsToString(x_dims) + ", topk_idx " + DimsToString(idx_dims) +
                            ", topk_weights " + DimsToString(topk_weights.dimensions()) +
                            " must be [T, H], [T, K], [T, K]");
  }
  const int64_t T = x_dims[0], H = x_dims[1], K = idx_dims[1];
  const int64_t R = num_ranks, E = num_experts, C = capacity;
  int32_t x_kind, row_kind;
  if (!RowKindOf(x.element_type(), &x_kind) || x_kind == kRowFP8) {
    return Invalid(kOp, "x must be bfloat16 or float32");
  }
  if (!RowKindOf(rows->element_type(), &row_kind) ||
      !(row_kind == x_kind || row_kind == kRowFP8 || (x_kind == kRowF32 && row_kind == kRowBF16))) {
    return Invalid(kOp, "rows must have x's dtype, bfloat16 (from float32) or float8_e4m3fn");
  }
  const bool fp8 = row_kind == kRowFP8;
  if (R < 1 || E < 1 || E % R != 0 || E > kMaxExperts) {
    return Invalid(kOp, "num_experts=" + std::to_string(E) + " must be a multiple of num_ranks=" +
                            std::to_string(R) + " and <= " + std::to_string(kMaxExperts));
  }
  if (H < 8 || H % 8 != 0 || (fp8 && H % 128 != 0)) {
    return Invalid(kOp, "hidden=" + std::to_string(H) + " must be a multiple of 8 (of 128 for "
                            "FP8)");
  }
  if (alignment < 1 || C < 1 || C % alignment != 0 || C >= (int64_t{1} << 31) ||
      H >= (int64_t{1} << 28)) {
    return Invalid(kOp, "capacity=" + std::to_string(C) + " must be a positive multiple of "
                            "expert_alignment=" + std::to_string(alignment));
  }
  const int64_t local = E / R;
  const int64_t num_scales = fp8 ? H / 128 : 0;
  if (!IsShape(rows->dimensions(), {C, H}) ||
      (fp8 ? !IsShape(scales->dimensions(), {C, num_scales}) : scales->element_count() != 0) ||
      !IsShape(group_sizes->dimensions(), {local}) ||
      !IsShape(expert_counts->dimensions(), {local}) ||
      !IsShape(row_weights->dimensions(), {C}) || num_dropped->element_count() != 1 ||
      !IsShape(src_index->dimensions(), {C}) ||
      !IsShape(token_rows->dimensions(), {R * T, K}) ||
      !IsShape(is_token_in_rank->dimensions(), {T, R})) {
    return Invalid(kOp, "output shapes do not match T=" + std::to_string(T) + ", H=" +
                            std::to_string(H) + ", K=" + std::to_string(K) + ", R=" +
                            std::to_string(R) + ", E=" + std::to_string(E) + ", C=" +
                            std::to_string(C));
  }
  const CommLayout layout = make_comm_layout(R, T, K, E, dispatch_row_bytes(H, row_kind),
                                             static_cast<uint64_t>(num_scales) * 4);
  GroupLaunch group_launch{};
  if (ffi::Error error = PrepareGroup(kOp, device_ordinal, rank, group, R, T, K, axis_slot,
                                      num_sms, send_warps, layout, &group_launch);
      !error.success()) {
    return error;
  }
  DispatchLaunch launch{};
  launch.state = group_launch.state;
  launch.layout = layout;
  launch.x = x.untyped_data();
  launch.topk_idx = topk_idx.typed_data();
  launch.topk_weights = topk_weights.typed_data();
  launch.rank = rank.typed_data();
  launch.group = group.typed_data();
  launch.rows = rows->untyped_data();
  launch.scales = fp8 ? scales->typed_data() : nullptr;
  launch.group_sizes = group_sizes->typed_data();
  launch.expert_counts = expert_counts->typed_data();
  launch.row_weights = row_weights->typed_data();
  launch.num_dropped = num_dropped->typed_data();
  launch.src_index = src_index->typed_data();
  launch.token_rows = token_rows->typed_data();
  launch.is_token_in_rank = is_token_in_rank->typed_data();
  launch.num_tokens = static_cast<int32_t>(T);
  launch.num_topk = static_cast<int32_t>(K);
  launch.num_experts = static_cast<int32_t>(E);
  launch.num_ranks = static_cast<int32_t>(R);
  launch.hidden = static_cast<int32_t>(H);
  launch.capacity = static_cast<int32_t>(C);
  launch.alignment = static_cast<int32_t>(alignment);
  launch.x_kind = x_kind;
  launch.row_kind = row_kind;
  launch.num_blocks = group_launch.num_blocks;
  launch.send_warps = group_launch.send_warps;
  launch.axis_slot = group_launch.axis_slot;
  launch.use_tma = tma != 0;
  const cudaError_t status = launch_dispatch(launch, stream);
  if (status != cudaSuccess) return CudaError(status, "dispatch kernel launch");
  return ffi::Error::Success();
}

ffi::Error CombineImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer y,
                       ffi::Buffer<ffi::F32> row_weights, ffi::Buffer<ffi::S32> token_rows,
                       ffi::Buffer<ffi::PRED> is_token_in_rank, ffi::Buffer<ffi::S32> rank,
                       ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer> out,
                       int64_t num_ranks, int64_t weighted, int64_t num_sms, int64_t send_warps,
                       int64_t axis_slot) {
  constexpr const char* kOp = kCombineTarget;
  if (ffi::Error error = CountCall(combine_counters, stream, kOp); !error.success()) return error;
  const auto y_dims = y.dimensions();
  const auto out_dims = out->dimensions();
  const auto rows_dims = token_rows.dimensions();
  int32_t y_kind;
  if (!RowKindOf(y.element_type(), &y_kind) || y_kind == kRowFP8 ||
      out->element_type() != y.element_type()) {
    return Invalid(kOp, "y must be bfloat16 or float32, and the output of the same dtype");
  }
  if (y_dims.size() != 2 || out_dims.size() != 2 || rows_dims.size() != 2 ||
      out_dims[1] != y_dims[1]) {
    return Invalid(kOp, "y " + DimsToString(y_dims) + ", out " + DimsToString(out_dims) +
                            ", token_rows " + DimsToString(rows_dims) +
                            " must be [C, H], [T, H], [R * T, K]");
  }
  const int64_t C = y_dims[0], H = y_dims[1], T = out_dims[0], K = rows_dims[1], R = num_ranks;
  if (H < 8 || H % 8 != 0) return Invalid(kOp, "hidden=" + std::to_string(H) + " must be a multiple of 8");
  if (!IsShape(rows_dims, {R * T, K}) || !IsShape(is_token_in_rank.dimensions(), {T, R}) ||
      (weighted ? !IsShape(row_weights.dimensions(), {C}) : false)) {
    return Invalid(kOp, "handle shapes do not match T=" + std::to_string(T) + ", R=" +
                            std::to_string(R) + ", C=" + std::to_string(C));
  }
  const CommLayout layout =
      make_comm_layout(R, T, K, 0, static_cast<uint64_t>(H) * (y_kind == kRowF32 ? 4 : 2), 0);
  GroupLaunch launch{};
  if (ffi::Error error = PrepareGroup(kOp, device_ordinal, rank, group, R, T, K, axis_slot,
                                      num_sms, send_warps, layout, &launch);
      !error.success()) {
    return error;
  }
  const cudaError_t status = launch_combine(
      launch, y.untyped_data(), weighted ? row_weights.typed_data() : nullptr,
      token_rows.typed_data(), is_token_in_rank.typed_data(), static_cast<int32_t>(H), y_kind,
      out->untyped_data(), stream);
  if (status != cudaSuccess) return CudaError(status, "combine kernel launch");
  return ffi::Error::Success();
}

ffi::Error BroadcastImpl(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer g,
                         ffi::Buffer<ffi::S32> token_rows, ffi::Buffer<ffi::PRED> is_token_in_rank,
                         ffi::Buffer<ffi::S32> src_index, ffi::Buffer<ffi::S32> rank,
                         ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer> out,
                         int64_t num_ranks, int64_t num_sms, int64_t send_warps,
                         int64_t axis_slot, int64_t tma) {
  constexpr const char* kOp = kBroadcastTarget;
  if (ffi::Error error = CountCall(broadcast_counters, stream, kOp); !error.success()) {
    return error;
  }
  const auto g_dims = g.dimensions();
  const auto out_dims = out->dimensions();
  const auto rows_dims = token_rows.dimensions();
  int32_t g_kind;
  if (!RowKindOf(g.element_type(), &g_kind) || g_kind == kRowFP8 ||
      out->element_type() != g.element_type()) {
    return Invalid(kOp, "g must be bfloat16 or float32, and the output of the same dtype");
  }
  if (g_dims.size() != 2 || out_dims.size() != 2 || rows_dims.size() != 2 ||
      out_dims[1] != g_dims[1]) {
    return Invalid(kOp, "g " + DimsToString(g_dims) + ", out " + DimsToString(out_dims) +
                            ", token_rows " + DimsToString(rows_dims) +
                            " must be [T, H], [C, H], [R * T, K]");
  }
  const int64_t T = g_dims[0], H = g_dims[1], C = out_dims[0], K = rows_dims[1], R = num_ranks;
  if (H < 8 || H % 8 != 0) return Invalid(kOp, "hidden=" + std::to_string(H) + " must be a multiple of 8");
  if (C < 1 || C >= (int64_t{1} << 31) || !IsShape(rows_dims, {R * T, K}) ||
      !IsShape(is_token_in_rank.dimensions(), {T, R}) || !IsShape(src_index.dimensions(), {C})) {
    return Invalid(kOp, "handle shapes do not match T=" + std::to_string(T) + ", R=" +
                            std::to_string(R) + ", C=" + std::to_string(C));
  }
  const CommLayout layout =
      make_comm_layout(R, T, K, 0, static_cast<uint64_t>(H) * (g_kind == kRowF32 ? 4 : 2), 0);
  GroupLaunch launch{};
  if (ffi::Error error = PrepareGroup(kOp, device_ordinal, rank, group, R, T, K, axis_slot,
                                      num_sms, send_warps, layout, &launch);
      !error.success()) {
    return error;
  }
  const cudaError_t status = launch_broadcast(
      launch, g.untyped_data(), token_rows.typed_data(), is_token_in_rank.typed_data(),
      src_index.typed_data(), static_cast<int32_t>(C), static_cast<int32_t>(H), g_kind, tma != 0,
      out->untyped_data(), stream);
  if (status != cudaSuccess) return CudaError(status, "broadcast kernel launch");
  return ffi::Error::Success();
}

ffi::Error SlotValuesImpl(cudaStream_t stream, int32_t device_ordinal,
                          ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> token_rows,
                          ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                          ffi::ResultBuffer<ffi::F32> out, int64_t num_ranks, int64_t axis_slot) {
  constexpr const char* kOp = kSlotValuesTarget;
  if (ffi::Error error = CountCall(slot_values_counters, stream, kOp); !error.success()) {
    return error;
  }
  const auto rows_dims = token_rows.dimensions();
  const auto out_dims = out->dimensions();
  if (values.dimensions().size() != 1 || rows_dims.size() != 2 || out_dims.size() != 2 ||
      !IsShape(rows_dims, {num_ranks * out_dims[0], out_dims[1]})) {
    return Invalid(kOp, "values " + DimsToString(values.dimensions()) + ", token_rows " +
                            DimsToString(rows_dims) + ", out " + DimsToString(out_dims) +
                            " must be [C], [R * T, K], [T, K]");
  }
  const int64_t T = out_dims[0], K = out_dims[1], R = num_ranks;
  const CommLayout layout = make_comm_layout(R, T, K, 0, 0, 0);
  GroupLaunch launch{};
  if (ffi::Error error = PrepareGroup(kOp, device_ordinal, rank, group, R, T, K, axis_slot,
                                      /*num_sms=*/1, /*send_warps=*/1, layout, &launch);
      !error.success()) {
    return error;
  }
  const cudaError_t status = launch_slot_values(launch, values.typed_data(),
                                                token_rows.typed_data(), out->typed_data(), stream);
  if (status != cudaSuccess) return CudaError(status, "slot_values kernel launch");
  return ffi::Error::Success();
}

}  // namespace

std::vector<HandlerStats> GetHandlerStats() {
  std::vector<HandlerStats> stats;
  for (const auto& [target, counters] :
       {std::pair<const char*, CallCounters*>{kDispatchLayoutTarget, &layout_counters},
        std::pair<const char*, CallCounters*>{kPeerSmokeTarget, &peer_smoke_counters},
        std::pair<const char*, CallCounters*>{kDispatchTarget, &dispatch_counters},
        std::pair<const char*, CallCounters*>{kCombineTarget, &combine_counters},
        std::pair<const char*, CallCounters*>{kBroadcastTarget, &broadcast_counters},
        std::pair<const char*, CallCounters*>{kSlotValuesTarget, &slot_values_counters}}) {
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatch, jax_ep::DispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()              // x [T, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // topk_idx [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()       // topk_weights [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // rank []
                                  .Arg<ffi::Buffer<ffi::S32>>()       // group []
                                  .Ret<ffi::AnyBuffer>()              // rows [C, H]
                                  .Ret<ffi::Buffer<ffi::F32>>()       // scales [C, H/128] or [0]
                                  .Ret<ffi::Buffer<ffi::S32>>()       // group_sizes [E_local]
                                  .Ret<ffi::Buffer<ffi::S32>>()       // expert_counts [E_local]
                                  .Ret<ffi::Buffer<ffi::F32>>()       // row_weights [C]
                                  .Ret<ffi::Buffer<ffi::S32>>()       // num_dropped []
                                  .Ret<ffi::Buffer<ffi::S32>>()       // src_index [C]
                                  .Ret<ffi::Buffer<ffi::S32>>()       // token_rows [R*T, K]
                                  .Ret<ffi::Buffer<ffi::PRED>>()      // is_token_in_rank [T, R]
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("alignment")
                                  .Attr<int64_t>("num_sms")
                                  .Attr<int64_t>("send_warps")
                                  .Attr<int64_t>("axis_slot")
                                  .Attr<int64_t>("tma"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombine, jax_ep::CombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()              // y [C, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()       // row_weights [C] (or [0])
                                  .Arg<ffi::Buffer<ffi::S32>>()       // token_rows [R*T, K]
                                  .Arg<ffi::Buffer<ffi::PRED>>()      // is_token_in_rank [T, R]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // rank []
                                  .Arg<ffi::Buffer<ffi::S32>>()       // group []
                                  .Ret<ffi::AnyBuffer>()              // out [T, H]
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("weighted")
                                  .Attr<int64_t>("num_sms")
                                  .Attr<int64_t>("send_warps")
                                  .Attr<int64_t>("axis_slot"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpBroadcast, jax_ep::BroadcastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()              // g [T, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // token_rows [R*T, K]
                                  .Arg<ffi::Buffer<ffi::PRED>>()      // is_token_in_rank [T, R]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // src_index [C]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // rank []
                                  .Arg<ffi::Buffer<ffi::S32>>()       // group []
                                  .Ret<ffi::AnyBuffer>()              // out [C, H]
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_sms")
                                  .Attr<int64_t>("send_warps")
                                  .Attr<int64_t>("axis_slot")
                                  .Attr<int64_t>("tma"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpSlotValues, jax_ep::SlotValuesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::F32>>()       // values [C]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // token_rows [R*T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // rank []
                                  .Arg<ffi::Buffer<ffi::S32>>()       // group []
                                  .Ret<ffi::Buffer<ffi::F32>>()       // out [T, K]
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("axis_slot"),
                              {ffi::Traits::kCmdBufferCompatible});
