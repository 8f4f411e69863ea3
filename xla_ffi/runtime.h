// Host side of the per-device runtime, in either process model:
//  1. one process drives all local GPUs (Init): DeviceStates and communication buffers from
//     cudaMalloc, peer access between every pair, tables indexed by CUDA ordinal;
//  2. one process per GPU (InitProcessGroup): both live on the NVSHMEM symmetric heap, the tables
//     hold nvshmem_ptr addresses of every PE reachable by loads/stores, indexed by PE, and this
//     PE's own buffer at its symmetric address (tables.symmetric_buffer, where NVSHMEM puts go).
// The kernels see only the tables (cuda/device_state.h: slots), so both models share them.
//
// Owns, per local device ordinal: a DeviceState (created once, never freed while the process runs,
// so its address can be baked into CUDA graphs), a communication buffer, and a FaultRecord in
// host-mapped pinned memory.
//
// Threading: init/shutdown run on the Python thread under a mutex. FFI handlers run on XLA's
// threads, one per device, and read only atomics: they never block on the mutex, because a handler
// blocked while a peer's kernel already spins in a barrier would turn into a timeout.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/device_state.h"
#include "xla_ffi/device_memory.h"

namespace jax_ep {

// A fault a kernel recorded, as the host reads it back: the record and its names and message.
struct FaultInfo {
  FaultRecord record;
  std::string kind;   // FaultKindName: "timeout", "mismatch", "ll_in_flight", ...
  std::string op;     // op name, e.g. "peer_smoke"
  std::string field;  // FingerprintFieldName of a mismatch (or a discovery timeout), else ""
  std::string message;
};

// jax_ep's side stream of a device (jax_ep.overlap): non-blocking, of the highest priority, made with
// the device's state and, like it, never freed. An op's "_side" target records `fork` on XLA's stream
// and makes `stream` wait for it; jax_ep_side_join records `join` on `stream` and makes XLA's wait.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
};

// A rank masked on a device (SyncCounters::rank_masks): which EP group, which rank, and the call
// that masked it (shrink mode).
struct RankMaskInfo {
  int device_ordinal;
  int axis_slot;
  int group;
  int rank;         // the device's own rank in the group
  int masked_rank;  // the rank masked
  std::string op;   // the op whose bounded wait it missed
  std::string during;  // "discovery" (it had not entered the call) or "receive" (its data never came)
  uint64_t epoch;   // the group epoch of that call
};

enum class ProcessModel { kNone, kLocalPeers, kProcessPerGpu };

class Runtime {
 public:
  // The process-wide runtime. Intentionally leaked: no CUDA calls from static destructors (the
  // CUDA runtime may already be gone at exit).
  static Runtime& Get();
  // The same runtime as a shared pointer: every instantiated EP call site (its FFI state) holds one,
  // so Shutdown can refuse while compiled executables may still run EP kernels.
  static std::shared_ptr<Runtime> Shared();

  // Manages `device_ordinals` (added to those already managed) with communication buffers of at
  // least `buffer_bytes`. Idempotent; enables peer access between every pair of managed devices
  // (throws naming the pair when impossible). Growing the buffers synchronises every managed
  // device first: call it only while no EP computation is running (jax_ep does at trace time).
  // A buffer that does not fit in a GPU's free memory throws DeviceMemoryError before any GPU's
  // buffer is replaced.
  void Init(const std::vector<int>& device_ordinals, uint64_t buffer_bytes);

  // Process model 2: this process drives the one GPU `device_ordinal` as NVSHMEM PE `rank` of
  // `nranks` (its JAX process index and count), bootstrapped with `unique_id` (process 0 made it
  // with symmetric_heap::NewUniqueId). Collective: every process calls it, in the same order, with
  // the same rank/nranks and the same `buffer_bytes`. A second call grows the buffer (collectively)
  // when `buffer_bytes` exceeds it, else does nothing. Throws when model 1 is in use.
  void InitProcessGroup(int device_ordinal, const std::vector<uint8_t>& unique_id, int process,
                        int num_processes, uint64_t buffer_bytes);

  // Process model 2, before the collective InitProcessGroup(.., buffer_bytes): what that step would
  // allocate on this process's GPU (no CUDA call, nothing collective). jax_ep.runtime publishes
  // it with the GPU's free memory so that every process refuses together when one lacks room.
  struct ProcessGroupPlan {
    bool first = false;             // the step sets the process group up (no model yet)
    bool nvshmem_starting = false;  // NVSHMEM is not running yet: the step starts it
    uint64_t buffer_bytes = 0;      // the communication buffer after the step
    uint64_t held_bytes = 0;        // the buffer now (kept until the new one is in place)
    HeapShape shape;                // how the heap takes GPU memory
    uint64_t device_bytes = 0;      // what NVSHMEM would take from the GPU's free memory (0: none)
  };
  ProcessGroupPlan PlanProcessGroup(uint64_t buffer_bytes);

  // Process model 2 at exit: frees the buffers and finalises NVSHMEM if jax_ep initialised it
  // (collective). The runtime cannot be used afterwards.
  void FinalizeProcessGroup();

  // Buffers of at least `buffer_bytes` on the GPUs the runtime was given. Model 1: by the last Init
  // (kept across Shutdown, so an executable instantiated after a shutdown sets the runtime up
  // again). Model 2: only checks (growing is collective, see InitProcessGroup). Called by the FFI
  // instantiate handlers. Throws when no GPU was ever given, or when model 2's buffer is too small.
  void Reserve(uint64_t buffer_bytes);

  // Model 1, at trace time: throws DeviceMemoryError (xla_ffi/device_memory.h) when growing the
  // buffers to `buffer_bytes` cannot fit in some GPU's free memory now, so that the error comes
  // from the Python call that traces the op instead of from XLA's instantiation. Allocates nothing.
  // Model 2 grows its buffer at trace time already: nothing to check.
  void CheckBufferFits(uint64_t buffer_bytes);

  // Throws std::runtime_error while instantiated EP call sites hold the runtime (their executables
  // are alive). Otherwise synchronises every managed device, frees the communication buffers and
  // marks the runtime uninitialised. DeviceStates and fault records stay allocated: a CUDA graph replayed after
  // shutdown then traps with a clear message instead of touching freed memory. Peer access stays
  // enabled (XLA may rely on it).
  void Shutdown();

  // ---- lock-free, for FFI handlers ----
  // The device's state, or nullptr if the device is not managed.
  DeviceState* State(int device_ordinal) const;
  // The slot of a managed local device in the tables (its ordinal in model 1, its PE in model 2),
  // -1 if not managed.
  int Slot(int device_ordinal) const;
  // Whether the GPU of `slot` is in the tables (managed in model 1, reachable PE in model 2).
  bool SlotReachable(int slot) const;
  uint64_t CommBytes() const { return comm_bytes_.load(std::memory_order_acquire); }
  // Streaming multiprocessors of a managed device (0 if not managed).
  int SmCount(int device_ordinal) const;
  // The side stream of a managed device, or nullptr if the device is not managed.
  const SideStream* Side(int device_ordinal) const;

  // ---- queries ----
  std::vector<int> ManagedDevices() const;
  ProcessModel Model() const { return model_.load(std::memory_order_acquire); }
  // Model 2: this process's PE, the number of PEs, and the PEs reachable by loads/stores.
  int Pe() const { return pe_; }
  int NumPes() const { return num_pes_; }
  std::vector<int> ReachablePes() const;
  double TimeoutSeconds() const;
  // The recorded faults. Lock-free (pinned host memory, readable after a trap killed the context).
  std::vector<FaultInfo> Faults() const;
  // How many instantiated EP call sites (their FFI states) hold the runtime: Shutdown and
  // FinalizeProcessGroup refuse while any does.
  static long Holders() { return Holder().use_count() - 1; }
  // The fault records' messages, each on a line of its own ("" when there are none).
  std::string FaultMessages() const;
  // The persistent rank masks of every managed device (one entry per masked rank); synchronises
  // the devices first. ClearRankMasks: clears those of axis slot `axis_slot` / group `group` (-1:
  // every one) on every managed device, after synchronising them (call it between steps).
  std::vector<RankMaskInfo> RankMasks() const;
  void ClearRankMasks(int axis_slot, int group) const;

  static int DeviceCount();  // throws if CUDA has no usable device
  static std::vector<std::vector<bool>> PeerAccessMatrix(const std::vector<int>& device_ordinals);

 private:
  Runtime();
  static std::shared_ptr<Runtime>& Holder();
  // Sets the fields every table of `ordinal` carries (its fault record, its ordinal) and copies the
  // tables into the device's state. The caller holds mutex_ and has selected the device.
  void UploadTables(int ordinal, int slot, DeviceTables tables);
  // Creates the pinned fault records once. The caller holds mutex_.
  void EnsureFaultRecords();
  // Creates the side stream of `ordinal` once. The caller holds mutex_ and has selected the device.
  void EnsureSideStream(int ordinal);
  // Model 2: new symmetric buffer of `bytes`, tables pointing at every reachable PE's copy, old
  // buffer freed (collective). The caller holds mutex_ and has selected the device.
  void RebuildProcessGroupBuffer(uint64_t bytes, uint64_t timeout_ns);

  mutable std::mutex mutex_;  // serialises Init/Shutdown/queries; never taken by handlers
  std::vector<int> devices_;  // every GPU Init was given (kept across Shutdown)
  std::atomic<DeviceState*> states_[kMaxDevices];
  std::atomic<bool> managed_[kMaxDevices];
  std::atomic<uint64_t> comm_bytes_{0};
  std::atomic<int> sm_count_[kMaxDevices];
  std::atomic<const SideStream*> side_[kMaxDevices];
  uint8_t* comm_buffers_[kMaxDevices] = {};
  bool peer_enabled_[kMaxDevices][kMaxDevices] = {};
  // host view, kMaxDevices records, set once (EnsureFaultRecords) and never freed: Faults() reads
  // them without mutex_ (a reader must not wait on a set-up that may be the one failing)
  std::atomic<FaultRecord*> fault_records_{nullptr};
  uint64_t timeout_ns_ = 0;
  std::atomic<ProcessModel> model_{ProcessModel::kNone};
  std::atomic<int> slot_[kMaxDevices];
  // Model 2 (set once by InitProcessGroup)
  int pe_ = -1;
  int num_pes_ = 0;
  int pg_ordinal_ = -1;  // the one local GPU
  std::atomic<bool> reachable_[kMaxDevices];
};

// Timeout of every device-side spin-wait, from JAX_EP_TIMEOUT_S (seconds), else the process model's
// default: 10 s with one process driving every GPU (one host enqueues every rank's call), 100 s with
// a process per GPU, where each process enqueues its own and a rank whose host is busy (compiling,
// writing a checkpoint) would otherwise make its peers fault (DeepEP bounds its waits at ~100 s).
constexpr double kDefaultTimeoutSeconds = 10.0;
constexpr double kProcessGroupTimeoutSeconds = 100.0;
uint64_t TimeoutNsFromEnv(double default_seconds);

}  // namespace jax_ep
