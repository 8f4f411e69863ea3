// The XLA FFI handlers exported by jax_ep._C (C symbols, so XLA can also find them by name).
#pragma once

#include <cstdint>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jax_ep {

// FFI target names, as registered with jax.ffi.register_ffi_target(..., platform="CUDA").
inline constexpr const char kDispatchLayoutTarget[] = "jax_ep_dispatch_layout";
inline constexpr const char kPeerSmokeTarget[] = "jax_ep_peer_smoke";
inline constexpr const char kDispatchTarget[] = "jax_ep_dispatch";
inline constexpr const char kCombineTarget[] = "jax_ep_combine";
inline constexpr const char kBroadcastTarget[] = "jax_ep_broadcast";
inline constexpr const char kSlotValuesTarget[] = "jax_ep_slot_values";

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
XLA_FFI_Error* JaxEpDispatch(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombine(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpBroadcast(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpSlotValues(XLA_FFI_CallFrame* call_frame);
}
