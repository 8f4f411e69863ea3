// What the XLA FFI handlers of every family share (xla_ffi/<family>.cc: layout, smoke,
// expert_major, rank_major, low_latency; their kernels are cuda/'s): the call counters, errors, the
// shape and attribute checks, the state a communicating call site keeps, the launch fields every data
// op fills, and the FFI bindings. Defined in handlers.cc.
//
// All handlers are declared command-buffer compatible and keep it true: at execute time they only
// check buffer shapes against the attributes on the host, read lock-free runtime bookkeeping, and
// enqueue kernels on XLA's stream (no host sync, no allocation, no stream query, no host read of
// device data).
//
// The communicating ops (every target but dispatch_layout) have an instantiate stage: when XLA
// instantiates an executable, each call site decodes its attributes once (EPAttrs), computes its
// communication-buffer layout from them (make_comm_layout, the one layout function), reserves that
// much buffer in the runtime and keeps an OpState holding the runtime; the execute stage reads the
// OpState. Who checks what: user errors in Python (jax_ep), buffer shapes against attributes here,
// internal invariants in the launchers/kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda/dispatch.h"
#include "cuda/ep_layout.h"
#include "cuda/group.h"
#include "cuda/remote_rank_major.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/handlers.h"
#include "xla_ffi/runtime.h"

namespace jax_ep {
namespace ffi = xla::ffi;

struct CallCounters {
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> captured_calls{0};
};
// name_counters per target (JAX_EP_TARGETS), defined in handlers.cc
#define JAX_EP_COUNTERS(Name, name) extern CallCounters name##_counters;
JAX_EP_TARGETS(JAX_EP_COUNTERS)
#undef JAX_EP_COUNTERS

ffi::Error CudaError(cudaError_t status, const std::string& op);

// Counts the call, and whether `stream` is being captured into a CUDA graph right now
// (cudaStreamIsCapturing is legal during capture; it does not query execution status).
ffi::Error CountCall(CallCounters& counters, cudaStream_t stream, const char* op);

std::string DimsToString(ffi::Span<const int64_t> dims);

bool IsShape(ffi::Span<const int64_t> dims, std::initializer_list<int64_t> want);

ffi::Error Invalid(const char* op, const std::string& what);

// Returns from the calling handler with the error of `expr` (an ffi::Error) unless it succeeded.
#define JAX_EP_RETURN_IF_ERROR(expr)                                          \
  do {                                                                        \
    if (::xla::ffi::Error jax_ep_error_ = (expr); !jax_ep_error_.success()) { \
      return jax_ep_error_;                                                   \
    }                                                                         \
  } while (0)

// jax_ep's side stream of device `device_ordinal` (Runtime::Side; side_stream.cc): ForkSideStream
// makes it wait for what `stream` (XLA's) has enqueued so far and returns it; JoinSideStream makes
// `stream` wait for what the side stream has enqueued so far. Neither blocks the host.
ffi::Error ForkSideStream(cudaStream_t stream, int32_t device_ordinal, cudaStream_t* side);
ffi::Error JoinSideStream(cudaStream_t stream, int32_t device_ordinal);

// An execute implementation Impl(stream, device_ordinal, rest...) run with its kernels on the side
// stream: Run has Impl's signature, so one binding serves both.
template <auto Impl>
struct OnSideStream;
template <typename... Rest, ffi::Error (*Impl)(cudaStream_t, int32_t, Rest...)>
struct OnSideStream<Impl> {
  static ffi::Error Run(cudaStream_t stream, int32_t device_ordinal, Rest... rest) {
    cudaStream_t side = nullptr;
    JAX_EP_RETURN_IF_ERROR(ForkSideStream(stream, device_ordinal, &side));
    return Impl(side, device_ordinal, rest...);
  }
};

// Reserves the call site's buffer and builds its state; runtime errors become FFI errors.
ffi::ErrorOr<std::unique_ptr<OpState>> MakeState(const char* op, const EPAttrs& attrs,
                                                 const CommLayout& layout,
                                                 std::vector<int64_t> mesh_slots = {});

// Attribute ranges of the data ops. Python builds them (jax_ep.cuda_backend._attrs) after checking
// the user's config, so a failure here is a bug, reported before anything runs.
ffi::Error CheckAttrs(const char* op, const EPAttrs& a);

// The put transport (cuda/remote_rank_major.h) exists for the rank-major ops only, and needs the
// symmetric heap of process model 2; the pull form (kTransportPull) for dispatch and broadcast
// (either layout) only. Python picks them (cuda_backend._transport) and refuses the other cases at
// trace time; this is the check behind it.
ffi::Error CheckTransport(const char* op, const EPAttrs& a, const Runtime& runtime);

// The buffer the call site reserved at instantiation is still there (a shutdown in between frees it;
// then the runtime reports 0 bytes).
ffi::Error CheckBuffer(const char* op, const OpState& state);

// The launch fields every data op shares, from its state and the device it runs on.
ffi::Error PrepareGroup(const char* op, int32_t device_ordinal, const OpState& state,
                        ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group,
                        GroupLaunch* launch);

bool RowKindOf(ffi::DataType dtype, int32_t* kind);

// The rows staged through the buffer must be what the layout was sized for.
ffi::Error CheckRowBytes(const char* op, const EPAttrs& a, int32_t kind);

// The start of combine / broadcast and their rank-major forms: the call counted (CountCall), then
// their rows (`name`: y or g): bfloat16 or float32, the output of the same dtype, and rows of the
// size the layout was made for.
ffi::Error BeginRowsOp(const char* op, CallCounters& counters, cudaStream_t stream,
                       const EPAttrs& a, const char* name, ffi::AnyBuffer data,
                       ffi::DataType out_type, int32_t* kind);

// The rank mask operand of the throughput ops, expert- and rank-major (int32 [R], nonzero =
// active; traced, so a new mask reuses the executable): the kernels read it on the device.
ffi::Error RankMaskOf(const char* op, const OpState& state, ffi::Buffer<ffi::S32> rank_mask,
                      const int32_t** out);

// What dispatch and dispatch_rank_major share: x / rows dtypes, the attributes, the input shapes,
// and the launch fields they both fill. `rows_count` is C (expert-major) or R * T (rank-major).
ffi::Error PrepareDispatch(const char* op, int32_t device_ordinal, const OpState& state,
                           ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                           ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> rank,
                           ffi::Buffer<ffi::S32> group, ffi::Result<ffi::AnyBuffer>& rows,
                           ffi::ResultBuffer<ffi::F32>& scales, int64_t rows_count,
                           ffi::ResultBuffer<ffi::PRED>& is_token_in_rank, DispatchLaunch* launch);

template <const char* kOp>
ffi::ErrorOr<std::unique_ptr<OpState>> DataOpInstantiate(EPAttrs attrs) {
  if (ffi::Error error = CheckAttrs(kOp, attrs); !error.success()) return ffi::Unexpected(error);
  CommLayout layout =
      make_comm_layout(attrs.num_ranks, attrs.num_tokens, attrs.num_topk, attrs.num_experts,
                       static_cast<uint64_t>(attrs.row_bytes), static_cast<uint64_t>(attrs.scale_bytes));
  PutLayout put{};
  if (ffi::Error error = CheckTransport(kOp, attrs, Runtime::Get()); !error.success()) {
    return ffi::Unexpected(error);
  }
  if (attrs.transport == kTransportPut) {
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
inline auto BindPeerOp() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::State<OpState>>();
}

// The execute-stage binding of a data op (dispatch, combine, broadcast, slot_values): the context,
// the op's own inputs, then the rank and group buffers every data op takes last (PrepareGroup): int32
// device scalars (lax.axis_index; never read on the host), from which the kernels discover the
// group's devices themselves. The handler definition adds the results with .Ret<>().
template <typename... Inputs>
auto BindDataOp() {
  return WithArgs<Inputs..., ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>>(BindPeerOp());
}

// The inputs of every dispatch (dispatch, dispatch_rank_major, ll_dispatch, ll_dispatch_send): x,
// topk_idx, topk_weights, rank_mask.
inline auto BindDispatchOp() {
  return BindDataOp<ffi::AnyBuffer, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::F32>,
                    ffi::Buffer<ffi::S32>>();
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

// The execute stage of an op that may run on an XLA stream of its own (KernelConfig.async_stream), as
// two FFI symbols of one implementation: SYMBOL, command-buffer compatible (XLA may capture it into a
// CUDA graph), and SYMBOL##Uncaptured without that trait, the target "<name>_uncaptured"
// (JAX_EP_ASYNC_TARGETS) that the calls on an async stream use. XLA puts an async region into a
// command buffer only when every thunk in it is compatible, and inside one the region runs in series
// with the work around it (openxla/xla#48900; one H200, 2026-12-01: 0.67 ms overlapped without command
// buffers, none with them); with an uncaptured call in it the region runs on its own stream.
//
// And a third, SYMBOL##Side, the target "<name>_side": the same op with its kernels on jax_ep's side
// stream of the device (ForkSideStream), after everything XLA enqueued before it; its results are
// final only after the jax_ep_side_join that jax_ep.overlap places after the work it runs beside.
// XLA's own async streams overlap nothing here: with jax 0.11.2 its schedule puts the async start
// right before its done, the latency-hiding scheduler and a scheduling group included (one H200,
// 2026-12-02, tools/overlap_probe.py --dump).
#define JAX_EP_DEFINE_ASYNC_EXECUTE(SYMBOL, IMPL, BINDING)                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYMBOL, IMPL, BINDING, {xla::ffi::Traits::kCmdBufferCompatible}); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYMBOL##Uncaptured, IMPL, BINDING);                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYMBOL##Side, jax_ep::OnSideStream<IMPL>::Run, BINDING)

// The instantiate stage of a data op (DataOpInstantiate) as the FFI symbol SYMBOL of target TARGET.
#define JAX_EP_DATA_OP_INSTANTIATE(SYMBOL, TARGET)                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYMBOL, jax_ep::DataOpInstantiate<jax_ep::TARGET>,  \
                                xla::ffi::Ffi::BindInstantiate().Attrs<jax_ep::EPAttrs>())
