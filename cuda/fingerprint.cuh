// Device side of the config fingerprint (cuda/fingerprint.h): each call publishes its fingerprint
// with its directory entry, and every rank checks each peer's before it writes anything to that
// peer. Used by the group discovery of the throughput ops (ep_device.cuh: discover_group) and of
// the low-latency kernels (low_latency.cu: ll_publish / ll_discover); the put transport
// (remote_rank_major.cu: discover_group_put) publishes the same words into the same
// SyncCounters::fingerprints with nvshmem_uint64_p and compares them here, so a rank-major call
// whose ranks resolved different transports is a kFieldTransport mismatch on both sides.
#pragma once

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/fingerprint.h"

namespace jax_ep {

// Right after this device's directory entry for the call `epoch` was stored on `device`: the
// call's fingerprint words there, each (epoch << 32) | value. Relaxed stores, not ordered with the
// entry: ordering them before it (a release) would make this thread wait for their round trip
// over NVLink before the entry goes out, on the handshake's critical path. The reader polls until
// the words carry the call's epoch instead.
__device__ __forceinline__ void publish_fingerprint(DeviceState* device, int axis_slot, int group,
                                                    int rank, uint64_t epoch,
                                                    const OpFingerprint& fp) {
  uint64_t* words = device->sync.fingerprints[axis_slot][group][rank];
  const uint64_t tag = epoch << 32;
#pragma unroll
  for (int f = 0; f < kFingerprintWords; ++f) {
    store_relaxed_sys(words + f, tag | fingerprint_value(fp, f + 1));
  }
}

// The thread of rank `peer`, once the peer's directory entry shows its call `seen` >= this call's
// `epoch`: does the peer run this call? The peer may be one call ahead (it saw every entry of this
// call and went on; it then compared its fingerprint with this call's already, and the comparison
// is symmetric), never more: a larger gap is a sequence mismatch (the ranks' call counts in this
// group differ). Otherwise waits (bounded) for the peer's words of this call and compares them
// with fp. On a difference records a kFaultMismatch (this rank's value in expected, the peer's in
// observed) and returns true: the caller traps after a block barrier (every thread of the block has
// published by then, so each peer sees this call and reports the mismatch on its side too), before
// it writes anything to a peer. noinline: the cold comparison stays out of the spin loops'
// registers; fp by reference (one register at the call; the low-latency kernels keep it in shared
// memory, where passing it by value spilled their live registers around the call).
static __device__ __noinline__ bool peer_call_differs(DeviceState* state, int axis_slot,
                                                      int group, int rank, int peer,
                                                      int peer_ordinal, uint64_t epoch,
                                                      uint64_t seen, const OpFingerprint& fp) {
  if (peer == rank) return false;
  if (seen > epoch + 1) {
    record_fault(state, kFaultMismatch, fp.op, rank, peer, peer_ordinal, epoch, seen, 0,
                 kFieldSequence);
    return true;
  }
  const uint64_t* words = state->sync.fingerprints[axis_slot][group][peer];
  const uint32_t tag = static_cast<uint32_t>(epoch);
  uint64_t w[kFingerprintWords];
  uint64_t start = 0;
  for (;;) {
#pragma unroll
    for (int f = 0; f < kFingerprintWords; ++f) w[f] = load_relaxed_sys(words + f);  // all in flight
    uint32_t oldest = tag;
    bool stale = false;
#pragma unroll
    for (int f = 0; f < kFingerprintWords; ++f) {
      const uint32_t word_tag = static_cast<uint32_t>(w[f] >> 32);
      if (static_cast<int32_t>(word_tag - tag) < 0) {  // an earlier call's word: not here yet
        stale = true;
        oldest = word_tag;
      }
    }
    if (!stale) break;
    const uint64_t now = global_timer_ns();
    if (start == 0) {
      start = now;
    } else if (now - start > state->tables.timeout_ns) {
      record_fault(state, kFaultTimeout, fp.op, rank, peer, peer_ordinal, epoch, oldest,
                   static_cast<int64_t>(now - start), kFieldFingerprintWords);
      return true;
    }
  }
#pragma unroll
  for (int f = 0; f < kFingerprintWords; ++f) {
    const uint32_t mine = fingerprint_value(fp, f + 1);
    const uint32_t theirs = static_cast<uint32_t>(w[f]);
    // a word of the peer's next call (it is one call ahead): compared by the peer already
    if (static_cast<uint32_t>(w[f] >> 32) == tag && theirs != mine) {
      record_fault(state, kFaultMismatch, fp.op, rank, peer, peer_ordinal, mine, theirs, 0,
                   f + 1);
      return true;
    }
  }
  return false;
}

// Every thread of the block, after peer_call_differs: if any thread found a difference, every
// thread makes its own stores (the published entry and words) visible and traps.
__device__ __forceinline__ void trap_if_any_differs(bool differs) {
  if (__syncthreads_or(differs ? 1 : 0) != 0) {
    __threadfence_system();
    __trap();
  }
}

}  // namespace jax_ep
