// Low-latency (decode) dispatch / combine over NVLink: fixed receive slots per (local expert,
// source rank), no layout pass, no counts exchange before the data and no separate start kernel.
// Host-side launchers and the buffer layout; kernels in low_latency.cu. Semantics:
// jax_ep.reference.ll_dispatch / ll_combine.
//
// Every op runs fused (one kernel: send, then receive) or in two phases (a send kernel that returns
// once its writes are issued, and a receive kernel that waits and copies out; the send's call
// token, a small device array, carries the call to the receive). The receive regions of each op are
// double-buffered: call n of an op (counted per EP group on the device, fused calls included) uses
// half n % 2, so a sent call must be received before the op's call n + 2, fused or sent; the kernels
// check it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_state.h"
#include "cuda/ep_layout.h"
#include "cuda/fingerprint.h"
#include "cuda/group.h"

namespace jax_ep {

// A row moves in pieces of at most this many bytes: the unit of one warp's copy (and of combine's
// per-piece ready flags). A multiple of 512 (a warp step of 256 bf16 elements).
inline constexpr uint64_t kLLPieceBytes = 8192;
// Threads of the low-latency kernels (16 warps).
inline constexpr int kLLThreads = 512;
// Dynamic shared memory the kernels may take (the opt-in limit of sm_90 is 227 KiB).
inline constexpr uint64_t kLLMaxSharedBytes = 200 * 1024;
// Largest T (a count travels in 16 bits of its flag).
inline constexpr int64_t kLLMaxTokens = 65535;

// How a launch runs an op.
enum LLMode : int32_t { kLLFused = 0, kLLSend = 1, kLLRecv = 2 };

// Offsets in the communication buffer, for half 0; half h is at + h * (ret|disp)_half_bytes.
// Combine's region comes first and depends on (T, K, H) only, so dispatch and combine call sites
// of one shape agree on it whatever the dispatch wire dtype.
struct LLLayout {
  CommLayout base;        // base.total: bytes of the buffer the op needs (the rest unused)
  // combine: what each expert rank returns to this (source) rank
  uint64_t ret_flags;     // uint64 [T * K][ret_pieces]: piece q of (token, top-k) is written
  uint64_t ret_rows;      // [T * K][ret_row_bytes]: the expert output of each (token, top-k)
  uint64_t ret_local;     // int32 [T * K]: the row of y of a (token, top-k) whose expert is on this
                          // rank: it is read there, not copied (its piece-0 flag covers the entry)
  uint64_t ret_half_bytes;
  // dispatch: what each source rank sends to this rank's experts. A token travels once per
  // destination rank (its record), however many of that rank's experts it picked; the receiver
  // copies the record into each of its expert slots.
  uint64_t count_flags;   // uint64 [E_local][R]: (epoch << 24) | (key << 16) | count
  uint64_t slot_flags;    // uint64 [E_local][R][T]: slot i of (expert, source rank) is filled:
                          // (epoch << 32) | (key << 24) | t * K + k, its source (token, top-k)
  uint64_t records;       // [R][T][slot_bytes]: token t of source rank r, row then FP8 scales
  uint64_t disp_half_bytes;
  uint64_t row_bytes;     // dispatched row (bf16 or fp8)
  uint64_t scale_bytes;   // FP8 scales of a row (0 for bf16)
  uint64_t slot_bytes;    // row_bytes + scale_bytes, 16-byte aligned
  uint64_t ret_row_bytes; // combine's bf16 row
  int32_t ret_pieces;     // pieces of a combine row (ceil(ret_row_bytes / kLLPieceBytes))
  int32_t row_pieces;     // pieces of a dispatched row (ceil(row_bytes / kLLPieceBytes))
};

JAX_EP_HOST_DEVICE inline LLLayout make_ll_layout(int64_t num_ranks, int64_t num_tokens,
                                                  int64_t num_topk, int64_t num_experts,
                                                  int64_t hidden, uint64_t row_bytes,
                                                  uint64_t scale_bytes) {
  const uint64_t R = static_cast<uint64_t>(num_ranks);
  const uint64_t T = static_cast<uint64_t>(num_tokens);
  const uint64_t K = static_cast<uint64_t>(num_topk);
  const uint64_t local = num_ranks > 0 ? static_cast<uint64_t>(num_experts) / R : 0;
  const uint64_t kAlign = 256;
  LLLayout L{};
  L.row_bytes = row_bytes;
  L.scale_bytes = scale_bytes;
  L.slot_bytes = align_up_u64(row_bytes + scale_bytes, 16);
  L.ret_row_bytes = align_up_u64(static_cast<uint64_t>(hidden) * 2, 16);
  L.ret_pieces = static_cast<int32_t>((L.ret_row_bytes + kLLPieceBytes - 1) / kLLPieceBytes);
  L.row_pieces = static_cast<int32_t>((row_bytes + kLLPieceBytes - 1) / kLLPieceBytes);
  uint64_t at = 0;
  L.ret_flags = at;    at = align_up_u64(at + T * K * static_cast<uint64_t>(L.ret_pieces) * 8, kAlign);
  L.ret_rows = at;     at = align_up_u64(at + T * K * L.ret_row_bytes, kAlign);
  L.ret_local = at;    at = align_up_u64(at + T * K * 4, kAlign);
  L.ret_half_bytes = at;
  at *= 2;
  const uint64_t dispatch_start = at;
  L.count_flags = at;  at = align_up_u64(at + local * R * 8, kAlign);
  L.slot_flags = at;   at = align_up_u64(at + local * R * T * 8, kAlign);
  L.records = at;      at = align_up_u64(at + R * T * L.slot_bytes, kAlign);
  L.disp_half_bytes = at - dispatch_start;
  at += L.disp_half_bytes;
  L.base.total = at;
  return L;
}

// Dynamic shared memory of an LL kernel (0 when the shape is out of range). Host and device.
JAX_EP_HOST_DEVICE inline uint64_t ll_shared_bytes(bool dispatch, int64_t num_ranks,
                                                   int64_t num_tokens, int64_t num_experts) {
  if (num_ranks < 1 || num_tokens < 0 || num_experts < num_ranks) return 0;
  const uint64_t E = static_cast<uint64_t>(num_experts);
  const uint64_t words = (static_cast<uint64_t>(num_tokens) + 31) / 32;
  // LLCall (512) + the expert x token bit table (dispatch)
  return 512 + (dispatch ? align_up_u64(E * words * 4, 16) : 0);
}

// Fields of both ops: the group (device scalars), the layout and the grid.
struct LLCommon {
  DeviceState* state;
  LLLayout L;
  const int32_t* rank;    // [] index along the EP axis
  const int32_t* group;   // [] EP group
  // [R] int32, nonzero = rank r takes part (send / fused; a receive takes its send's, kept in the
  // half). A masked rank is out of the call both ways: it sends and receives nothing, nobody waits
  // for it or writes to it. nullptr: every rank active.
  const int32_t* rank_mask;
  uint32_t* token;        // the call token. kLLSend: written ([4]: epoch, call, low then high
                          // words); kLLRecv: read
  int32_t mode;           // LLMode
  int32_t num_ranks;      // R
  int32_t num_tokens;     // T
  int32_t num_topk;       // K
  int32_t num_experts;    // E
  int32_t hidden;         // H
  int32_t axis_slot;
  int32_t num_blocks;     // the grid (at most the SMs - 1: the fused kernels need every block resident)
  // Shrink mode (EPConfig.shrink): a peer that misses a bounded wait is masked (persistently,
  // SyncCounters::rank_masks) and the call finishes without it, instead of trapping.
  int32_t shrink;
};

// The fingerprint of a low-latency call (cuda/fingerprint.h): the op, R, T, H, K, E (the slot
// layout depends on all of them) and the RowKind on the wire (ll_combine: bf16). Host and device.
JAX_EP_HOST_DEVICE inline OpFingerprint ll_fingerprint(const LLCommon& c, int32_t op_id,
                                                       int32_t row_kind) {
  OpFingerprint fp{};
  fp.op = op_id;
  fp.ranks = c.num_ranks;
  fp.tokens = c.num_tokens;
  fp.hidden = c.hidden;
  fp.topk = c.num_topk;
  fp.experts = c.num_experts;
  fp.dtype = row_kind;
  return fp;
}

// ll_dispatch: x [T, H] (x_kind: bf16 or f32) -> rows [E_local, R * T, H] (row_kind: bf16 or
// fp8), scales [E_local, R * T, H / 128] (fp8), counts [E_local, R], src_slot [E_local, R * T].
// kLLSend reads x, topk_idx and topk_weights and writes the handle's slots as it sees them;
// kLLRecv reads those (sent_*) and writes the outputs.
//
// The handle's slots (every mode): weights [T, K] float32 (topk_weights where the pair is kept,
// else +0), dest_rank [T, K] (the expert's rank where kept, else -1), num_dropped [] (the used
// pairs not kept). A pair is kept when its sanitised id is used and its rank and this rank are in
// `active` as the call ends (reference.ll_dispatch). The blocks that send a token write its slots
// with the call's ranks (after the shrink agreement); the last block corrects them only where a
// rank was masked during the call (shrink mode: rare), so the common case adds no pass.
struct LLDispatchLaunch {
  LLCommon c;
  const void* x;
  const int32_t* topk_idx;     // [T, K]
  const float* topk_weights;   // [T, K] (fused / send)
  const float* sent_weights;   // [T, K] (recv): its send's weights, dest_rank and num_dropped
  const int32_t* sent_dest;    // [T, K] (recv)
  const int32_t* sent_dropped; // [] (recv)
  void* rows;
  float* scales;
  int32_t* counts;
  int32_t* src_slot;
  int32_t* active;  // [R] (fused / recv): 1 where rank r took part in the call, else 0 (0 also
                    // for a rank masked during it: shrink mode, its data did not all come)
  float* weights;          // [T, K] (every mode): the handle's slots, above
  int32_t* dest_rank;      // [T, K]
  int32_t* num_dropped;    // []
  int32_t x_kind;
  int32_t row_kind;
};
cudaError_t launch_ll_dispatch(const LLDispatchLaunch& p, cudaStream_t stream);

// ll_combine: y [E_local, R * T, H] bf16, src_slot [E_local, R * T] (filled from the front),
// topk_weights [T, K] (0 = skipped), dest_rank [T, K] (the rank each top-k slot went to, -1 =
// skipped) -> out [T, H] bf16. kLLSend reads y and src_slot only; kLLRecv reads topk_weights and
// dest_rank and writes out only. A slot whose rank is masked in this call adds nothing (+0.0).
struct LLCombineLaunch {
  LLCommon c;
  const void* y;  // every mode: a receive reads the rows of its own rank's experts from it
  const int32_t* src_slot;
  const float* topk_weights;
  const int32_t* dest_rank;
  void* out;
};
cudaError_t launch_ll_combine(const LLCombineLaunch& p, cudaStream_t stream);

}  // namespace jax_ep
