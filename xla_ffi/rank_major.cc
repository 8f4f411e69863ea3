// The rank-major EP data ops (DeepEP's contract): jax_ep_dispatch_rank_major,
// jax_ep_combine_rank_major, jax_ep_broadcast_rank_major: over NVLink the expert-major kernels in
// their rank-major mode, over NVSHMEM puts cuda/remote_rank_major.h.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/broadcast.h"
#include "cuda/combine.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/handler_util.h"
#include "xla_ffi/handlers.h"
#include "xla_ffi/runtime.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

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
  JAX_EP_RETURN_IF_ERROR(CountCall(dispatch_rank_major_counters, stream, kOp));
  const EPAttrs& a = state->attrs;
  const int64_t T = a.num_tokens, K = a.num_topk, R = a.num_ranks, N = R * T;
  if (a.capacity != N) {
    return Invalid(kOp, "capacity=" + std::to_string(a.capacity) + " must be R * T = " +
                            std::to_string(N));
  }
  DispatchLaunch launch{};
  JAX_EP_RETURN_IF_ERROR(PrepareDispatch(kOp, device_ordinal, *state, x, topk_idx, topk_weights,
                                         rank, group, rows, scales, N, is_token_in_rank, &launch));
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
  JAX_EP_RETURN_IF_ERROR(RankMaskOf(kOp, *state, rank_mask, &launch.rank_mask));
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
  JAX_EP_RETURN_IF_ERROR(PrepareGroup(op, device_ordinal, state, rank, group, &launch));
  JAX_EP_RETURN_IF_ERROR(CheckRankMajorHandle(op, state, src_index, is_token_in_rank, slot_rows));
  if (state.attrs.transport == kTransportPut) {
    return PutRowsOp(op, state, launch, data, src_index, is_token_in_rank, out, slot_rows, kind,
                     stream);
  }
  JAX_EP_RETURN_IF_ERROR(RankMajorTable(op, state, src_index, slot_rows, launch, stream));
  JAX_EP_RETURN_IF_ERROR(RankMaskOf(op, state, rank_mask, &launch.rank_mask));
  const cudaError_t status = kernel(launch, slot_rows->typed_data());
  if (status != cudaSuccess) return CudaError(status, what);
  return ffi::Error::Success();
}

// combine_rank_major (rows [R * T, H] -> tokens [T, H]) and broadcast_rank_major (tokens -> rows,
// its backward): one handler body, the direction the template argument. `in` is y or g.
template <bool kCombine>
ffi::Error RankMajorRowsImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                             ffi::AnyBuffer in, ffi::Buffer<ffi::S32> src_index,
                             ffi::Buffer<ffi::PRED> is_token_in_rank,
                             ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                             ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer> out,
                             ffi::ResultBuffer<ffi::S32> slot_rows) {
  constexpr const char* kOp = kCombine ? kCombineRankMajorTarget : kBroadcastRankMajorTarget;
  const char* in_name = kCombine ? "y" : "g";
  const EPAttrs& a = state->attrs;
  const int64_t T = a.num_tokens, H = a.hidden, R = a.num_ranks;
  int32_t kind;
  JAX_EP_RETURN_IF_ERROR(BeginRowsOp(kOp,
                                     kCombine ? combine_rank_major_counters : broadcast_rank_major_counters,
                                     stream, a, in_name, in, out->element_type(), &kind));
  const bool shapes_ok =
      kCombine ? IsShape(in.dimensions(), {R * T, H}) && IsShape(out->dimensions(), {T, H})
               : a.capacity == R * T && IsShape(in.dimensions(), {T, H}) &&
                     IsShape(out->dimensions(), {R * T, H});
  if (!shapes_ok) {
    return Invalid(kOp, std::string(in_name) + " " + DimsToString(in.dimensions()) + ", out " +
                            DimsToString(out->dimensions()) + " do not match " +
                            (kCombine ? "[R * T, H], [T, H]" : "[T, H], [R * T, H]") + " with T=" +
                            std::to_string(T) + ", H=" + std::to_string(H) + ", R=" +
                            std::to_string(R) +
                            (kCombine ? "" : " (capacity " + std::to_string(a.capacity) + ")"));
  }
  return RunRankMajorRows(
      kOp, stream, device_ordinal, *state, in.untyped_data(), kind, src_index, is_token_in_rank,
      rank_mask, rank, group, out->untyped_data(), slot_rows,
      kCombine ? "combine_rank_major kernel launch" : "broadcast_rank_major kernel launch",
      [&](const GroupLaunch& launch, const int32_t* table) {
        if constexpr (kCombine) {
          return launch_combine(launch, in.untyped_data(), /*row_weights=*/nullptr, table,
                                is_token_in_rank.typed_data(), static_cast<int32_t>(H), kind,
                                /*rank_major=*/true, out->untyped_data(), stream);
        } else {
          return launch_broadcast(launch, in.untyped_data(), table, is_token_in_rank.typed_data(),
                                  src_index.typed_data(), static_cast<int32_t>(R * T),
                                  static_cast<int32_t>(H), kind, a.bulk_copy != 0,
                                  /*rank_major=*/true, /*keep_empty_rows=*/false,
                                  out->untyped_data(), stream);
        }
      });
}

// Their operands: y or g, src_index, is_token_in_rank, rank_mask; results: out, slot_rows (scratch).
auto BindRankMajorRowsOp() {
  return BindDataOp<ffi::AnyBuffer, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::PRED>,
                    ffi::Buffer<ffi::S32>>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::Buffer<ffi::S32>>();
}

}  // namespace
}  // namespace jax_ep

JAX_EP_DATA_OP_INSTANTIATE(JaxEpDispatchRankMajorInstantiate, kDispatchRankMajorTarget);
JAX_EP_DATA_OP_INSTANTIATE(JaxEpCombineRankMajorInstantiate, kCombineRankMajorTarget);
JAX_EP_DATA_OP_INSTANTIATE(JaxEpBroadcastRankMajorInstantiate, kBroadcastRankMajorTarget);

JAX_EP_DEFINE_ASYNC_EXECUTE(JaxEpDispatchRankMajor, jax_ep::DispatchRankMajorImpl,
                            (jax_ep::BindDispatchOp()  // x, topk_idx, topk_weights, rank_mask
                                 .Ret<ffi::AnyBuffer>()                    // rows
                                 .Ret<ffi::Buffer<ffi::F32>>()             // scales
                                 .Ret<ffi::Buffer<ffi::S32>>()             // topk_idx (local ids)
                                 .Ret<ffi::Buffer<ffi::F32>>()             // topk_weights
                                 .Ret<ffi::Buffer<ffi::S32>>()             // num_tokens_per_rank
                                 .Ret<ffi::Buffer<ffi::S32>>()             // num_tokens_per_expert
                                 .Ret<ffi::Buffer<ffi::S32>>()             // src_index
                                 .Ret<ffi::Buffer<ffi::PRED>>()));         // is_token_in_rank

JAX_EP_DEFINE_ASYNC_EXECUTE(JaxEpCombineRankMajor, jax_ep::RankMajorRowsImpl<true>,
                            jax_ep::BindRankMajorRowsOp());

JAX_EP_DEFINE_ASYNC_EXECUTE(JaxEpBroadcastRankMajor, jax_ep::RankMajorRowsImpl<false>,
                            jax_ep::BindRankMajorRowsOp());
