// Cross-GPU smoke op: proves the peer tables, peer stores and the group barrier work.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_state.h"
#include "cuda/host_device.h"

namespace jax_ep {

// Bytes of every communication buffer the smoke op uses: two halves (double buffering by pair
// epoch parity) of group.size slots of n uint32 values.
JAX_EP_HOST_DEVICE inline uint64_t peer_smoke_comm_bytes(int64_t group_size, int64_t n) {
  return 2ull * static_cast<uint64_t>(group_size) * static_cast<uint64_t>(n) * sizeof(uint32_t);
}

// Value rank `writer` stores at element i of its slot in rank `reader`'s buffer, for call `tag`.
// Mirrored in tests/gpu/test_peer_smoke_gpu.py (uint32 wrap-around arithmetic).
JAX_EP_HOST_DEVICE inline uint32_t peer_smoke_pattern(uint32_t tag, uint32_t writer,
                                                       uint32_t reader, uint32_t i) {
  return (tag * 0x9E3779B1u) ^ (writer * 0x85EBCA77u) ^ (reader * 0xC2B2AE3Du) ^
         (i * 0x27D4EB2Fu);
}

// Each rank writes peer_smoke_pattern(tag, me, peer, i) into slot `me` of every peer's buffer,
// passes a group barrier, then copies slot w of its own buffer to received[w, :] for every rank w,
// and writes epochs[w] = number of barriers it has passed together with rank w (low 32 bits).
// `tag` is a device pointer (read on the device, never by the host).
cudaError_t launch_peer_smoke(DeviceState* state, const PeerGroup& group, const int32_t* tag,
                              int64_t n, uint32_t* received, uint32_t* epochs,
                              cudaStream_t stream);

}  // namespace jax_ep
