// The XLA FFI handlers exported by jax_ep._C (C symbols, so XLA can also find them by name).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/ep_layout.h"
#include "cuda/remote_rank_major.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/runtime.h"

namespace jax_ep {

// Every FFI target, the one list (adding an op adds its line here): X(Name, name) is the target
// "jax_ep_<name>" (kNameTarget), its execute handler JaxEp<Name>, its call counters (handlers.cc) and
// its entry in jax_ep._C.ffi_handlers() / handler_stats(), which jax_ep.runtime registers with XLA
// (platform CUDA). The stateful targets also have an instantiate stage, JaxEp<Name>Instantiate, that
// makes the call site's OpState.
#define JAX_EP_STATELESS_TARGETS(X) \
  X(DispatchLayout, dispatch_layout) \
  X(SideJoin, side_join)
#define JAX_EP_STATEFUL_TARGETS(X) \
  X(PeerSmoke, peer_smoke) \
  X(Dispatch, dispatch) \
  X(Combine, combine) \
  X(Broadcast, broadcast) \
  X(CombineBwd, combine_bwd) \
  X(SlotValues, slot_values) \
  X(RemoteSmoke, remote_smoke) \
  X(LLDispatch, ll_dispatch) \
  X(LLCombine, ll_combine) \
  X(LLDispatchSend, ll_dispatch_send) \
  X(LLDispatchRecv, ll_dispatch_recv) \
  X(LLCombineSend, ll_combine_send) \
  X(LLCombineRecv, ll_combine_recv) \
  X(DispatchRankMajor, dispatch_rank_major) \
  X(CombineRankMajor, combine_rank_major) \
  X(BroadcastRankMajor, broadcast_rank_major)
#define JAX_EP_TARGETS(X) JAX_EP_STATELESS_TARGETS(X) JAX_EP_STATEFUL_TARGETS(X)
// The stateful targets a call may put on an XLA stream of its own (KernelConfig.async_stream): each
// also has the target "jax_ep_<name>_uncaptured" (kNameUncapturedTarget), the same op with the same
// instantiate stage and counters, whose execute handler JaxEp<Name>Uncaptured XLA never captures into
// a command buffer (handler_util.h, JAX_EP_DEFINE_ASYNC_EXECUTE, says why), and the target
// "jax_ep_<name>_side" (kNameSideTarget, handler JaxEp<Name>Side, never captured either): the op on
// jax_ep's side stream (jax_ep.overlap).
#define JAX_EP_ASYNC_TARGETS(X) \
  X(Dispatch, dispatch) \
  X(Combine, combine) \
  X(Broadcast, broadcast) \
  X(CombineBwd, combine_bwd) \
  X(SlotValues, slot_values) \
  X(LLDispatchSend, ll_dispatch_send) \
  X(LLCombineSend, ll_combine_send) \
  X(DispatchRankMajor, dispatch_rank_major) \
  X(CombineRankMajor, combine_rank_major) \
  X(BroadcastRankMajor, broadcast_rank_major)

#define JAX_EP_TARGET_NAME(Name, name) inline constexpr const char k##Name##Target[] = "jax_ep_" #name;
JAX_EP_TARGETS(JAX_EP_TARGET_NAME)
#undef JAX_EP_TARGET_NAME
#define JAX_EP_UNCAPTURED_NAME(Name, name) \
  inline constexpr const char k##Name##UncapturedTarget[] = "jax_ep_" #name "_uncaptured";
JAX_EP_ASYNC_TARGETS(JAX_EP_UNCAPTURED_NAME)
#undef JAX_EP_UNCAPTURED_NAME
#define JAX_EP_SIDE_NAME(Name, name) inline constexpr const char k##Name##SideTarget[] = "jax_ep_" #name "_side";
JAX_EP_ASYNC_TARGETS(JAX_EP_SIDE_NAME)
#undef JAX_EP_SIDE_NAME

// Static attributes of the EP data ops (dispatch, combine, broadcast, slot_values and the
// rank-major ones; combine_rank_major / broadcast_rank_major have num_topk 1), one struct for all
// (fields an op does not use are 0); built by jax_ep.cuda_backend._attrs. Alphabetical: the FFI
// decodes the attribute dictionary into the fields in this order.
struct EPAttrs {
  int64_t alignment;    // dispatch: expert_alignment
  int64_t axis_slot;    // directory slot of the EP axis
  int64_t bulk_copy;    // dispatch, broadcast, combine_bwd: rows moved by bulk (TMA) copies
  int64_t capacity;     // dispatch, broadcast, combine_bwd: receive rows C
  int64_t hidden;       // H
  int64_t num_experts;  // dispatch: E
  int64_t num_ranks;    // R
  int64_t num_sms;      // blocks of the data kernel (clamped below the SM count)
  int64_t num_tokens;   // T (tokens per rank)
  int64_t num_topk;     // K
  int64_t row_bytes;    // bytes of a row staged through the buffer
  int64_t scale_bytes;  // dispatch FP8: scale bytes per row
  int64_t send_warps;   // warps per block that send / reduce
  int64_t shrink;       // mask a peer that misses a bounded wait (EPConfig.shrink; not over puts)
  int64_t transport;    // a Transport (cuda/fingerprint.h; cuda_backend._transport picks it per
                        // call site): kTransportPut for the rank-major ops only
};

// What an instantiated call site keeps (FFI state, instantiate stage; XLA deletes it with the
// executable): its attributes, its buffer layout, and the runtime, held (Runtime::Shutdown refuses
// while any OpState lives).
struct OpState {
  static xla::ffi::TypeId id;  // registered with jax.ffi.register_ffi_type
  std::shared_ptr<Runtime> runtime;
  EPAttrs attrs;
  CommLayout layout;   // layout.total: what the call site reserved (the put layout's, with puts)
  PutLayout put_layout;  // transport == kTransportPut: the rank-major ops' put layout
  std::vector<int64_t> mesh_slots;  // peer_smoke, remote_smoke: the mesh's slots, EP axis last
};

// How often each handler ran, and how often XLA was capturing it into a CUDA graph (command
// buffer) at the time. A graph replay does not run the handler, so calls stop growing once XLA
// replays. Diagnostics for tests and debugging.
struct HandlerStats {
  const char* target;
  uint64_t calls;
  uint64_t captured_calls;
};
std::vector<HandlerStats> GetHandlerStats();

}  // namespace jax_ep

extern "C" {
#define JAX_EP_DECLARE_EXECUTE(Name, name) XLA_FFI_Error* JaxEp##Name(XLA_FFI_CallFrame* call_frame);
#define JAX_EP_DECLARE_INSTANTIATE(Name, name) \
  XLA_FFI_Error* JaxEp##Name##Instantiate(XLA_FFI_CallFrame* call_frame);
#define JAX_EP_DECLARE_UNCAPTURED(Name, name) \
  XLA_FFI_Error* JaxEp##Name##Uncaptured(XLA_FFI_CallFrame* call_frame);
JAX_EP_TARGETS(JAX_EP_DECLARE_EXECUTE)
JAX_EP_STATEFUL_TARGETS(JAX_EP_DECLARE_INSTANTIATE)
JAX_EP_ASYNC_TARGETS(JAX_EP_DECLARE_UNCAPTURED)
#define JAX_EP_DECLARE_SIDE(Name, name) XLA_FFI_Error* JaxEp##Name##Side(XLA_FFI_CallFrame* call_frame);
JAX_EP_ASYNC_TARGETS(JAX_EP_DECLARE_SIDE)
#undef JAX_EP_DECLARE_SIDE
#undef JAX_EP_DECLARE_EXECUTE
#undef JAX_EP_DECLARE_INSTANTIATE
#undef JAX_EP_DECLARE_UNCAPTURED
}
