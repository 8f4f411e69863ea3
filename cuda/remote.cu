// remote_smoke (see remote.h): NVSHMEM device puts with signals, then a bounded wait of our own.
// Compiled as relocatable device code (-rdc=true) into kernels_rdc and device-linked with
// libnvshmem_device.a, whose nvshmemi_init_thread (symmetric_heap::Init) initialises this module's
// nvshmemi_device_state_d. One block per rank: a smoke test has no reason to take more of the GPU.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "cuda/common.cuh"
#include "cuda/remote.h"

namespace jax_ep {
namespace {

constexpr int kRemoteThreads = 512;
static_assert(kRemoteThreads >= kMaxGroupRanks, "the wait needs one thread per rank");

__global__ void __launch_bounds__(kRemoteThreads)
    remote_smoke_kernel(DeviceState* state, PeerGroup group, const int32_t* tag_ptr, int64_t n,
                        uint32_t* __restrict__ received) {
  // This call's count with each rank (1 for the pair's first call): the signal value, and by its
  // parity the receive half. A writer reaches the half of call k + 2 only after the reader's put of
  // call k + 1, which the reader issues after it has finished reading call k.
  __shared__ uint64_t call_of_rank[kMaxGroupRanks];
  const int num_ranks = group.size;
  const int me = group.my_rank;
  const int my_slot = state->tables.slot;
  const uint64_t slot_elems = static_cast<uint64_t>(n);
  uint32_t* const base = reinterpret_cast<uint32_t*>(state->tables.symmetric_buffer);
  if (threadIdx.x == 0) {
    const uint64_t needed = remote_smoke_comm_bytes(num_ranks, n);
    if (base == nullptr) {  // no symmetric buffer (model 1, refused by the handler): none available
      record_fault_and_trap(state, kFaultStaleRuntime, kOpRemoteSmoke, me, -1, -1, needed, 0, 0);
    }
    require_comm_bytes(state, needed, kOpRemoteSmoke, me);
  }
  if (static_cast<int>(threadIdx.x) < num_ranks) {
    call_of_rank[threadIdx.x] = state->sync.remote_calls[group.ordinals[threadIdx.x]] + 1;
  }
  __syncthreads();

  // The put sources: [R][n] at the start of this PE's symmetric buffer.
  const uint32_t tag = static_cast<uint32_t>(*tag_ptr);
  uint32_t* const send = base;
  for (int peer = 0; peer < num_ranks; ++peer) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      send[peer * slot_elems + i] = peer_smoke_pattern(tag, me, peer, static_cast<uint32_t>(i));
    }
  }
  __threadfence_system();  // the sources are visible to whatever transport reads them
  __syncthreads();

  // Destination and signal are symmetric addresses of THIS PE (our buffer, our state): NVSHMEM
  // maps them to the peer's copies. The signal is set only after the data has arrived.
  for (int peer = 0; peer < num_ranks; ++peer) {
    const uint64_t call = call_of_rank[peer];
    uint32_t* const dest = base + ((1 + (call & 1)) * num_ranks + me) * slot_elems;
    nvshmemx_putmem_signal_nbi_block(dest, send + peer * slot_elems, slot_elems * sizeof(uint32_t),
                                     &state->sync.remote_signal[my_slot], call, NVSHMEM_SIGNAL_SET,
                                     group.ordinals[peer]);
  }

  // Every rank's signal in our own state (bounded: a missing rank records a named fault and traps).
  const int waited = static_cast<int>(threadIdx.x);
  if (waited < num_ranks) {
    const int slot = group.ordinals[waited];
    wait_at_least(&state->sync.remote_signal[slot], call_of_rank[waited], state, kOpRemoteSmoke,
                  me, waited, slot);
    state->sync.remote_calls[slot] = call_of_rank[waited];  // only this thread owns the count
  }
  __syncthreads();  // the acquires above are ordered before every thread's reads below

  for (int writer = 0; writer < num_ranks; ++writer) {
    const uint32_t* slot = base + ((1 + (call_of_rank[writer] & 1)) * num_ranks + writer) * slot_elems;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      received[writer * slot_elems + i] = __ldcv(slot + i);  // fetched again, never a stale line
    }
  }

  // Our puts are complete (sources reusable, data delivered) before the kernel ends.
  __syncthreads();
  if (threadIdx.x == 0) nvshmem_quiet();
}

}  // namespace

cudaError_t launch_remote_smoke(DeviceState* state, const PeerGroup& group, const int32_t* tag,
                                int64_t n, uint32_t* received, cudaStream_t stream) {
  if (state == nullptr || group.size < 1 || group.size > kMaxGroupRanks || group.my_rank < 0 ||
      group.my_rank >= group.size || n < 0) {
    return cudaErrorInvalidValue;
  }
  JAX_EP_LAUNCH(remote_smoke_kernel, 1, kRemoteThreads, 0, stream)(state, group, tag, n, received);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace jax_ep
