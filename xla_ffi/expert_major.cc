// The expert-major EP data ops: jax_ep_dispatch, jax_ep_combine, jax_ep_broadcast,
// jax_ep_combine_bwd, jax_ep_slot_values (cuda/dispatch.h, combine.h, broadcast.h, slot_values.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/broadcast.h"
#include "cuda/combine.h"
#include "cuda/slot_values.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/handler_util.h"
#include "xla_ffi/handlers.h"
#include "xla_ffi/runtime.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

// PrepareGroup, and the rank mask operand into the launch (combine, broadcast, slot_values).
ffi::Error PrepareMaskedGroup(const char* op, int32_t device_ordinal, const OpState& state,
                              ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                              ffi::Buffer<ffi::S32> group, GroupLaunch* launch) {
  JAX_EP_RETURN_IF_ERROR(PrepareGroup(op, device_ordinal, state, rank, group, launch));
  return RankMaskOf(op, state, rank_mask, &launch->rank_mask);
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
  JAX_EP_RETURN_IF_ERROR(CountCall(dispatch_counters, stream, kOp));
  const EPAttrs& a = state->attrs;
  const int64_t T = a.num_tokens, K = a.num_topk, R = a.num_ranks, C = a.capacity;
  if (a.alignment < 1 || C < 1 || C % a.alignment != 0) {
    return Invalid(kOp, "attributes C=" + std::to_string(C) + " alignment=" +
                            std::to_string(a.alignment) + " inconsistent");
  }
  DispatchLaunch launch{};
  JAX_EP_RETURN_IF_ERROR(PrepareDispatch(kOp, device_ordinal, *state, x, topk_idx, topk_weights,
                                         rank, group, rows, scales, C, is_token_in_rank, &launch));
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
  JAX_EP_RETURN_IF_ERROR(RankMaskOf(kOp, *state, rank_mask, &launch.rank_mask));
  launch.src_index = src_index->typed_data();
  launch.token_rows = token_rows->typed_data();
  launch.alignment = static_cast<int32_t>(a.alignment);
  const cudaError_t status = launch_dispatch(launch, stream);
  if (status != cudaSuccess) return CudaError(status, "dispatch kernel launch");
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
  JAX_EP_RETURN_IF_ERROR(BeginRowsOp(kOp, combine_counters, stream, a, "y", y, out->element_type(),
                                     &y_kind));
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
  JAX_EP_RETURN_IF_ERROR(PrepareMaskedGroup(kOp, device_ordinal, *state, rank_mask, rank, group,
                                            &launch));
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
  JAX_EP_RETURN_IF_ERROR(BeginRowsOp(op, counters, stream, a, "g", g, out->element_type(), g_kind));
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

// broadcast; `into` is [0, H] (out's rows with no token zeroed) or [C, H] aliased with out (they
// keep into's rows: an unweighted combine's backward in place, cuda/broadcast.h keep_empty_rows).
ffi::Error BroadcastImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                         ffi::AnyBuffer g, ffi::Buffer<ffi::S32> token_rows,
                         ffi::Buffer<ffi::PRED> is_token_in_rank, ffi::Buffer<ffi::S32> src_index,
                         ffi::AnyBuffer into, ffi::Buffer<ffi::S32> rank_mask,
                         ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                         ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kOp = kBroadcastTarget;
  const EPAttrs& a = state->attrs;
  GroupLaunch launch{};
  int32_t g_kind;
  JAX_EP_RETURN_IF_ERROR(PrepareBroadcast(kOp, broadcast_counters, stream, device_ordinal, *state,
                                          g, token_rows, is_token_in_rank, src_index, rank_mask,
                                          rank, group, out, &launch, &g_kind));
  const bool keep_empty_rows = IsShape(into.dimensions(), {a.capacity, a.hidden});
  if (into.element_type() != g.element_type() ||
      !(keep_empty_rows || IsShape(into.dimensions(), {0, a.hidden})) ||
      (keep_empty_rows && into.untyped_data() != out->untyped_data())) {
    return Invalid(kOp, "into " + DimsToString(into.dimensions()) + " must be of g's dtype and "
                            "[0, H], or [C, H] aliased with the output (C=" +
                            std::to_string(a.capacity) + ", H=" + std::to_string(a.hidden) + ")");
  }
  const cudaError_t status = launch_broadcast(
      launch, g.untyped_data(), token_rows.typed_data(), is_token_in_rank.typed_data(),
      src_index.typed_data(), static_cast<int32_t>(a.capacity), static_cast<int32_t>(a.hidden),
      g_kind, a.bulk_copy != 0, /*rank_major=*/false, keep_empty_rows, out->untyped_data(),
      stream);
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
  JAX_EP_RETURN_IF_ERROR(PrepareBroadcast(kOp, combine_bwd_counters, stream, device_ordinal, *state,
                                          g, token_rows, is_token_in_rank, src_index, rank_mask,
                                          rank, group, dy, &launch, &kind));
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

ffi::Error SlotValuesImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                          ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> token_rows,
                          ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                          ffi::Buffer<ffi::S32> group, ffi::ResultBuffer<ffi::F32> out) {
  constexpr const char* kOp = kSlotValuesTarget;
  JAX_EP_RETURN_IF_ERROR(CountCall(slot_values_counters, stream, kOp));
  const EPAttrs& a = state->attrs;
  const int64_t T = a.num_tokens, K = a.num_topk, R = a.num_ranks;
  if (values.dimensions().size() != 1 || !IsShape(token_rows.dimensions(), {R * T, K}) ||
      !IsShape(out->dimensions(), {T, K})) {
    return Invalid(kOp, "values " + DimsToString(values.dimensions()) + ", token_rows " +
                            DimsToString(token_rows.dimensions()) + ", out " +
                            DimsToString(out->dimensions()) + " must be [C], [R * T, K], [T, K]");
  }
  GroupLaunch launch{};
  JAX_EP_RETURN_IF_ERROR(PrepareMaskedGroup(kOp, device_ordinal, *state, rank_mask, rank, group,
                                            &launch));
  const cudaError_t status = launch_slot_values(launch, values.typed_data(),
                                                token_rows.typed_data(), out->typed_data(), stream);
  if (status != cudaSuccess) return CudaError(status, "slot_values kernel launch");
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

JAX_EP_DATA_OP_INSTANTIATE(JaxEpDispatchInstantiate, kDispatchTarget);
JAX_EP_DATA_OP_INSTANTIATE(JaxEpCombineInstantiate, kCombineTarget);
JAX_EP_DATA_OP_INSTANTIATE(JaxEpBroadcastInstantiate, kBroadcastTarget);
JAX_EP_DATA_OP_INSTANTIATE(JaxEpCombineBwdInstantiate, kCombineBwdTarget);
JAX_EP_DATA_OP_INSTANTIATE(JaxEpSlotValuesInstantiate, kSlotValuesTarget);

// The data ops' bindings are parenthesised: the commas between their template arguments would
// otherwise split the macro's arguments.
JAX_EP_DEFINE_ASYNC_EXECUTE(JaxEpDispatch, jax_ep::DispatchImpl,
                            (jax_ep::BindDispatchOp()  // x, topk_idx, topk_weights, rank_mask
                                 .Ret<ffi::AnyBuffer>()                    // rows
                                 .Ret<ffi::Buffer<ffi::F32>>()             // scales
                                 .Ret<ffi::Buffer<ffi::S32>>()             // group_sizes
                                 .Ret<ffi::Buffer<ffi::S32>>()             // expert_counts
                                 .Ret<ffi::Buffer<ffi::S32>>()             // num_dropped
                                 .Ret<ffi::Buffer<ffi::S32>>()             // src_index
                                 .Ret<ffi::Buffer<ffi::S32>>()             // token_rows
                                 .Ret<ffi::Buffer<ffi::PRED>>()            // is_token_in_rank
                                 .Ret<ffi::Buffer<ffi::F32>>()             // row_weights
                                 .Ret<ffi::Buffer<ffi::S32>>()));          // rank_mask (active)

JAX_EP_DEFINE_ASYNC_EXECUTE(JaxEpCombine, jax_ep::CombineImpl,
                            (jax_ep::BindDataOp<ffi::AnyBuffer,             // y
                                                ffi::Buffer<ffi::F32>,      // row_weights
                                                ffi::Buffer<ffi::S32>,      // token_rows
                                                ffi::Buffer<ffi::PRED>,     // is_token_in_rank
                                                ffi::Buffer<ffi::S32>>()    // rank_mask
                                 .Ret<ffi::AnyBuffer>()));                  // out

JAX_EP_DEFINE_ASYNC_EXECUTE(JaxEpBroadcast, jax_ep::BroadcastImpl,
                            (jax_ep::BindDataOp<ffi::AnyBuffer,             // g
                                                ffi::Buffer<ffi::S32>,      // token_rows
                                                ffi::Buffer<ffi::PRED>,     // is_token_in_rank
                                                ffi::Buffer<ffi::S32>,      // src_index
                                                ffi::AnyBuffer,             // into
                                                ffi::Buffer<ffi::S32>>()    // rank_mask
                                 .Ret<ffi::AnyBuffer>()));                  // out

JAX_EP_DEFINE_ASYNC_EXECUTE(JaxEpCombineBwd, jax_ep::CombineBwdImpl,
                            (jax_ep::BindDataOp<ffi::AnyBuffer,             // g
                                                ffi::AnyBuffer,             // y
                                                ffi::Buffer<ffi::F32>,      // row_weights
                                                ffi::Buffer<ffi::S32>,      // token_rows
                                                ffi::Buffer<ffi::PRED>,     // is_token_in_rank
                                                ffi::Buffer<ffi::S32>,      // src_index
                                                ffi::Buffer<ffi::S32>>()    // rank_mask
                                 .Ret<ffi::AnyBuffer>()                     // d y
                                 .Ret<ffi::Buffer<ffi::F32>>()));           // d row_weights

JAX_EP_DEFINE_ASYNC_EXECUTE(JaxEpSlotValues, jax_ep::SlotValuesImpl,
                            (jax_ep::BindDataOp<ffi::Buffer<ffi::F32>,      // values
                                                ffi::Buffer<ffi::S32>,      // token_rows
                                                ffi::Buffer<ffi::S32>>()    // rank_mask
                                 .Ret<ffi::Buffer<ffi::F32>>()));           // out
