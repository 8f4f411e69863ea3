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

// FFI target names, as registered with jax.ffi.register_ffi_target(..., platform="CUDA").
inline constexpr const char kDispatchLayoutTarget[] = "jax_ep_dispatch_layout";
inline constexpr const char kPeerSmokeTarget[] = "jax_ep_peer_smoke";
inline constexpr const char kDispatchTarget[] = "jax_ep_dispatch";
inline constexpr const char kCombineTarget[] = "jax_ep_combine";
inline constexpr const char kBroadcastTarget[] = "jax_ep_broadcast";
inline constexpr const char kCombineBwdTarget[] = "jax_ep_combine_bwd";
inline constexpr const char kSlotValuesTarget[] = "jax_ep_slot_values";
inline constexpr const char kRemoteSmokeTarget[] = "jax_ep_remote_smoke";
inline constexpr const char kLLDispatchTarget[] = "jax_ep_ll_dispatch";
inline constexpr const char kLLCombineTarget[] = "jax_ep_ll_combine";
inline constexpr const char kLLDispatchSendTarget[] = "jax_ep_ll_dispatch_send";
inline constexpr const char kLLDispatchRecvTarget[] = "jax_ep_ll_dispatch_recv";
inline constexpr const char kLLCombineSendTarget[] = "jax_ep_ll_combine_send";
inline constexpr const char kLLCombineRecvTarget[] = "jax_ep_ll_combine_recv";
inline constexpr const char kDispatchRankMajorTarget[] = "jax_ep_dispatch_rank_major";
inline constexpr const char kCombineRankMajorTarget[] = "jax_ep_combine_rank_major";
inline constexpr const char kBroadcastRankMajorTarget[] = "jax_ep_broadcast_rank_major";

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
XLA_FFI_Error* JaxEpDispatchLayout(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpPeerSmoke(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpPeerSmokeInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpRemoteSmoke(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpRemoteSmokeInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpDispatchInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombineInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpBroadcastInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombineBwdInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpSlotValuesInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpDispatch(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombine(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpBroadcast(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombineBwd(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpSlotValues(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLDispatchInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLCombineInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLDispatch(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLCombine(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLDispatchSendInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLDispatchRecvInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLCombineSendInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLCombineRecvInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLDispatchSend(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLDispatchRecv(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLCombineSend(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLCombineRecv(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpDispatchRankMajorInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombineRankMajorInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpBroadcastRankMajorInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpDispatchRankMajor(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombineRankMajor(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpBroadcastRankMajor(XLA_FFI_CallFrame* call_frame);
}
