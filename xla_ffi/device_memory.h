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
#include <vector>

namespace jax_ep {

class DeviceMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Where the allocation that did not fit was made.
enum class MemoryKind {
  kCudaMalloc,      // process model 1: cudaMalloc on the GPU
  kSymmetricHeap,   // process model 2: nvshmem_malloc on the NVSHMEM symmetric heap
  kHeapReservation, // process model 2: NVSHMEM reserving its symmetric heap when it starts
  kHeapGrowth       // process model 2: the collective check before NVSHMEM grows (or starts) its
                    // heap: some process's GPU lacks room (runtime._init_process_group)
};

// kHeapGrowth: one process of the group whose GPU lacks room for what NVSHMEM would allocate.
struct ProcessRoom {
  int process = -1;          // JAX process index (= NVSHMEM PE)
  int device_ordinal = -1;   // its GPU (CUDA ordinal in that process)
  uint64_t heap_bytes = 0;   // what NVSHMEM would take from the GPU's free memory for the step
  uint64_t margin_bytes = 0; // what jax_ep keeps free beside it
  uint64_t free_bytes = 0;   // cudaMemGetInfo on that process
  uint64_t total_bytes = 0;
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
  // kHeapGrowth: the processes lacking room (at least one), the group's size, and how the heap
  // takes memory (HeapShape below): NVSHMEM starts in this step; a CUDA VMM heap growing
  // on demand in steps of `heap_granularity` (else one allocation of the whole heap at start).
  std::vector<ProcessRoom> processes;
  int group_size = 0;
  bool heap_starting = false;
  bool heap_dynamic = true;
  uint64_t heap_granularity = 0;
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

// ---- how NVSHMEM's symmetric heap takes GPU memory (process model 2), pure ----
//
// NVSHMEM 3.4 (src/host/mem/mem_heap.cpp) has two device heaps. The default is CUDA VMM memory
// mapped on demand: nvshmem_malloc that finds no free space in the heap grows it by
// round_up(bytes, granularity) with one cuMemCreate (granularity: NVSHMEM_CUMEM_GRANULARITY,
// default 512 MiB, at least CUDA's 2 MiB, at most 2 GiB), up to NVSHMEM_MAX_MEMORY_PER_GPU
// (128 GiB); NVSHMEM_SYMMETRIC_SIZE does not limit it. If that cuMemCreate fails, NVSHMEM 3.4.5
// tears the heap down and the job dies in its next barrier (illegal memory access), so jax_ep
// checks the room before asking. With NVSHMEM_DISABLE_CUDA_VMM=1 the heap is one cudaMalloc of
// NVSHMEM_SYMMETRIC_SIZE (+ NVSHMEM's own share) when NVSHMEM starts, and nvshmem_malloc beyond it
// returns NULL without touching the GPU. NVSHMEM_HEAP_KIND=SYSMEM puts the heap in host memory.

// What NVSHMEM puts on the heap itself when it starts (team pSync pools: about 4 MiB for each of
// its 32 teams; proxy buffers) plus jax_ep's device state: an upper estimate.
constexpr uint64_t kStartupHeapBytes = 256ull << 20;
// CUDA's recommended allocation granularity (cuMemGetAllocationGranularity) on the GPUs jax_ep
// supports, the smallest step NVSHMEM's VMM heap can have.
constexpr uint64_t kGpuGranularity = 2ull << 20;

struct HeapShape {
  bool on_device = true;                // not NVSHMEM_HEAP_KIND=SYSMEM
  bool dynamic = true;                  // the CUDA VMM heap (else one allocation at start)
  uint64_t granularity = 512ull << 20;  // the VMM heap's growth step / the static heap's rounding
};

// Bytes NVSHMEM takes from the GPU's free memory for one set-up step of jax_ep: `starting`:
// NVSHMEM starts in it (a static heap then allocates `static_heap_bytes` and its own share; a VMM
// heap maps steps for its own allocations first); `allocation_bytes`: what jax_ep then allocates
// on the heap (0: nothing). A VMM heap is assumed to have no free space left for the allocation
// (jax_ep cannot see inside it), so the answer may exceed what NVSHMEM maps.
uint64_t HeapDeviceBytes(const HeapShape& shape, bool starting, uint64_t static_heap_bytes,
                         uint64_t allocation_bytes);

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
