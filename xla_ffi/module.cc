// jax_ep._C: FFI handler capsules and the per-device runtime.
//
// Importing the module makes no CUDA call (it must import on machines without a GPU); every CUDA
// call happens inside the functions below.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <vector>

#include "cuda/device_state.h"
#include "cuda/ep_layout.h"
#include "xla/ffi/api/c_api.h"
#include "xla_ffi/handlers.h"
#include "xla_ffi/runtime.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

nb::capsule HandlerCapsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  // Unnamed capsule around the XLA_FFI_Handler*, what jax.ffi.register_ffi_target expects.
  return nb::capsule(reinterpret_cast<void*>(handler));
}

nb::dict FaultToDict(const jax_ep::FaultInfo& fault) {
  nb::dict entry;
  entry["kind"] = fault.kind;
  entry["op"] = fault.op;
  entry["device_ordinal"] = fault.device_ordinal;
  entry["rank"] = fault.rank;
  entry["waited_rank"] = fault.waited_rank;
  entry["waited_ordinal"] = fault.waited_ordinal;
  entry["expected"] = fault.expected;
  entry["observed"] = fault.observed;
  entry["elapsed_s"] = static_cast<double>(fault.elapsed_ns) * 1e-9;
  entry["message"] = fault.message;
  return entry;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "jax_ep native part: XLA FFI handlers (CUDA) and the per-device runtime.";

  m.attr("FFI_API_VERSION") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("MAX_DEVICES") = jax_ep::kMaxDevices;

  m.def(
      "ffi_handlers",
      [] {
        nb::dict handlers;
        handlers[jax_ep::kDispatchLayoutTarget] = HandlerCapsule(JaxEpDispatchLayout);
        handlers[jax_ep::kPeerSmokeTarget] = HandlerCapsule(JaxEpPeerSmoke);
        handlers[jax_ep::kDispatchTarget] = HandlerCapsule(JaxEpDispatch);
        handlers[jax_ep::kCombineTarget] = HandlerCapsule(JaxEpCombine);
        handlers[jax_ep::kBroadcastTarget] = HandlerCapsule(JaxEpBroadcast);
        handlers[jax_ep::kSlotValuesTarget] = HandlerCapsule(JaxEpSlotValues);
        return handlers;
      },
      "{FFI target name: capsule of its XLA_FFI_Handler*} for jax.ffi.register_ffi_target "
      "(platform='CUDA').");

  m.attr("MAX_TOPK") = jax_ep::kMaxTopk;
  m.attr("MAX_EXPERTS") = jax_ep::kMaxExperts;
  m.attr("MAX_GROUPS") = jax_ep::kMaxGroups;
  m.attr("DIRECTORY_AXES") = jax_ep::kDirectoryAxes;

  m.def(
      "comm_bytes",
      [](int64_t num_ranks, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
         uint64_t data_row_bytes, uint64_t scale_row_bytes) {
        return jax_ep::make_comm_layout(num_ranks, num_tokens, num_topk, num_experts,
                                        data_row_bytes, scale_row_bytes)
            .total;
      },
      "num_ranks"_a, "num_tokens"_a, "num_topk"_a, "num_experts"_a, "data_row_bytes"_a,
      "scale_row_bytes"_a,
      "Bytes of communication buffer the EP ops need for these sizes (data_row_bytes: bytes of a "
      "staged row; scale_row_bytes: FP8 scale bytes per row, 0 without FP8).");

  m.def(
      "init",
      [](const std::vector<int>& device_ordinals, uint64_t buffer_bytes) {
        nb::gil_scoped_release release;  // may synchronise devices
        jax_ep::Runtime::Get().Init(device_ordinals, buffer_bytes);
      },
      "device_ordinals"_a, "buffer_bytes"_a,
      "Manage these local GPUs: communication buffer of >= buffer_bytes each, peer access "
      "between all pairs, device-side peer tables. Idempotent; grows buffers only if needed "
      "(synchronising every managed GPU first). Raises RuntimeError naming the GPU pair when "
      "peer access is impossible. Reads JAX_EP_TIMEOUT_S (seconds, default 10).");

  m.def(
      "shutdown",
      [] {
        nb::gil_scoped_release release;
        jax_ep::Runtime::Get().Shutdown();
      },
      "Synchronise managed GPUs and free the communication buffers. Compiled computations that "
      "use EP ops must not run afterwards (they trap with a clear message) until init() again.");

  m.def("managed_devices", [] { return jax_ep::Runtime::Get().ManagedDevices(); },
        "Ordinals of the GPUs the runtime manages (empty before init / after shutdown).");
  m.def("buffer_bytes", [] { return jax_ep::Runtime::Get().CommBytes(); },
        "Bytes of each communication buffer (0 before init / after shutdown).");
  m.def("timeout_seconds", [] { return jax_ep::Runtime::Get().TimeoutSeconds(); },
        "Timeout of device-side spin-waits set by the last init (0 before init).");
  m.def("device_count", &jax_ep::Runtime::DeviceCount,
        "CUDA devices visible to this process; raises RuntimeError when CUDA has none.");
  m.def("peer_access_matrix", &jax_ep::Runtime::PeerAccessMatrix, "device_ordinals"_a,
        "m[i][j]: GPU device_ordinals[i] can access the memory of GPU device_ordinals[j] "
        "(cudaDeviceCanAccessPeer; True on the diagonal).");
  m.def(
      "handler_stats",
      [] {
        nb::dict stats;
        for (const auto& entry : jax_ep::GetHandlerStats()) {
          nb::dict counts;
          counts["calls"] = entry.calls;
          counts["captured_calls"] = entry.captured_calls;
          stats[entry.target] = counts;
        }
        return stats;
      },
      "{FFI target: {'calls', 'captured_calls'}}: how often each handler ran in this process, and "
      "how often XLA was capturing it into a CUDA graph then (replays do not run handlers).");

  m.def(
      "faults",
      [] {
        nb::list faults;
        for (const auto& fault : jax_ep::Runtime::Get().Faults()) {
          faults.append(FaultToDict(fault));
        }
        return faults;
      },
      "Device-side faults recorded by kernels (timeouts, stale runtime), one dict per GPU that "
      "faulted: kind, op, device_ordinal, rank, waited_rank, waited_ordinal, expected, observed, "
      "elapsed_s, message. Readable after the fault has killed the CUDA context.");
}
