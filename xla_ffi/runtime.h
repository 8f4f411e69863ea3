// Host side of the per-device runtime (process model 1: one process drives all local GPUs).
//
// Owns, per local device ordinal: a DeviceState in device memory (created once, never freed, so
// its address can be baked into CUDA graphs), a communication buffer (cudaMalloc), peer access to
// every other managed device, and a FaultRecord in host-mapped pinned memory.
//
// Threading: init/shutdown run on the Python thread under a mutex. FFI handlers run on XLA's
// threads, one per device, and read only atomics: they never block on the mutex, because a handler
// blocked while a peer's kernel already spins in a barrier would turn into a timeout.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/device_state.h"

namespace jax_ep {

// A fault a kernel recorded (see FaultRecord), as the host reads it back.
struct FaultInfo {
  std::string kind;   // "timeout", "stale_runtime" or "bad_argument"
  std::string op;     // op name, e.g. "peer_smoke"
  int device_ordinal;
  int rank;
  int waited_rank;
  int waited_ordinal;
  uint64_t expected;
  uint64_t observed;
  int64_t elapsed_ns;
  std::string message;
};

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
  void Init(const std::vector<int>& device_ordinals, uint64_t buffer_bytes);

  // Buffers of at least `buffer_bytes` on the GPUs the runtime was given (by the last Init; kept
  // across Shutdown, so an executable instantiated after a shutdown sets the runtime up again).
  // Called by the FFI instantiate handlers. Throws when no GPU was ever given.
  void Reserve(uint64_t buffer_bytes);

  // Throws std::runtime_error while instantiated EP call sites hold the runtime (their executables
  // are alive). Otherwise synchronises every managed device, frees the communication buffers and
  // marks the runtime uninitialised. DeviceStates and fault records stay allocated: a CUDA graph replayed after
  // shutdown then traps with a clear message instead of touching freed memory. Peer access stays
  // enabled (XLA may rely on it).
  void Shutdown();

  // ---- lock-free, for FFI handlers ----
  // The device's state, or nullptr if the device is not managed.
  DeviceState* State(int device_ordinal) const;
  uint64_t CommBytes() const { return comm_bytes_.load(std::memory_order_acquire); }
  // Streaming multiprocessors of a managed device (0 if not managed).
  int SmCount(int device_ordinal) const;

  // ---- queries ----
  std::vector<int> ManagedDevices() const;
  double TimeoutSeconds() const;
  std::vector<FaultInfo> Faults() const;

  static int DeviceCount();  // throws if CUDA has no usable device
  static std::vector<std::vector<bool>> PeerAccessMatrix(const std::vector<int>& device_ordinals);

 private:
  Runtime();
  static std::shared_ptr<Runtime>& Holder();
  // Sets the fields every table of `ordinal` carries (its fault record, its ordinal) and copies the
  // tables into the device's state. The caller holds mutex_ and has selected the device.
  void UploadTables(int ordinal, DeviceTables tables);

  mutable std::mutex mutex_;  // serialises Init/Shutdown/queries; never taken by handlers
  std::vector<int> devices_;  // every GPU Init was given (kept across Shutdown)
  std::atomic<DeviceState*> states_[kMaxDevices];
  std::atomic<bool> managed_[kMaxDevices];
  std::atomic<uint64_t> comm_bytes_{0};
  std::atomic<int> sm_count_[kMaxDevices];
  uint8_t* comm_buffers_[kMaxDevices] = {};
  bool peer_enabled_[kMaxDevices][kMaxDevices] = {};
  FaultRecord* fault_records_ = nullptr;  // host view, kMaxDevices records, never freed
  uint64_t timeout_ns_ = 0;
};

// Timeout of every device-side spin-wait, from JAX_EP_TIMEOUT_S (seconds, default 10).
uint64_t TimeoutNsFromEnv();

}  // namespace jax_ep
