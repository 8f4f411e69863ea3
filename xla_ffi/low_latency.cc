// jax_ep_ll_dispatch / jax_ep_ll_combine (low-latency mode: fixed slots per (expert, source rank)),
// fused or in two phases (_send returns a call token, _recv takes it): cuda/low_latency.h.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/low_latency.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/handler_util.h"
#include "xla_ffi/handlers.h"
#include "xla_ffi/runtime.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

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
                     uint32_t* token, LLCommon* c) {
  GroupLaunch g{};
  JAX_EP_RETURN_IF_ERROR(PrepareGroup(op, device_ordinal, state, rank, group, &g));
  const EPAttrs& a = state.attrs;
  c->state = g.state;
  c->L = LLLayoutOf(a);
  c->rank = g.rank;
  c->group = g.group;
  c->token = token;
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
  JAX_EP_RETURN_IF_ERROR(CheckLLPairs(op, a, "the topk_weights output", weights->dimensions()));
  JAX_EP_RETURN_IF_ERROR(CheckLLPairs(op, a, "the dest_rank output", dest_rank->dimensions()));
  if (num_dropped->element_count() != 1) return Invalid(op, "num_dropped must be a scalar");
  launch->weights = weights->typed_data();
  launch->dest_rank = dest_rank->typed_data();
  launch->num_dropped = num_dropped->typed_data();
  return ffi::Error::Success();
}

// The call token between a _send and its _recv: uint32 [4] (epoch, call; low then high words).
ffi::Error CheckLLToken(const char* op, ffi::Span<const int64_t> dims) {
  if (!IsShape(dims, {4})) {
    return Invalid(op, "the call token must be uint32[4], got " + DimsToString(dims));
  }
  return ffi::Error::Success();
}

// What the fused ll_dispatch and its send phase check first: the inputs x [T, H] (bf16 / f32),
// topk_idx [T, K] and topk_weights f32 [T, K], then the handle slots they write (SetLLHandleSlots);
// sets their launch fields.
ffi::Error CheckLLDispatchSend(const char* op, const EPAttrs& a, ffi::AnyBuffer x,
                               ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                               ffi::ResultBuffer<ffi::F32>& weights,
                               ffi::ResultBuffer<ffi::S32>& dest_rank,
                               ffi::ResultBuffer<ffi::S32>& num_dropped, LLDispatchLaunch* launch) {
  JAX_EP_RETURN_IF_ERROR(CheckLLPairs(op, a, "topk_weights", topk_weights.dimensions()));
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
  return SetLLHandleSlots(op, a, launch, weights, dest_rank, num_dropped);
}

// The wire row kind the attributes were sized for (fp8: H bytes + H / 128 scales; bf16: 2H).
ffi::Error LLRowKindOfAttrs(const char* op, const EPAttrs& a, int32_t* row_kind) {
  *row_kind = a.row_bytes == a.hidden ? kRowFP8 : kRowBF16;
  JAX_EP_RETURN_IF_ERROR(CheckRowBytes(op, a, *row_kind));
  const bool fp8 = *row_kind == kRowFP8;
  if ((fp8 && a.hidden % kFp8Block != 0) || a.scale_bytes != (fp8 ? a.hidden / kFp8Block * 4 : 0)) {
    return Invalid(op, "scale_bytes=" + std::to_string(a.scale_bytes) + " does not match H=" +
                           std::to_string(a.hidden) + (fp8 ? " (fp8)" : " (bf16)"));
  }
  return ffi::Error::Success();
}

// The receiving side's outputs of ll_dispatch / ll_dispatch_recv, checked against the attributes and
// set in the launch (its row_kind: the rows' dtype): rows [E_local, R * T, H], scales [E_local, R * T,
// H / 128] (fp8; else empty), counts [E_local, R], src_slot [E_local, R * T] and active int32 [R]
// (the ranks that took part in the call).
ffi::Error SetLLDispatchOutputs(const char* op, const EPAttrs& a,
                                ffi::Result<ffi::AnyBuffer>& rows,
                                ffi::ResultBuffer<ffi::F32>& scales,
                                ffi::ResultBuffer<ffi::S32>& counts,
                                ffi::ResultBuffer<ffi::S32>& src_slot,
                                ffi::ResultBuffer<ffi::S32>& active, LLDispatchLaunch* launch) {
  int32_t* row_kind = &launch->row_kind;
  if (!RowKindOf(rows->element_type(), row_kind) ||
      !(*row_kind == kRowBF16 || *row_kind == kRowFP8)) {
    return Invalid(op, "rows must be bfloat16 or float8_e4m3fn");
  }
  int32_t attr_kind;
  JAX_EP_RETURN_IF_ERROR(LLRowKindOfAttrs(op, a, &attr_kind));
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
  if (!IsShape(active->dimensions(), {R})) {
    return Invalid(op, "the rank_mask output " + DimsToString(active->dimensions()) +
                           " must be [R], R=" + std::to_string(R));
  }
  launch->rows = rows->untyped_data();
  launch->scales = fp8 ? scales->typed_data() : nullptr;
  launch->counts = counts->typed_data();
  launch->src_slot = src_slot->typed_data();
  launch->active = active->typed_data();
  return ffi::Error::Success();
}

// Which part of a low-latency op a handler runs: fused, or a phase with the call token between the
// _send and its _recv (the send writes it, the receive reads it).
struct LLPhase {
  int32_t mode;
  uint32_t* token;                       // nullptr when fused
  ffi::Span<const int64_t> token_dims;  // checked for a phase
  const ffi::Buffer<ffi::S32>* rank_mask;  // the call's (fused, send); a receive runs its send's
};
LLPhase FusedPhase(const ffi::Buffer<ffi::S32>& rank_mask) {
  return {kLLFused, nullptr, {}, &rank_mask};
}
LLPhase SendPhase(ffi::ResultBuffer<ffi::U32>& token, const ffi::Buffer<ffi::S32>& rank_mask) {
  return {kLLSend, token->typed_data(), token->dimensions(), &rank_mask};
}
LLPhase RecvPhase(ffi::Buffer<ffi::U32>& token) {
  return {kLLRecv, const_cast<uint32_t*>(token.typed_data()), token.dimensions(), nullptr};
}

cudaError_t LaunchLLKernel(const LLDispatchLaunch& launch, cudaStream_t stream) {
  return launch_ll_dispatch(launch, stream);
}
cudaError_t LaunchLLKernel(const LLCombineLaunch& launch, cudaStream_t stream) {
  return launch_ll_combine(launch, stream);
}

// The steps every low-latency handler shares, in this order: count the call; the op's own checks
// (`own`: its buffers against the attributes; it also fills its own fields of `launch`); for a
// phase, the call token's shape; the common launch fields (PrepareLL); the launch. `what` names the
// kernel in a launch error ("ll_dispatch_send").
template <typename Launch, typename Own>
ffi::Error RunLL(const char* op, const char* what, CallCounters& counters, cudaStream_t stream,
                 int32_t device_ordinal, const OpState& state, ffi::Buffer<ffi::S32> rank,
                 ffi::Buffer<ffi::S32> group, const LLPhase& phase, Launch& launch, Own own) {
  JAX_EP_RETURN_IF_ERROR(CountCall(counters, stream, op));
  JAX_EP_RETURN_IF_ERROR(own(state.attrs));
  if (phase.rank_mask != nullptr) {
    JAX_EP_RETURN_IF_ERROR(CheckLLRankMask(op, state.attrs, *phase.rank_mask));
    launch.c.rank_mask = phase.rank_mask->typed_data();
  }
  if (phase.mode != kLLFused) {
    JAX_EP_RETURN_IF_ERROR(CheckLLToken(op, phase.token_dims));
  }
  JAX_EP_RETURN_IF_ERROR(PrepareLL(op, device_ordinal, state, rank, group, phase.mode, phase.token,
                                   &launch.c));
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
    JAX_EP_RETURN_IF_ERROR(CheckLLDispatchSend(kOp, a, x, topk_idx, topk_weights, weights,
                                               dest_rank, num_dropped, &launch));
    return SetLLDispatchOutputs(kOp, a, rows, scales, counts, src_slot, active, &launch);
  };
  return RunLL(kOp, "ll_dispatch", ll_dispatch_counters, stream, device_ordinal, *state, rank,
               group, FusedPhase(rank_mask), launch, own);
}

ffi::Error LLDispatchSendImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                              ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                              ffi::Buffer<ffi::F32> topk_weights,
                              ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                              ffi::Buffer<ffi::S32> group, ffi::ResultBuffer<ffi::U32> token,
                              ffi::ResultBuffer<ffi::F32> weights,
                              ffi::ResultBuffer<ffi::S32> dest_rank,
                              ffi::ResultBuffer<ffi::S32> num_dropped) {
  constexpr const char* kOp = kLLDispatchSendTarget;
  LLDispatchLaunch launch{};
  auto own = [&](const EPAttrs& a) -> ffi::Error {
    JAX_EP_RETURN_IF_ERROR(CheckLLDispatchSend(kOp, a, x, topk_idx, topk_weights, weights,
                                               dest_rank, num_dropped, &launch));
    JAX_EP_RETURN_IF_ERROR(LLRowKindOfAttrs(kOp, a, &launch.row_kind));
    return ffi::Error::Success();
  };
  return RunLL(kOp, "ll_dispatch_send", ll_dispatch_send_counters, stream, device_ordinal, *state,
               rank, group, SendPhase(token, rank_mask), launch, own);
}

ffi::Error LLDispatchRecvImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                              ffi::Buffer<ffi::U32> token, ffi::Buffer<ffi::F32> sent_weights,
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
    JAX_EP_RETURN_IF_ERROR(CheckLLPairs(kOp, a, "the send's topk_weights",
                                        sent_weights.dimensions()));
    JAX_EP_RETURN_IF_ERROR(CheckLLPairs(kOp, a, "the send's dest_rank", sent_dest.dimensions()));
    if (sent_dropped.element_count() != 1) return Invalid(kOp, "the send's num_dropped must be a scalar");
    launch.sent_weights = sent_weights.typed_data();
    launch.sent_dest = sent_dest.typed_data();
    launch.sent_dropped = sent_dropped.typed_data();
    JAX_EP_RETURN_IF_ERROR(SetLLHandleSlots(kOp, a, &launch, weights, dest_rank, num_dropped));
    return SetLLDispatchOutputs(kOp, a, rows, scales, counts, src_slot, active, &launch);
  };
  return RunLL(kOp, "ll_dispatch_recv", ll_dispatch_recv_counters, stream, device_ordinal, *state,
               rank, group, RecvPhase(token), launch, own);
}

// ll_combine's y [E_local, R * T, H] bf16 (every phase: the receive reads its own rank's rows).
ffi::Error CheckLLCombineY(const char* op, const EPAttrs& a, ffi::AnyBuffer y) {
  const int64_t T = a.num_tokens, H = a.hidden, R = a.num_ranks, local = a.num_experts / R;
  if (y.element_type() != ffi::DataType::BF16) return Invalid(op, "y must be bfloat16");
  JAX_EP_RETURN_IF_ERROR(CheckRowBytes(op, a, kRowBF16));
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
  JAX_EP_RETURN_IF_ERROR(CheckLLCombineY(op, a, y));
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
  JAX_EP_RETURN_IF_ERROR(CheckRowBytes(op, a, kRowBF16));
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
    JAX_EP_RETURN_IF_ERROR(CheckLLCombineSendInputs(kOp, a, y, src_slot));
    JAX_EP_RETURN_IF_ERROR(CheckLLCombineRecvArgs(kOp, a, topk_weights, out));
    JAX_EP_RETURN_IF_ERROR(CheckLLDestRank(kOp, a, dest_rank));
    launch.y = y.untyped_data();
    launch.src_slot = src_slot.typed_data();
    launch.topk_weights = topk_weights.typed_data();
    launch.dest_rank = dest_rank.typed_data();
    launch.out = out->untyped_data();
    return ffi::Error::Success();
  };
  return RunLL(kOp, "ll_combine", ll_combine_counters, stream, device_ordinal, *state, rank,
               group, FusedPhase(rank_mask), launch, own);
}

ffi::Error LLCombineSendImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                             ffi::AnyBuffer y, ffi::Buffer<ffi::S32> src_slot,
                             ffi::Buffer<ffi::S32> rank_mask, ffi::Buffer<ffi::S32> rank,
                             ffi::Buffer<ffi::S32> group, ffi::ResultBuffer<ffi::U32> token) {
  constexpr const char* kOp = kLLCombineSendTarget;
  LLCombineLaunch launch{};
  auto own = [&](const EPAttrs& a) -> ffi::Error {
    JAX_EP_RETURN_IF_ERROR(CheckLLCombineSendInputs(kOp, a, y, src_slot));
    launch.y = y.untyped_data();
    launch.src_slot = src_slot.typed_data();
    return ffi::Error::Success();
  };
  return RunLL(kOp, "ll_combine_send", ll_combine_send_counters, stream, device_ordinal, *state,
               rank, group, SendPhase(token, rank_mask), launch, own);
}

ffi::Error LLCombineRecvImpl(cudaStream_t stream, int32_t device_ordinal, OpState* state,
                             ffi::Buffer<ffi::U32> token, ffi::AnyBuffer y,
                             ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> dest_rank,
                             ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                             ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kOp = kLLCombineRecvTarget;
  LLCombineLaunch launch{};
  auto own = [&](const EPAttrs& a) -> ffi::Error {
    JAX_EP_RETURN_IF_ERROR(CheckLLCombineY(kOp, a, y));
    JAX_EP_RETURN_IF_ERROR(CheckLLCombineRecvArgs(kOp, a, topk_weights, out));
    JAX_EP_RETURN_IF_ERROR(CheckLLDestRank(kOp, a, dest_rank));
    launch.y = y.untyped_data();
    launch.topk_weights = topk_weights.typed_data();
    launch.dest_rank = dest_rank.typed_data();
    launch.out = out->untyped_data();
    return ffi::Error::Success();
  };
  return RunLL(kOp, "ll_combine_recv", ll_combine_recv_counters, stream, device_ordinal, *state,
               rank, group, RecvPhase(token), launch, own);
}

}  // namespace
}  // namespace jax_ep

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
                              (jax_ep::BindDispatchOp()  // x, topk_idx, topk_weights, rank_mask
                                   .Ret<ffi::AnyBuffer>()                    // rows
                                   .Ret<ffi::Buffer<ffi::F32>>()             // scales
                                   .Ret<ffi::Buffer<ffi::S32>>()             // counts
                                   .Ret<ffi::Buffer<ffi::S32>>()             // src_slot
                                   .Ret<ffi::Buffer<ffi::S32>>()             // rank_mask (active)
                                   .Ret<ffi::Buffer<ffi::F32>>()             // topk_weights (handle)
                                   .Ret<ffi::Buffer<ffi::S32>>()             // dest_rank
                                   .Ret<ffi::Buffer<ffi::S32>>()),           // num_dropped
                              {ffi::Traits::kCmdBufferCompatible});

JAX_EP_DEFINE_ASYNC_EXECUTE(JaxEpLLDispatchSend, jax_ep::LLDispatchSendImpl,
                            (jax_ep::BindDispatchOp()  // x, topk_idx, topk_weights, rank_mask
                                 .Ret<ffi::Buffer<ffi::U32>>()             // call token
                                 .Ret<ffi::Buffer<ffi::F32>>()             // topk_weights (sent)
                                 .Ret<ffi::Buffer<ffi::S32>>()             // dest_rank (sent)
                                 .Ret<ffi::Buffer<ffi::S32>>()));          // num_dropped (sent)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLDispatchRecv, jax_ep::LLDispatchRecvImpl,
                              (jax_ep::BindDataOp<ffi::Buffer<ffi::U32>,     // call token
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

JAX_EP_DEFINE_ASYNC_EXECUTE(JaxEpLLCombineSend, jax_ep::LLCombineSendImpl,
                            (jax_ep::BindDataOp<ffi::AnyBuffer,             // y
                                                ffi::Buffer<ffi::S32>,      // src_slot
                                                ffi::Buffer<ffi::S32>>()    // rank_mask
                                 .Ret<ffi::Buffer<ffi::U32>>()));           // call token

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLLCombineRecv, jax_ep::LLCombineRecvImpl,
                              (jax_ep::BindDataOp<ffi::Buffer<ffi::U32>,      // call token
                                                  ffi::AnyBuffer,             // y
                                                  ffi::Buffer<ffi::F32>,      // topk_weights
                                                  ffi::Buffer<ffi::S32>>()    // dest_rank
                                   .Ret<ffi::AnyBuffer>()),                   // out
                              {ffi::Traits::kCmdBufferCompatible});
