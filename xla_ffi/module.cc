// jax_ep._C: FFI handler capsules and the per-device runtime.
//
// Importing the module makes no CUDA call (it must import on machines without a GPU); every CUDA
// call happens inside the functions below.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/device_state.h"
#include "cuda/ep_layout.h"
#include "cuda/layout.h"
#include "cuda/low_latency.h"
#include "cuda/remote.h"
#include "cuda/remote_rank_major.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/device_memory.h"
#include "xla_ffi/fault_message.h"
#include "xla_ffi/handlers.h"
#include "xla_ffi/runtime.h"
#include "xla_ffi/symmetric_heap.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using Handler = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);

nb::capsule HandlerCapsule(Handler handler) {
  // Unnamed capsule around the XLA_FFI_Handler*, what jax.ffi.register_ffi_target expects.
  return nb::capsule(reinterpret_cast<void*>(handler));
}

// {"instantiate": ..., "execute": ...}: a handler bundle with an instantiate stage.
nb::dict StatefulHandler(Handler instantiate, Handler execute) {
  nb::dict stages;
  stages["instantiate"] = HandlerCapsule(instantiate);
  stages["execute"] = HandlerCapsule(execute);
  return stages;
}

const XLA_FFI_TypeInfo kOpStateTypeInfo = xla::ffi::MakeTypeInfo<jax_ep::OpState>();

nb::dict FaultToDict(const jax_ep::FaultInfo& fault) {
  nb::dict entry;
  entry["kind"] = fault.kind;
  entry["op"] = fault.op;
  entry["field"] = fault.field;
  const jax_ep::FaultRecord& r = fault.record;
  entry["device_ordinal"] = r.device_ordinal;
  entry["rank"] = r.rank;
  entry["waited_rank"] = r.waited_rank;
  entry["waited_ordinal"] = r.waited_ordinal;
  entry["expected"] = r.expected;
  entry["observed"] = r.observed;
  entry["elapsed_s"] = static_cast<double>(r.elapsed_ns) * 1e-9;
  entry["message"] = fault.message;
  return entry;
}

// The id whose name(id) is `name`, among ids [0, count); throws naming `what` otherwise.
int32_t IdOfName(const char* (*name)(int32_t), int32_t count, const std::string& wanted,
                 const char* what) {
  for (int32_t id = 0; id < count; ++id) {
    if (wanted == name(id)) return id;
  }
  throw std::invalid_argument(std::string("unknown ") + what + " '" + wanted + "'");
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "jax_ep native part: XLA FFI handlers (CUDA) and the per-device runtime.";

  m.attr("FFI_API_VERSION") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("MAX_DEVICES") = jax_ep::kMaxDevices;

  // Raised (by init, init_process_group, check_buffer_fits) when jax_ep's GPU memory does not fit
  // beside XLA's; re-exported as jax_ep.runtime.DeviceMemoryError. A subclass of
  // jax_ep.errors.DeviceMemoryError (an EPError and a RuntimeError), so that either name catches it.
  nb::object memory_error_base = nb::module_::import_("jax_ep.errors").attr("DeviceMemoryError");
  nb::exception<jax_ep::DeviceMemoryError>(m, "DeviceMemoryError", memory_error_base.ptr());

  m.def(
      "device_memory_message",
      [](const std::string& buffer, int device_ordinal, uint64_t bytes_needed, uint64_t free_bytes,
         uint64_t total_bytes, uint64_t held_bytes, uint64_t heap_bytes, const std::string& kind,
         const std::string& cause, const std::map<std::string, std::string>& env,
         const std::vector<std::map<std::string, int64_t>>& processes, int group_size,
         bool heap_starting, bool heap_dynamic, uint64_t heap_granularity) {
        jax_ep::DeviceMemoryReport report;
        report.buffer = buffer;
        if (kind == "cuda_malloc") {
          report.kind = jax_ep::MemoryKind::kCudaMalloc;
        } else if (kind == "symmetric_heap") {
          report.kind = jax_ep::MemoryKind::kSymmetricHeap;
        } else if (kind == "heap_reservation") {
          report.kind = jax_ep::MemoryKind::kHeapReservation;
        } else if (kind == "heap_growth") {
          report.kind = jax_ep::MemoryKind::kHeapGrowth;
          if (processes.empty()) {
            throw std::invalid_argument("kind 'heap_growth' needs the processes that lack room");
          }
        } else {
          throw std::invalid_argument("kind must be 'cuda_malloc', 'symmetric_heap', "
                                      "'heap_reservation' or 'heap_growth', got '" + kind + "'");
        }
        for (const auto& entry : processes) {
          const auto field = [&entry](const char* name) -> int64_t {
            const auto found = entry.find(name);
            if (found == entry.end() || found->second < 0) {
              throw std::invalid_argument(std::string("each of processes needs a non-negative '") +
                                          name + "'");
            }
            return found->second;
          };
          jax_ep::ProcessRoom room;
          room.process = static_cast<int>(field("process"));
          room.device_ordinal = static_cast<int>(field("gpu"));
          room.heap_bytes = static_cast<uint64_t>(field("heap_bytes"));
          room.margin_bytes = static_cast<uint64_t>(field("margin"));
          room.free_bytes = static_cast<uint64_t>(field("free"));
          room.total_bytes = static_cast<uint64_t>(field("total"));
          report.processes.push_back(room);
        }
        report.group_size = group_size;
        report.heap_starting = heap_starting;
        report.heap_dynamic = heap_dynamic;
        report.heap_granularity = heap_granularity;
        report.device_ordinal = device_ordinal;
        report.bytes_needed = bytes_needed;
        report.memory_known = true;
        report.free_bytes = free_bytes;
        report.total_bytes = total_bytes;
        report.held_bytes = held_bytes;
        report.heap_bytes = heap_bytes;
        report.cause = cause;
        report.env = env;
        return jax_ep::DeviceMemoryMessage(report);
      },
      "buffer"_a, "device_ordinal"_a, "bytes_needed"_a, "free_bytes"_a, "total_bytes"_a,
      "held_bytes"_a = 0, "heap_bytes"_a = 0, "kind"_a = "cuda_malloc", "cause"_a = "",
      "env"_a = std::map<std::string, std::string>(),
      "processes"_a = std::vector<std::map<std::string, int64_t>>(), "group_size"_a = 0,
      "heap_starting"_a = false, "heap_dynamic"_a = true, "heap_granularity"_a = 0,
      "The text of DeviceMemoryError for these numbers (what the runtime raises with cudaMemGetInfo "
      "and os.environ filled in). env: MEMORY_ENV_VARS as set. kind='heap_growth' (process model "
      "2, the collective check before NVSHMEM grows its heap): processes = [{process, gpu, "
      "heap_bytes, margin, free, total}] of the processes lacking room, group_size, and how the "
      "heap takes memory (heap_starting, heap_dynamic, heap_granularity); device_ordinal, "
      "free_bytes and total_bytes are then not used.");
  {
    nb::list names;
    for (const char* name : jax_ep::kMemoryEnvVars) names.append(name);
    m.attr("MEMORY_ENV_VARS") = nb::tuple(names);
  }
  m.def(
      "heap_device_bytes",
      [](bool starting, uint64_t allocation_bytes, bool dynamic, uint64_t granularity,
         uint64_t static_heap_bytes, bool on_device) {
        jax_ep::HeapShape shape;
        shape.on_device = on_device;
        shape.dynamic = dynamic;
        shape.granularity = granularity;
        return jax_ep::HeapDeviceBytes(shape, starting, static_heap_bytes, allocation_bytes);
      },
      "starting"_a, "allocation_bytes"_a, "dynamic"_a = true, "granularity"_a = 512ull << 20,
      "static_heap_bytes"_a = 0, "on_device"_a = true,
      "Bytes NVSHMEM's symmetric heap takes from the GPU for one set-up step (pure; "
      "xla_ffi/device_memory.h, HeapDeviceBytes): NVSHMEM `starting` in it or not, then an "
      "allocation of allocation_bytes on the heap.");
  m.def(
      "memory_info",
      [](int device_ordinal) {
        const auto [free_bytes, total_bytes] = jax_ep::DeviceMemoryInfo(device_ordinal);
        return nb::make_tuple(free_bytes, total_bytes);
      },
      "device_ordinal"_a,
      "(free, total) bytes of a GPU (cudaMemGetInfo): the room jax_ep's buffers have beside XLA.");
  m.def("format_bytes", &jax_ep::FormatBytes, "bytes"_a,
        "'1.50 GiB (1610612736 bytes)': how jax_ep's messages write a size.");
  m.def("nvshmem_size_bytes", &jax_ep::symmetric_heap::ParseSize, "text"_a,
        "Bytes of an NVSHMEM size setting such as NVSHMEM_SYMMETRIC_SIZE ('2G', '512m', "
        "'1073741824'); 0 when unreadable.");

  m.def(
      "ffi_handlers",
      [] {
        nb::dict handlers;
#define JAX_EP_STATELESS(Name, name) handlers[jax_ep::k##Name##Target] = HandlerCapsule(JaxEp##Name);
#define JAX_EP_STATEFUL(Name, name) \
  handlers[jax_ep::k##Name##Target] = StatefulHandler(JaxEp##Name##Instantiate, JaxEp##Name);
#define JAX_EP_UNCAPTURED(Name, name)               \
  handlers[jax_ep::k##Name##UncapturedTarget] = \
      StatefulHandler(JaxEp##Name##Instantiate, JaxEp##Name##Uncaptured);
#define JAX_EP_SIDE(Name, name) \
  handlers[jax_ep::k##Name##SideTarget] = StatefulHandler(JaxEp##Name##Instantiate, JaxEp##Name##Side);
        JAX_EP_STATELESS_TARGETS(JAX_EP_STATELESS)
        JAX_EP_STATEFUL_TARGETS(JAX_EP_STATEFUL)
        JAX_EP_ASYNC_TARGETS(JAX_EP_UNCAPTURED)
        JAX_EP_ASYNC_TARGETS(JAX_EP_SIDE)
#undef JAX_EP_STATELESS
#undef JAX_EP_STATEFUL
#undef JAX_EP_UNCAPTURED
#undef JAX_EP_SIDE
        return handlers;
      },
      "{FFI target name: capsule of its XLA_FFI_Handler*, or {stage: capsule} for the ops with an "
      "instantiate stage} for jax.ffi.register_ffi_target (platform='CUDA'); the ops a call may put "
      "on an XLA stream of its own also as '<target>_uncaptured', kept out of command buffers, and as "
      "'<target>_side', on jax_ep's side stream (jax_ep.overlap).");

  m.def(
      "state_type",
      [] {
        nb::dict registration;
        registration["type_id"] = nb::capsule(reinterpret_cast<void*>(&jax_ep::OpState::id));
        registration["type_info"] =
            nb::capsule(reinterpret_cast<void*>(const_cast<XLA_FFI_TypeInfo*>(&kOpStateTypeInfo)));
        return registration;
      },
      "The FFI state type of the communicating ops, for jax.ffi.register_ffi_type "
      "(platform='CUDA').");

  // The kernels' limits; jax_ep.cuda_backend checks a user's config against these, never copies.
  nb::dict limits;
  limits["max_topk"] = jax_ep::kMaxTopk;
  limits["layout_max_topk"] = jax_ep::dispatch_layout_max_topk();
  limits["max_experts"] = jax_ep::kMaxExperts;
  limits["max_ranks"] = jax_ep::kMaxGroupRanks;
  limits["max_groups"] = jax_ep::kMaxGroups;
  limits["directory_axes"] = jax_ep::kDirectoryAxes;
  limits["data_warps"] = jax_ep::kBlockWarps;
  limits["row_alignment"] = jax_ep::kRowAlignment;
  limits["max_rows"] = jax_ep::kMaxRows;      // capacity and EP size x tokens (int32 handle fields)
  limits["max_hidden"] = jax_ep::kMaxHidden;
  limits["fp8_block"] = jax_ep::kFp8Block;
  limits["fp8_min_amax"] = jax_ep::kFp8MinAmax;
  // the low-latency kernels: tokens per rank (16-bit counts) and their dynamic shared memory
  limits["ll_max_tokens"] = jax_ep::kLLMaxTokens;
  limits["ll_max_shared_bytes"] = jax_ep::kLLMaxSharedBytes;
  m.attr("LIMITS") = limits;

  m.def(
      "ll_shared_bytes",
      [](bool dispatch, int64_t num_ranks, int64_t num_tokens, int64_t num_experts) {
        return jax_ep::ll_shared_bytes(dispatch, num_ranks, num_tokens, num_experts);
      },
      "dispatch"_a, "num_ranks"_a, "num_tokens"_a, "num_experts"_a,
      "Dynamic shared memory of a low-latency kernel (dispatch: with its expert x token routing "
      "table), 0 where the sizes are out of range; it must not exceed LIMITS['ll_max_shared_bytes'].");

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
      "put_comm_bytes",
      [](int64_t num_ranks, int64_t num_tokens, int64_t num_topk, uint64_t row_bytes,
         uint64_t scale_bytes, bool dispatch) {
        return jax_ep::make_put_layout(num_ranks, num_tokens, dispatch ? num_topk : 0, row_bytes,
                                       scale_bytes, dispatch)
            .total;
      },
      "num_ranks"_a, "num_tokens"_a, "num_topk"_a, "row_bytes"_a, "scale_bytes"_a, "dispatch"_a,
      "Bytes of communication buffer a rank-major op needs with the NVSHMEM put transport "
      "(cuda/remote_rank_major.h; dispatch: dispatch_rank_major's records with ids, weights and "
      "source slot, else combine_rank_major / broadcast_rank_major rows).");

  m.def(
      "ll_comm_bytes",
      [](int64_t num_ranks, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
         int64_t hidden, uint64_t row_bytes, uint64_t scale_bytes) {
        return jax_ep::make_ll_layout(num_ranks, num_tokens, num_topk, num_experts, hidden,
                                      row_bytes, scale_bytes)
            .base.total;
      },
      "num_ranks"_a, "num_tokens"_a, "num_topk"_a, "num_experts"_a, "hidden"_a, "row_bytes"_a,
      "scale_bytes"_a,
      "Bytes of communication buffer the low-latency ops need (row_bytes: a dispatched row; "
      "scale_bytes: its FP8 scales, 0 for bf16).");

  m.def(
      "remote_smoke_comm_bytes",
      [](int64_t group_size, int64_t n) { return jax_ep::remote_smoke_comm_bytes(group_size, n); },
      "group_size"_a, "n"_a,
      "Bytes of communication buffer remote_smoke needs for a group of group_size ranks and n "
      "values per rank (what its instantiation reserves).");

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
      "peer access is impossible. Reads JAX_EP_TIMEOUT_S (seconds, default 10; process model 2: "
      "100).");

  m.def(
      "check_buffer_fits",
      [](uint64_t buffer_bytes) {
        nb::gil_scoped_release release;
        jax_ep::Runtime::Get().CheckBufferFits(buffer_bytes);
      },
      "buffer_bytes"_a,
      "Process model 1: raise DeviceMemoryError if growing the communication buffers to "
      "buffer_bytes cannot fit in a managed GPU's free memory now (allocates nothing). What "
      "jax_ep.runtime.reserve checks when an op is traced.");

  m.def(
      "nvshmem_unique_id",
      [] {
        const std::vector<uint8_t> id = jax_ep::symmetric_heap::NewUniqueId();
        return nb::bytes(reinterpret_cast<const char*>(id.data()), id.size());
      },
      "A fresh NVSHMEM unique id (process 0 of process model 2 makes it and publishes it).");

  m.def(
      "init_process_group",
      [](int device_ordinal, nb::bytes unique_id, int process, int num_processes,
         uint64_t buffer_bytes) {
        const auto* data = static_cast<const uint8_t*>(unique_id.data());
        std::vector<uint8_t> id(data, data + unique_id.size());
        nb::gil_scoped_release release;  // collective: waits for the other processes
        jax_ep::Runtime::Get().InitProcessGroup(device_ordinal, id, process, num_processes,
                                                buffer_bytes);
      },
      "device_ordinal"_a, "unique_id"_a, "process"_a, "num_processes"_a, "buffer_bytes"_a,
      "Process model 2 (collective, every process, same order and sizes): join NVSHMEM as PE "
      "`process` (the JAX process index) of `num_processes` on GPU `device_ordinal`, put the state "
      "and a communication buffer of >= buffer_bytes on the symmetric heap, tables of every PE "
      "reachable by loads/stores. A later call grows the buffer if needed.");

  m.def(
      "plan_process_group",
      [](uint64_t buffer_bytes) {
        const jax_ep::Runtime::ProcessGroupPlan plan =
            jax_ep::Runtime::Get().PlanProcessGroup(buffer_bytes);
        nb::dict out;
        out["first"] = plan.first;
        out["nvshmem_starting"] = plan.nvshmem_starting;
        out["buffer"] = plan.buffer_bytes;
        out["held"] = plan.held_bytes;
        out["heap_on_device"] = plan.shape.on_device;
        out["heap_dynamic"] = plan.shape.dynamic;
        out["heap_granularity"] = plan.shape.granularity;
        out["heap_bytes"] = plan.device_bytes;
        return out;
      },
      "buffer_bytes"_a,
      "Process model 2: what init_process_group(.., buffer_bytes) would do on this process, "
      "without doing it (no CUDA call, nothing collective): {first, nvshmem_starting, buffer, "
      "held, heap_on_device, heap_dynamic, heap_granularity, heap_bytes: what NVSHMEM would "
      "take from the GPU's free memory (0: none)}.");

  m.def(
      "finalize_process_group",
      [] {
        nb::gil_scoped_release release;
        jax_ep::Runtime::Get().FinalizeProcessGroup();
      },
      "Process model 2 at exit (collective): free the symmetric buffers, finalise NVSHMEM if "
      "jax_ep initialised it.");

  m.def(
      "runtime_holders", [] { return jax_ep::Runtime::Holders(); },
      "How many instantiated EP call sites of live executables hold the runtime (shutdown and the "
      "process model 2 teardown refuse while any does).");

  m.def(
      "process_group",
      [] {
        const jax_ep::Runtime& runtime = jax_ep::Runtime::Get();
        nb::dict info;
        const jax_ep::ProcessModel model = runtime.Model();
        info["model"] = model == jax_ep::ProcessModel::kProcessPerGpu ? "process_per_gpu"
                        : model == jax_ep::ProcessModel::kLocalPeers  ? "local_peers"
                                                                      : "none";
        info["pe"] = runtime.Pe();
        info["num_pes"] = runtime.NumPes();
        info["reachable_pes"] = runtime.ReachablePes();
        return info;
      },
      "{'model': 'none' | 'local_peers' | 'process_per_gpu', 'pe', 'num_pes', 'reachable_pes'}.");

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
      "rank_masks",
      [] {
        std::vector<jax_ep::RankMaskInfo> infos;
        {
          // synchronises every managed GPU: a kernel waiting for a peer would hold Python (the fault
          // watcher too) up to its timeout
          nb::gil_scoped_release release;
          infos = jax_ep::Runtime::Get().RankMasks();
        }
        nb::list masks;
        for (const auto& info : infos) {
          nb::dict entry;
          entry["device_ordinal"] = info.device_ordinal;
          entry["axis_slot"] = info.axis_slot;
          entry["group"] = info.group;
          entry["rank"] = info.rank;
          entry["masked_rank"] = info.masked_rank;
          entry["op"] = info.op;
          entry["during"] = info.during;
          entry["epoch"] = info.epoch;
          masks.append(entry);
        }
        return masks;
      },
      "The persistent rank masks (shrink mode), one dict per (GPU, EP group, masked rank): "
      "device_ordinal, axis_slot, group, rank (the GPU's own), masked_rank, op, during "
      "('discovery' / 'receive'), epoch. Synchronises the GPUs first.");
  m.def(
      "clear_rank_masks",
      [](int axis_slot, int group) {
        nb::gil_scoped_release release;  // synchronises every managed GPU (as rank_masks)
        jax_ep::Runtime::Get().ClearRankMasks(axis_slot, group);
      },
      "axis_slot"_a = -1, "group"_a = -1,
      "Clears the persistent rank masks of one axis slot / group (-1: all) on every managed GPU, "
      "after synchronising them.");

  m.def(
      "faults",
      [] {
        // lock-free and quick: keeps the GIL (a thread of jax_ep.runtime's fault watcher calls it;
        // one that released the GIL could be ended inside the call at the interpreter's exit)
        nb::list faults;
        for (const auto& fault : jax_ep::Runtime::Get().Faults()) faults.append(FaultToDict(fault));
        return faults;
      },
      "Device-side faults recorded by kernels (timeouts, mismatches, stale runtime, ...), one dict "
      "per GPU that faulted: kind, op, field, device_ordinal, rank, waited_rank, waited_ordinal, "
      "expected, observed, elapsed_s, message. Readable after the fault has killed the CUDA "
      "context.");

  m.def(
      "fault_message",
      [](const std::string& kind, const std::string& op, int device_ordinal, int rank,
         int waited_rank, int waited_ordinal, uint64_t expected, uint64_t observed,
         double elapsed_s, const std::string& field, bool per_process) {
        jax_ep::FaultRecord record{};
        record.valid = 1;
        record.kind = IdOfName(jax_ep::FaultKindName, 16, kind, "fault kind");
        record.op_id = IdOfName(jax_ep::OpName, 16, op, "op");
        record.field = field.empty() ? jax_ep::kFieldNone
                                     : IdOfName(jax_ep::FingerprintFieldName, 16, field, "field");
        record.device_ordinal = device_ordinal;
        record.rank = rank;
        record.waited_rank = waited_rank;
        record.waited_ordinal = waited_ordinal;
        record.expected = expected;
        record.observed = observed;
        record.elapsed_ns = static_cast<int64_t>(elapsed_s * 1e9);
        return jax_ep::FaultMessage(record, per_process);
      },
      "kind"_a, "op"_a, "device_ordinal"_a, "rank"_a, "waited_rank"_a, "waited_ordinal"_a,
      "expected"_a, "observed"_a, "elapsed_s"_a = 0.0, "field"_a = "", "per_process"_a = false,
      "The message of a fault record with these fields (what faults() shows; names as there).");
}
