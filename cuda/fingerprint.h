// The config fingerprint of an EP call: what must agree across the ranks of a group for a call to
// exchange data (the op, the sizes its buffer layout and protocol depend on, and the transport its
// data crosses by: the two transports of the rank-major ops lay out and signal their data
// differently, so a put rank and a load/store rank would each wait for what the other never
// sends, with the load/store rank's stores landing in the put rank's layout). Every EP op
// publishes it with its directory entry at the start of each call, and every rank compares its
// peers' with its own before it writes anything to them (cuda/fingerprint.cuh); a difference is a
// kFaultMismatch naming the field and both values, never wrong rows or a hang. Plain C++ (host and
// device).
//
// In process model 1 one program drives every GPU, so the fields agree by construction; in process
// model 2 each process traces its own program, and a rank may run another config, another op, or
// be out of step by whole calls.
#pragma once

#include <cstdint>

#include "cuda/host_device.h"

namespace jax_ep {

// How a call's data crosses to its peers (KernelConfig.transport as the call site resolved it;
// EPAttrs::transport): NVLink / P2P loads and stores through the peer tables (every EP op), or
// NVSHMEM puts + signals (the rank-major ops only, cuda/remote_rank_major.h), or the pull form of
// dispatch and broadcast (KernelConfig.dispatch_pull / broadcast_pull, cuda/dispatch.cu): a sender
// stages each token once in its own buffer and every receiver loads it from there, where the
// load/store form stores it into each receiver's buffer (a push rank and a pull rank would each wait
// for rows the other never writes).
enum Transport : int32_t {
  kTransportLoadStore = 0,  // 0: the value-initialised OpFingerprint of every load/store op
  kTransportPut = 1,
  kTransportPull = 2,
};

// What a fingerprint fault is about, in FaultRecord::field. Fields 1..kFingerprintWords are the
// published words (word field - 1); 0 for faults of other kinds.
enum FingerprintField : int32_t {
  kFieldNone = 0,
  kFieldOp = 1,         // OpId
  kFieldRanks = 2,      // R
  kFieldTokens = 3,     // T (tokens per rank)
  kFieldHidden = 4,     // H
  kFieldTopk = 5,       // K
  kFieldExperts = 6,    // E (0 where the op does not use it)
  kFieldCapacity = 7,   // C (dispatch)
  kFieldAlignment = 8,  // expert alignment (dispatch)
  kFieldDtype = 9,      // RowKind of the rows that travel
  kFieldTransport = 10,  // Transport
  // Not a published word: the call's sequence number in its group (its epoch, the count of EP
  // calls of the group this device has entered). A kFaultMismatch with this field: the peer's
  // directory entry is more than one call ahead. A kFaultTimeout of group discovery carries it
  // too: expected / observed are then this rank's call and the last call the peer entered.
  kFieldSequence = 11,
  // Record-only, timeouts: this device's own prep blocks did not all arrive (expected / observed:
  // the blocks; nothing of a peer's is late: the GPU did not schedule them), and a peer's fingerprint
  // words of this call did not all arrive after its directory entry did (observed: the oldest word's
  // call).
  kFieldPrepBlocks = 12,
  kFieldFingerprintWords = 13,
  // Record-only, timeouts of a data flag: the flag held no value of this EP group (another call site's
  // data since the buffer was reused, or nothing yet), so `observed` means nothing.
  kFieldForeignFlag = 14,
};
inline constexpr int kFingerprintWords = 10;

// The fields of one call. Fields an op does not depend on are 0.
struct OpFingerprint {
  int32_t op;
  int32_t ranks;
  int32_t tokens;
  int32_t hidden;
  int32_t topk;
  int32_t experts;
  int32_t capacity;
  int32_t alignment;
  int32_t dtype;
  int32_t transport;  // Transport
};

// The value of published field `field` (kFieldOp .. kFieldTransport).
JAX_EP_HOST_DEVICE inline uint32_t fingerprint_value(const OpFingerprint& f, int field) {
  switch (field) {
    case kFieldOp:
      return static_cast<uint32_t>(f.op);
    case kFieldRanks:
      return static_cast<uint32_t>(f.ranks);
    case kFieldTokens:
      return static_cast<uint32_t>(f.tokens);
    case kFieldHidden:
      return static_cast<uint32_t>(f.hidden);
    case kFieldTopk:
      return static_cast<uint32_t>(f.topk);
    case kFieldExperts:
      return static_cast<uint32_t>(f.experts);
    case kFieldCapacity:
      return static_cast<uint32_t>(f.capacity);
    case kFieldAlignment:
      return static_cast<uint32_t>(f.alignment);
    case kFieldDtype:
      return static_cast<uint32_t>(f.dtype);
    default:
      return static_cast<uint32_t>(f.transport);
  }
}

}  // namespace jax_ep
