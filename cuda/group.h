// The start of the EP ops that get their group as device scalars (combine, broadcast,
// slot_values): the launch fields they share and the start kernel (group discovery = the start
// barrier of the call). Host-side; kernel in group.cu. Dispatch discovers its group in its notify
// kernel (dispatch.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_state.h"
#include "cuda/ep_layout.h"
#include "cuda/fingerprint.h"

namespace jax_ep {

// Fields common to the ops: the group (device scalars), the layout and the grid.
struct GroupLaunch {
  DeviceState* state;
  CommLayout layout;
  const int32_t* rank;   // [] index along the EP axis
  const int32_t* group;  // [] EP group
  const int32_t* rank_mask;  // [R] nonzero = active (rank masking), or null: every rank active
  int32_t num_ranks;     // R (static)
  int32_t num_tokens;    // T
  int32_t num_topk;      // K
  int32_t axis_slot;
  int32_t num_blocks;
  int32_t send_warps;    // combine: reducer warps; broadcast: sender warps (per block, of 16)
  // Shrink mode (EPConfig.shrink): a peer that misses a bounded wait leaves the call (masked
  // persistently, SyncCounters::rank_masks) instead of making it trap (docs/native.md).
  int32_t shrink;
  // broadcast / broadcast_rank_major only (KernelConfig.broadcast_pull; not with shrink): the
  // receivers pull the rows from the senders' own staging (cuda/dispatch.h DispatchLaunch::pull).
  bool pull;
};

// The fields are in range (the FFI handler validates them; this guards the kernels' arithmetic); a
// pulled call (GroupLaunch::pull) is not in shrink mode. Only broadcast pulls: the other ops refuse it.
bool group_launch_ok(const GroupLaunch& g);

// What every data kernel of a GroupLaunch op takes (combine's and broadcast's structs extend it).
struct DataArgs {
  CommLayout layout;
  int32_t T, K;
  int32_t row_bytes;
  int32_t send_warps;  // combine: the reducers (they send the partial sums)
  bool shrink;         // GroupLaunch::shrink
  bool pull;           // GroupLaunch::pull
};

inline DataArgs data_args(const GroupLaunch& g, int32_t row_bytes) {
  return DataArgs{g.layout, g.num_tokens, g.num_topk, row_bytes, g.send_warps, g.shrink != 0, g.pull};
}

// Bytes of a row of `hidden` elements of `kind` (kRowBF16 or kRowF32) that a data op moves as
// 16-byte vectors; 0 when hidden (at least 8, a multiple of 8) or the kind is out of range.
int32_t float_row_bytes(int32_t hidden, int32_t kind);

// The fingerprint of a GroupLaunch op (cuda/fingerprint.h): the op, R, T, K, and the hidden size and
// RowKind of the rows it moves (0 for slot_values); E, C and the alignment play no part (its
// peers read only the handle's rows of their own tokens).
inline OpFingerprint group_fingerprint(const GroupLaunch& g, int32_t op_id, int32_t hidden,
                                       int32_t row_kind) {
  OpFingerprint fp{};
  fp.op = op_id;
  fp.ranks = g.num_ranks;
  fp.tokens = g.num_tokens;
  fp.topk = g.num_topk;
  fp.hidden = hidden;
  fp.dtype = row_kind;
  fp.transport = g.pull ? kTransportPull : kTransportLoadStore;
  return fp;
}

// Enqueues the one-block start kernel: discovers the group (checking the peers' fingerprints
// against fp), then publishes the call's OpInfo (rank, ordinals, epoch, zeroed work counters) for
// the op's data kernel.
cudaError_t launch_start(const GroupLaunch& g, const OpFingerprint& fp, cudaStream_t stream);

}  // namespace jax_ep
