// NVSHMEM for process model 2 (one process per GPU): bootstrap with a unique id, the symmetric heap,
// peer addresses. The only host file that includes NVSHMEM headers. The data kernels reach NVLink
// peers through plain pointers from PeerAddress; the kernels of cuda/remote.cu call NVSHMEM device
// functions, so Init initialises (or registers with) NVSHMEM through the device library linked
// into this extension (nvshmemi_init_thread), which fills in our module's device state.
//
// NVSHMEM is the copy the `nvidia-nvshmem-cu13` wheel installs (the one jax[cuda13] ships), loaded
// once per process: jax_ep.runtime loads it before the extension, by the path XLA would use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "xla_ffi/device_memory.h"

namespace jax_ep::symmetric_heap {

// Bytes of an NVSHMEM unique id (what process 0 publishes for the others).
size_t UniqueIdBytes();

// A fresh unique id (call on process 0 only, before Init).
std::vector<uint8_t> NewUniqueId();

// Where NVSHMEM stands in this process.
struct Status {
  bool initialized;  // by jax_ep or by someone else (XLA with --xla_gpu_experimental_enable_nvshmem)
  int my_pe;         // -1 when not initialized
  int n_pes;
};
Status Query();

// Joins the NVSHMEM job of `nranks` processes as `rank` on the current CUDA device (collective:
// returns when every process has joined). If NVSHMEM is already initialised (by XLA), uses it,
// checks that its PE numbering is `rank` of `nranks` and registers our device state with it. `heap_bytes` sizes the symmetric heap when
// NVSHMEM_SYMMETRIC_SIZE is not set. Throws std::runtime_error with NVSHMEM's status on failure,
// DeviceMemoryError when the GPU has less free memory than the heap then.
void Init(const std::vector<uint8_t>& unique_id, int pe, int num_pes, uint64_t heap_bytes);

// The symmetric heap's size as configured (NVSHMEM_SYMMETRIC_SIZE, NVSHMEM's default of 1 GiB
// when unset); 0 when the value cannot be read.
uint64_t HeapBytes();

// Bytes of an NVSHMEM size setting ("1073741824", "2G", "1.5g", "512m": k/m/g/t multiply by
// 2^10/20/30/40, later characters ignored, as NVSHMEM reads it); 0 when unreadable.
uint64_t ParseSize(const std::string& text);

// How NVSHMEM's heap takes GPU memory (xla_ffi/device_memory.h, HeapShape): after Init, the shape
// read when NVSHMEM started; before, as NVSHMEM would read its environment (NVSHMEM_HEAP_KIND,
// NVSHMEM_DISABLE_CUDA_VMM, NVSHMEM_CUMEM_GRANULARITY). No NVSHMEM call. A GPU without CUDA VMM
// support makes NVSHMEM fall back to the static heap; the VMM shape is then the cautious answer.
HeapShape CurrentHeapShape();

// Bytes of the static heap Init would ask NVSHMEM for when jax_ep proposes `heap_bytes`
// (NVSHMEM_SYMMETRIC_SIZE wins when set).
uint64_t StaticHeapBytes(uint64_t heap_bytes);

// Whether Init initialised NVSHMEM (then Finalize finalises it).
bool OwnedByJaxEp();

// Collective allocation / free on the symmetric heap (every PE, same sizes, same order). A failed
// allocation of `what` (nvshmem_malloc returns NULL) throws DeviceMemoryError
// (xla_ffi/device_memory.h) with the GPU's free memory and the heap's size; `held_bytes`: what
// jax_ep's buffer being replaced holds on the heap (freed after).
void* Allocate(const std::string& what, uint64_t bytes, uint64_t held_bytes);
void Free(void* pointer);

// The address through which this GPU loads/stores `pe`'s copy of the symmetric object `pointer`,
// or nullptr when `pe` is not reachable by loads/stores (another node).
void* PeerAddress(const void* pointer, int pe);

// Waits until every PE reaches this point (host-side barrier of NVSHMEM, collective).
void BarrierAll();

// Unregisters our device state; finalises NVSHMEM if jax_ep initialised it (then collective).
void Finalize();

}  // namespace jax_ep::symmetric_heap
