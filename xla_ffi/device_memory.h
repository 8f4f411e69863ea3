// GPU memory for jax_ep's own allocations (device states, communication buffers, the NVSHMEM
// symmetric heap) and the one error raised when they do not fit beside XLA's preallocation.
//
// XLA preallocates a fraction of every GPU's memory for JAX's arrays (XLA_PYTHON_CLIENT_MEM_FRACTION,
// default 0.75) and jax_ep allocates outside of it, so a large buffer can fail to fit. Every such
// failure raises DeviceMemoryError (Python: jax_ep.runtime.DeviceMemoryError, a RuntimeError) whose
// text is DeviceMemoryMessage: which buffer, the bytes it needs, the GPU's free/total memory, XLA's
// preallocation and what to do. DeviceMemoryMessage is pure (no CUDA call), so it is tested on the
// CPU through jax_ep._C.device_memory_message.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

namespace jax_ep {

class DeviceMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Where the allocation that did not fit was made.
enum class MemoryKind {
  kCudaMalloc,      // process model 1: cudaMalloc on the GPU
  kSymmetricHeap,   // process model 2: nvshmem_malloc on the NVSHMEM symmetric heap
  kHeapReservation  // process model 2: NVSHMEM reserving its symmetric heap when it starts
};

// The facts of one allocation that failed (or would fail) on one GPU.
struct DeviceMemoryReport {
  std::string buffer;            // what was allocated: "communication buffer", "device state", ...
  MemoryKind kind = MemoryKind::kCudaMalloc;
  int device_ordinal = -1;       // CUDA ordinal
  uint64_t bytes_needed = 0;     // the allocation's size
  bool memory_known = false;     // free/total below come from cudaMemGetInfo
  uint64_t free_bytes = 0;
  uint64_t total_bytes = 0;
  uint64_t held_bytes = 0;       // jax_ep's current buffer on this GPU, freed once the new one is in
                                 // place (growth), 0 when none
  uint64_t heap_bytes = 0;       // kSymmetricHeap: size of the symmetric heap (0: not known)
  std::string cause;             // the failing call and its status; "" for a check made before
                                 // allocating
  // The environment variables the advice depends on, as set (absent = unset):
  // XLA_CLIENT_MEM_FRACTION, XLA_PYTHON_CLIENT_MEM_FRACTION, XLA_PYTHON_CLIENT_PREALLOCATE,
  // XLA_PYTHON_CLIENT_ALLOCATOR, NVSHMEM_SYMMETRIC_SIZE.
  std::map<std::string, std::string> env;
};

// The names of the environment variables a report carries.
extern const char* const kMemoryEnvVars[5];

// "1.50 GiB (1610612736 bytes)"; below 1 KiB just "512 bytes".
std::string FormatBytes(uint64_t bytes);

// The error text for `report`: the one place that phrases it.
std::string DeviceMemoryMessage(const DeviceMemoryReport& report);

// ---- with CUDA calls, for the runtime; unless said otherwise they act on the calling thread's
// current device ----

// (free, total) bytes of GPU `ordinal` (cudaMemGetInfo; the current device is restored).
std::pair<uint64_t, uint64_t> DeviceMemoryInfo(int ordinal);

// A report on the current device: cudaMemGetInfo (memory_known = false with the failure in `cause`
// when that call fails too) and the environment filled in.
DeviceMemoryReport MeasureDeviceMemory(const std::string& buffer, MemoryKind kind,
                                       uint64_t bytes_needed, uint64_t held_bytes,
                                       const std::string& cause);

// Throws DeviceMemoryError when the current device has less than `bytes` free: checked before
// allocating, so that nothing is allocated on any GPU when one of them cannot fit its buffer.
void RequireFreeMemory(const std::string& buffer, uint64_t bytes, uint64_t held_bytes);

// cudaMalloc on the current device; cudaErrorMemoryAllocation becomes DeviceMemoryError, any other
// error the usual CUDA error (std::runtime_error).
void* DeviceMalloc(const std::string& buffer, uint64_t bytes, uint64_t held_bytes);

}  // namespace jax_ep
