// Cross-GPU smoke op (see peer_smoke.h). One block per rank: it needs a single block for the group
// barrier, and a smoke test has no reason to take more of the GPU.
#include "cuda/common.cuh"
#include "cuda/peer_smoke.h"

namespace jax_ep {
namespace {

constexpr int kSmokeThreads = 512;
static_assert(kSmokeThreads >= kMaxGroupRanks, "the barrier needs one thread per rank");

__global__ void __launch_bounds__(kSmokeThreads)
    peer_smoke_kernel(DeviceState* state, PeerGroup group, const int32_t* tag_ptr, int64_t n,
                      uint32_t* __restrict__ received, uint32_t* __restrict__ epochs) {
  // Parity of each pair's barrier count *before* this call's barrier: it picks which half of the
  // slot this call uses. A writer reaches this call's half only after the previous barrier, which
  // the reader passes only after finishing with the other half, so one barrier per call suffices.
  __shared__ uint32_t half_of_rank[kMaxGroupRanks];
  const int num_ranks = group.size;
  const int me = group.my_rank;
  const uint64_t slot_elems = static_cast<uint64_t>(n);
  if (threadIdx.x == 0) {
    require_comm_bytes(state, peer_smoke_comm_bytes(num_ranks, n), kOpPeerSmoke, me);
  }
  if (static_cast<int>(threadIdx.x) < num_ranks) {
    half_of_rank[threadIdx.x] =
        static_cast<uint32_t>(state->sync.barriers_done[group.ordinals[threadIdx.x]] & 1u);
  }
  __syncthreads();

  const uint32_t tag = static_cast<uint32_t>(*tag_ptr);
  for (int peer = 0; peer < num_ranks; ++peer) {
    uint32_t* slot = reinterpret_cast<uint32_t*>(state->tables.comm_buffers[group.ordinals[peer]]) +
                     (static_cast<uint64_t>(half_of_rank[peer]) * num_ranks + me) * slot_elems;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      slot[i] = peer_smoke_pattern(tag, me, peer, static_cast<uint32_t>(i));
    }
  }

  group_barrier_block(state, group, kOpPeerSmoke);

  const uint32_t* mine =
      reinterpret_cast<const uint32_t*>(state->tables.comm_buffers[group.ordinals[me]]);
  for (int writer = 0; writer < num_ranks; ++writer) {
    const uint32_t* slot =
        mine + (static_cast<uint64_t>(half_of_rank[writer]) * num_ranks + writer) * slot_elems;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      // __ldcv: fetch again, never a stale L1 line (peers wrote this memory over NVLink).
      received[writer * slot_elems + i] = __ldcv(slot + i);
    }
  }
  if (static_cast<int>(threadIdx.x) < num_ranks) {
    // The barrier thread of this rank wrote the count; the same thread reads it back.
    epochs[threadIdx.x] =
        static_cast<uint32_t>(state->sync.barriers_done[group.ordinals[threadIdx.x]]);
  }
}

}  // namespace

cudaError_t launch_peer_smoke(DeviceState* state, const PeerGroup& group, const int32_t* tag,
                              int64_t n, uint32_t* received, uint32_t* epochs,
                              cudaStream_t stream) {
  if (state == nullptr || group.size < 1 || group.size > kMaxGroupRanks || group.my_rank < 0 ||
      group.my_rank >= group.size || n < 0) {
    return cudaErrorInvalidValue;
  }
  JAX_EP_LAUNCH(peer_smoke_kernel, 1, kSmokeThreads, 0, stream)(state, group, tag, n, received,
                                                               epochs);
  JAX_EP_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace jax_ep
