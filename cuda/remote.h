// Transport smoke op of process model 2: proves NVSHMEM device puts + signals (the transport of the
// inter-node path) from kernels of jax_ep's own relocatable-device-code library (kernels_rdc),
// device-linked with NVSHMEM's device library. Host-side declarations; kernel in remote.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_state.h"
#include "cuda/peer_smoke.h"  // peer_smoke_pattern: the same data as peer_smoke

namespace jax_ep {

// Bytes of the communication buffer remote_smoke uses (uint32 elements, from offset 0): a send
// area [R][n] (the put sources, on the symmetric heap as RDMA transports need), then two receive
// halves [2][R][n] (double buffering by the parity of the pair's call count, as in peer_smoke).
// The signal words live in DeviceState (SyncCounters::remote_signal), not in the buffer: other
// ops overwrite the buffer between calls, and a stale signal must never look like a new one.
JAX_EP_HOST_DEVICE inline uint64_t remote_smoke_comm_bytes(int64_t group_size, int64_t n) {
  return 3ull * static_cast<uint64_t>(group_size) * static_cast<uint64_t>(n) * sizeof(uint32_t);
}

// Process model 2 only (NVSHMEM initialised, tables.symmetric_buffer set). Each rank writes
// peer_smoke_pattern(tag, me, peer, i), i < n, into slot `me` of every peer's buffer (itself
// included) with one nvshmemx_putmem_signal_nbi_block per peer, whose signal (NVSHMEM_SIGNAL_SET)
// sets the peer's remote_signal[my slot] to the pair's call count (counted on the device, so CUDA
// graph replays stay in step); then it waits, bounded by the runtime's timeout, for every peer's
// signal and copies slot w of its own buffer to received[w, :]. `tag` is a device pointer.
cudaError_t launch_remote_smoke(DeviceState* state, const PeerGroup& group, const int32_t* tag,
                                int64_t n, uint32_t* received, cudaStream_t stream);

}  // namespace jax_ep
