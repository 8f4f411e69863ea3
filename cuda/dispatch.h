// Throughput dispatch over NVLink: host-side launcher (kernels in dispatch.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_state.h"
#include "cuda/ep_layout.h"
#include "cuda/fingerprint.h"

namespace jax_ep {

// Everything one rank's dispatch needs. Shapes are static (validated by the FFI handler); rank and
// group are device scalars (lax.axis_index), resolved on the device by group discovery.
//
// rank_major: dispatch_rank_major (DeepEP's contract): the same prep / notify / main kernels
// and the same hop (each token crosses NVLink once per destination rank into its staging [me][t]),
// but the receivers write one row per (source token, this rank), source-rank major, token order
// within (R * T rows; rows past the last are zero / -1 / 0), with the token's local expert ids and
// gate weights: rows, scales, row_ids, row_topk_weights, src_index, is_token_in_rank,
// tokens_per_rank and expert_counts (= num_tokens_per_expert: nothing drops) are written;
// capacity = R * T, alignment 1; group_sizes, row_weights, num_dropped, token_rows are unused.
struct DispatchLaunch {
  DeviceState* state;
  CommLayout layout;  // make_comm_layout(R, T, K, E, row_bytes, num_scales * 4)
  // inputs
  const void* x;              // [T, H] bf16 or f32 (x_kind)
  const int32_t* topk_idx;    // [T, K]
  const float* topk_weights;  // [T, K]
  const int32_t* rank;        // [] this device's index along the EP axis
  const int32_t* group;       // [] its EP group (index over the other manual mesh axes)
  const int32_t* rank_mask;   // [R] nonzero = active (rank masking), or null: every rank active
  // outputs (every element written, except rows past sum(group_sizes), which stay unspecified)
  void* rows;                 // [C, H] row_kind
  float* scales;              // [C, H / 128] for FP8 rows, else unused
  int32_t* group_sizes;       // [E_local]
  int32_t* expert_counts;     // [E_local]
  float* row_weights;         // [C]
  int32_t* num_dropped;       // []
  int32_t* active;            // [R] 1 where rank r took part in the call (the rank_mask AND NOT
                              //   the persistent mask), else 0; expert-major only (may be null)
  int32_t* src_index;         // [C]
  int32_t* token_rows;        // [R * T, K]
  bool* is_token_in_rank;     // [T, R]
  // rank-major outputs
  int32_t* row_ids;           // [R * T, K] local expert id of each slot here, else -1
  float* row_topk_weights;    // [R * T, K] gate weight where row_ids >= 0, else 0
  int32_t* tokens_per_rank;   // [R] rows from each source rank
  // static sizes
  int32_t num_tokens;
  int32_t num_topk;
  int32_t num_experts;
  int32_t num_ranks;
  int32_t hidden;
  int32_t capacity;
  int32_t alignment;
  int32_t x_kind;     // RowKind: kRowBF16 or kRowF32
  int32_t row_kind;   // RowKind of rows: x_kind, kRowBF16 (from f32) or kRowFP8
  int32_t num_blocks;  // blocks of the data kernel (<= num_sms, < SMs of the device)
  int32_t send_warps;  // warps per block that send (the others receive), in [1, 15]
  int32_t axis_slot;   // directory slot of the EP axis, in [0, kDirectoryAxes)
  bool use_tma;        // raw row copies with bulk (TMA) copies through shared memory
  bool rank_major;     // dispatch_rank_major (above)
  // Receivers pull the rows (KernelConfig.dispatch_pull; not with shrink): a sender writes each
  // token routed to another rank ONCE into its OWN staging [me][t] and every receiver loads it from
  // there over NVLink, instead of the sender storing it into each receiver's staging. An SM stores
  // one 32-byte sector per clock whatever the destination, while a load request carries a 128-byte
  // line: at EP4 (DeepSeek-V3, ~2.7 remote ranks per token) a rank's SMs store ~0.37x the staged
  // bytes they store pushing (docs/benchmarks.md, sessions 47 and 51). The next call's start
  // barrier (every peer has finished this call) protects the sender's staging, as for a push.
  bool pull;
  // Shrink mode (EPConfig.shrink): a peer that misses a bounded wait leaves the call (masked
  // persistently) instead of making it trap; a kernel after the main one empties the rows of a
  // source whose data never came (dispatch.cu, "pending" and "fixup").
  int32_t shrink;
};

// Bytes of a dispatched row for the row kind.
inline int64_t dispatch_row_bytes(int64_t hidden, int32_t row_kind) {
  return hidden * (row_kind == kRowF32 ? 4 : row_kind == kRowBF16 ? 2 : 1);
}

// The fingerprint of a dispatch call (cuda/fingerprint.h): every static size of its layout and
// protocol (the peers compute each other's segment offsets from E, C and the alignment; the
// rank-major mode has neither capacity nor alignment), and the RowKind of the rows on the wire
// (x's own dtype is this rank's business).
inline OpFingerprint dispatch_fingerprint(const DispatchLaunch& p) {
  OpFingerprint fp{};
  fp.op = p.rank_major ? kOpDispatchRankMajor : kOpDispatch;
  fp.ranks = p.num_ranks;
  fp.tokens = p.num_tokens;
  fp.hidden = p.hidden;
  fp.topk = p.num_topk;
  fp.experts = p.num_experts;
  fp.capacity = p.rank_major ? 0 : p.capacity;
  fp.alignment = p.rank_major ? 0 : p.alignment;
  fp.dtype = p.row_kind;
  fp.transport = p.pull ? kTransportPull : kTransportLoadStore;
  return fp;
}

// Enqueues the dispatch kernels on `stream` (graph-capturable: kernels only).
cudaError_t launch_dispatch(const DispatchLaunch& args, cudaStream_t stream);

}  // namespace jax_ep
